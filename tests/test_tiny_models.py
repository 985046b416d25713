"""The tiny checkpoints behave like real hub checkpoints of their architecture, so tests built on them mean
something."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import tiny_models
from tests.tiny_models import (
    COMPLETE_MARKER,
    GEMMA3_SLIDING_WINDOW,
    TINY_ARCHS,
    build_large_llama,
    build_sharded_checkpoint,
    build_tiny_checkpoint,
    tiny_checkpoint_dir,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

PROMPT = "The customer report was good, but the invoice price was not. Summary: 2024 ☃"


def saved_tensor_names(checkpoint) -> set[str]:
    names: set[str] = set()
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            names.update(handle.keys())
    return names


def load(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def chat_ids(tokenizer, text: str = PROMPT) -> torch.Tensor:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_architecture_loads_and_runs_a_forward(tiny_checkpoint, arch):
    checkpoint = tiny_checkpoint(arch)
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = load(checkpoint)

    assert config["dtype"] == "float32"
    # AutoTokenizer picks a class per model type (Qwen2Tokenizer for qwen2); every one must fit the embedding.
    assert config["vocab_size"] >= len(tokenizer)
    assert tokenizer.decode(tokenizer(PROMPT)["input_ids"]) == PROMPT
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
    )
    input_ids = chat_ids(tokenizer)
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_tokenizer_round_trips_any_text_and_formats_chat(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    ids = tokenizer(PROMPT)["input_ids"]
    assert tokenizer.decode(ids) == PROMPT  # byte-level: unseen characters survive
    assert 300 <= len(tokenizer) <= 512
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The chat markers are single special tokens, so a model can learn to stop on <|im_end|>.
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert "<|im_start|>" in tokenizer.decode(chat_ids(tokenizer, "hi")[0])


def test_checkpoint_is_reused_and_deterministic(tiny_checkpoint, tmp_path):
    cached = tiny_checkpoint("qwen2")
    assert (cached / COMPLETE_MARKER).exists()
    stamp = (cached / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_checkpoint("qwen2", cached.parent) == cached
    assert (cached / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt

    rebuilt = build_tiny_checkpoint("qwen2", tmp_path)  # a cold cache builds
    assert rebuilt.name == cached.name
    assert (rebuilt / "model.safetensors").read_bytes() == (cached / "model.safetensors").read_bytes()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # no staging dir left behind


@pytest.fixture
def fresh_cache_key():
    """cache_key is computed once per process: the tests that change its inputs recompute it, before and after."""
    tiny_models.cache_key.cache_clear()
    yield
    tiny_models.cache_key.cache_clear()


def test_the_cache_entry_is_named_by_the_library_versions_and_the_builder_source(tiny_checkpoint, fresh_cache_key):
    import transformers

    import batchrun

    cached = tiny_checkpoint("gpt2")
    assert cached.name.startswith(f"gpt2-transformers{transformers.__version__}-batchrun{batchrun.__version__}-")
    assert cached == tiny_checkpoint_dir("gpt2", cached.parent)
    names = {cached.name}
    real_versions, real_source = tiny_models.library_versions(), tiny_models.builder_source()
    edited = real_source.replace("hidden_size=64", "hidden_size=32")
    assert edited != real_source
    for changed, versions, source in (("transformers", real_versions | {"transformers": "4.0.0"}, real_source),
                                      ("batchrun", real_versions | {"batchrun": "0.2.0"}, real_source),
                                      ("torch", real_versions | {"torch": "0.0.1+cpu"}, real_source),
                                      ("tokenizers", real_versions | {"tokenizers": "0.0.1"}, real_source),
                                      ("builder", real_versions, edited)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tiny_models, "library_versions", lambda versions=versions: versions)
            patch.setattr(tiny_models, "builder_source", lambda source=source: source)
            tiny_models.cache_key.cache_clear()
            name = tiny_checkpoint_dir("gpt2", cached.parent).name
        assert name not in names, f"a changed {changed} reuses {name}"
        assert "+" not in name and "/" not in name
        names.add(name)
    tiny_models.cache_key.cache_clear()
    assert tiny_checkpoint_dir("gpt2", cached.parent) == cached  # and nothing else decides the name


def test_a_changed_builder_builds_anew_beside_the_old_entry(tiny_checkpoint, tmp_path, monkeypatch, fresh_cache_key):
    old = Path(shutil.copytree(tiny_checkpoint("gpt2"), tmp_path / tiny_checkpoint("gpt2").name))
    stamp = (old / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny_models, "builder_source", lambda: "a builder edited since\n")
    tiny_models.cache_key.cache_clear()
    new = build_tiny_checkpoint("gpt2", tmp_path)
    assert new != old and new.parent == old.parent
    assert (new / COMPLETE_MARKER).exists() and json.loads((new / "config.json").read_text())["model_type"] == "gpt2"
    assert (old / "model.safetensors").stat().st_mtime_ns == stamp  # the old entry is neither reused nor touched


BUILDER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.tiny_models import build_tiny_checkpoint
shared = Path(sys.argv[2])
(shared / f"ready-{os.getpid()}").touch()
while not (shared / "go").exists():  # the imports take seconds: all processes start building together after them
    time.sleep(0.01)
print(build_tiny_checkpoint("llama", shared / "cache"))
"""


@pytest.mark.slow
def test_processes_building_one_entry_of_a_cold_cache_at_once_all_get_one_complete_copy(tmp_path, tiny_checkpoint):
    """A leftover incomplete directory (an interrupted build) sits where the entry goes: it is replaced, and every
    process returns the same complete checkpoint, with no staging directory left."""
    stale = tiny_checkpoint_dir("llama", tmp_path / "cache")
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    builders = [subprocess.Popen([sys.executable, "-c", BUILDER, str(REPO_ROOT), str(tmp_path)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("ready-*"))) < len(builders) and time.monotonic() < deadline:
            assert all(builder.poll() is None for builder in builders), "a builder exited before building"
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outputs = [builder.communicate(timeout=300) for builder in builders]
    finally:
        for builder in builders:
            builder.kill()
            builder.wait()
    assert all(builder.returncode == 0 for builder in builders), [err for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {str(stale)}
    assert (stale / COMPLETE_MARKER).exists() and json.loads((stale / "config.json").read_text())["vocab_size"] > 0
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".tmp-" in p.name] == []
    # the weights every builder writes: those of the session's cache entry
    assert (stale / "model.safetensors").read_bytes() == (tiny_checkpoint("llama") / "model.safetensors").read_bytes()


def test_incomplete_directory_is_rebuilt_not_trusted(tmp_path):
    stale = tiny_checkpoint_dir("llama", tmp_path)
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # e.g. left by an interrupted older build
    checkpoint = build_tiny_checkpoint("llama", tmp_path)
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == "llama"
    assert (checkpoint / COMPLETE_MARKER).exists()


def test_gemma3_mixes_sliding_and_full_attention_and_the_window_matters(tiny_checkpoint):
    checkpoint = tiny_checkpoint("gemma3")
    config = json.loads((checkpoint / "config.json").read_text())
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert config["sliding_window"] == GEMMA3_SLIDING_WINDOW
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    input_ids = chat_ids(tokenizer)
    assert input_ids.shape[1] > 2 * GEMMA3_SLIDING_WINDOW

    windowed = load(checkpoint)
    unwindowed = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, sliding_window=4096).eval()
    with torch.no_grad():
        a, b = windowed(input_ids).logits, unwindowed(input_ids).logits
    window = GEMMA3_SLIDING_WINDOW
    assert torch.allclose(a[:, :window], b[:, :window], atol=1e-5)  # inside the window nothing changes
    assert not torch.allclose(a[:, -1], b[:, -1], atol=1e-3)  # beyond it the window masks real context


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3", "gpt2"])
def test_saved_names_match_module_names_for_plain_architectures(tiny_checkpoint, arch):
    checkpoint = tiny_checkpoint(arch)
    module_names = set(load(checkpoint).state_dict())
    saved = saved_tensor_names(checkpoint)
    assert saved <= module_names
    # Only a tied head may be absent from the file.
    assert module_names - saved <= {"lm_head.weight"}


def test_gpt_neox_saves_its_head_under_another_name(tiny_checkpoint):
    checkpoint = tiny_checkpoint("gpt_neox")
    saved, module_names = saved_tensor_names(checkpoint), set(load(checkpoint).state_dict())
    assert saved - module_names == {"embed_out.weight"}
    assert module_names - saved == {"lm_head.weight"}


def test_mixtral_saves_per_expert_tensors_that_the_module_fuses(tiny_checkpoint):
    checkpoint = tiny_checkpoint("mixtral")
    saved, module_names = saved_tensor_names(checkpoint), set(load(checkpoint).state_dict())
    layer0_saved = {name for name in saved - module_names if name.startswith("model.layers.0.")}
    expected_experts = {
        f"model.layers.0.block_sparse_moe.experts.{expert}.{w}.weight"
        for expert in range(4) for w in ("w1", "w2", "w3")
    }
    assert layer0_saved == expected_experts | {"model.layers.0.block_sparse_moe.gate.weight"}
    layer0_module = {name for name in module_names - saved if name.startswith("model.layers.0.")}
    assert layer0_module == {
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.gate.weight",
    }


def test_sharded_checkpoint_holds_the_same_model_in_several_files(tiny_checkpoint, test_cache):
    sharded = build_sharded_checkpoint("llama", test_cache / "tiny")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = {p.name for p in sharded.glob("*.safetensors")}
    assert len(shard_files) >= 3
    assert set(index["weight_map"].values()) == shard_files
    assert set(index["weight_map"]) == saved_tensor_names(sharded)

    input_ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert torch.equal(load(sharded)(input_ids).logits, load(tiny_checkpoint("llama"))(input_ids).logits)


def test_large_llama_reaches_the_requested_size_and_runs(tmp_path):
    target = 6_000_000
    checkpoint = build_large_llama(tmp_path, target, num_layers=3, vocab_size=1024, shard_bytes=1_500_000)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    on_disk = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    assert abs(index["metadata"]["total_size"] - target) < 0.15 * target
    assert on_disk >= index["metadata"]["total_size"]
    assert len(set(index["weight_map"].values())) >= 3
    assert set(index["weight_map"]) == saved_tensor_names(checkpoint)

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 3
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    with torch.no_grad():
        logits = model(chat_ids(tokenizer)).logits
    assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_large_llama_takes_a_width_and_reaches_the_size_with_as_many_layers_as_it_needs(tmp_path):
    target = 6_000_000
    checkpoint = build_large_llama(tmp_path, target, vocab_size=1024, hidden_size=128, shard_bytes=1_500_000)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["hidden_size"] == 128 and config["num_attention_heads"] * 64 == 128
    assert config["intermediate_size"] == 320  # TinyLlama's 2.75x, rounded down to a multiple of 64
    on_disk = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    per_layer = 2 * (2 * 128 * 128 + 2 * config["num_key_value_heads"] * 64 * 128 + 3 * 128 * 320 + 2 * 128)
    assert abs(on_disk - target) < per_layer  # within a layer of the size asked for
    assert checkpoint.name.endswith(f"-h128-L{config['num_hidden_layers']}-v1024")
    with pytest.raises(ValueError, match="not both"):
        build_large_llama(tmp_path, target, num_layers=3, hidden_size=128)
