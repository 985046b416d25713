"""A GGUF file as a model: found as `--model` or alone in a directory, its config built from the file's metadata as
transformers builds it (`from_pretrained(..., gguf_file=...)`), and the architectures refused before any weight is
read. Nothing is converted or written beside the file.

No torch: the config is built from the index's metadata through transformers' own tables of GGUF keys
(transformers.integrations.ggml), which import none.
"""
from __future__ import annotations

import os
from pathlib import Path

from batchrun.checkpoint.tensors import GGUF_SUFFIX, CheckpointError
from batchrun.checkpoint.gguf_index import SPLIT_NAME, GGUFIndex, read_gguf_index, split_parts

# GGUF architectures whose tensors transformers splits, fuses, transposes or renames on load (its tensor processors
# for them) in ways batchrun's reader does not repeat: refused by name.
UNREAD_ARCHITECTURES = frozenset({"qwen2moe", "qwen3moe", "gpt-oss", "gpt_oss", "bloom", "t5", "t5encoder", "gpt2",
                                  "mamba", "lfm2", "minimax-m2"})
# GGUF architectures whose norm weights llama.cpp stores plus one; transformers subtracts the one on load (its
# Gemma2 and Nemotron tensor processors), for every tensor whose name holds "norm.weight".
NORM_OFFSET_ARCHITECTURES = frozenset({"gemma2", "gemma3", "nemotron"})
# Config fields transformers' config classes fill in for a GGUF config that lacks them, which sizing reads: Gemma 3
# attends fully on every sixth layer and through a sliding window on the others.
CONFIG_CLASS_DEFAULTS = {"gemma3_text": {"sliding_window_pattern": 6}}
# The architectures whose tied head transformers keeps untied when a GGUF has no output.weight.
UNTIED_WITHOUT_OUTPUT = ("falcon", "bloom")


def gguf_in_directory(directory: Path) -> Path | None:
    """The one GGUF model in `directory` (the first part of a split one), None when it holds none; several are
    refused, naming them."""
    files = sorted(path for path in directory.glob(f"*{GGUF_SUFFIX}") if path.is_file())
    models = sorted({split_parts(path)[0] if SPLIT_NAME.match(path.name) else path for path in files})
    if len(models) > 1:
        raise CheckpointError(f"{directory}: holds {len(models)} GGUF models ({', '.join(p.name for p in models)}); "
                              "name the file to run with --model")
    return models[0] if models else None


def gguf_config(index: GGUFIndex) -> dict:
    """The config transformers builds from this GGUF's metadata (load_gguf_checkpoint's "config"), or CheckpointError
    naming the file where transformers cannot map its architecture or batchrun cannot read its tensors."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch, model_type = index.architecture, transformers_architecture(index)
    where = index.files[0]
    if arch in _newer_reader_architectures():
        raise CheckpointError(f"{where}: GGUF architecture {arch!r}, which transformers reads through its newer GGUF "
                              "loader (array metadata, fused tensors); batchrun does not read it")
    if arch not in GGUF_CONFIG_MAPPING and model_type not in GGUF_CONFIG_MAPPING:
        known = ", ".join(sorted(name for name in GGUF_CONFIG_MAPPING if name not in ("general", "tokenizer")))
        raise CheckpointError(f"{where}: GGUF architecture {arch!r}, which transformers cannot read from GGUF (it "
                              f"reads {known})")
    if arch in UNREAD_ARCHITECTURES:
        raise CheckpointError(f"{where}: GGUF architecture {arch!r}, whose tensors transformers reshapes on load in "
                              "ways batchrun does not repeat; batchrun reads GGUF models of the other architectures "
                              "transformers maps (llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, ...)")
    config: dict = {"tie_word_embeddings": "output.weight" not in index.tensors or arch in UNTIED_WITHOUT_OUTPUT}
    if "stablelm" in arch:  # transformers reads these two from which tensors the file holds
        names = list(index.tensors)
        config["use_qkv_bias"] = any(bias in name for name in names
                                     for bias in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        config["use_parallel_residual"] = not any("ffn_norm" in name for name in names)
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in index.metadata.items():
        renamed = _config_key(GGUF_CONFIG_MAPPING, key.replace(arch, model_type))
        if renamed is not None:
            config[renamed] = value.replace(arch, model_type) if isinstance(value, str) and arch in value else value
    for key in index.array_lengths:
        renamed = _config_key(GGUF_CONFIG_MAPPING, key.replace(arch, model_type))
        if renamed is not None:
            raise CheckpointError(f"{where}: metadata {key!r} is an array, which transformers reads into the config "
                                  f"({renamed}); batchrun reads GGUF models whose config is scalars")
    if config.get("model_type") in ("gemma3", "gemma4"):  # the files hold the text backbone only
        config["model_type"] += "_text"
    if config["model_type"] == "gemma4_text":  # GGUF stores one end-of-generation token; transformers sets all three
        config["eos_token_id"] = [1, 106, 50]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in index.array_lengths:
        config["vocab_size"] = index.array_lengths["tokenizer.ggml.tokens"]
    return config


def _newer_reader_architectures() -> frozenset[str]:
    """The architectures transformers builds from GGUF through its newer reader (integrations.gguf), not the tables
    gguf_config follows; none in a transformers without it."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        return frozenset()
    return frozenset(GGUF_CONFIG_ARCHS)


def transformers_architecture(index: GGUFIndex) -> str:
    """transformers' name for the GGUF architecture (its load_gguf_checkpoint renames these few)."""
    arch = index.architecture
    if "llama" in arch and index.metadata.get("general.name") == "mistral":
        return "mistral"
    renames = {"qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss", "gpt_oss": "gpt_oss", "qwen3moe": "qwen3_moe",
               "minimax-m2": "minimax_m2"}
    return next((renamed for name, renamed in renames.items() if name in arch), arch)


def _config_key(mapping: dict, key: str) -> str | None:
    """The config field a GGUF metadata key becomes, None for one transformers does not put in the config."""
    prefix, _, rest = key.partition(".")
    renamed = mapping.get(prefix, {}).get(rest)
    return renamed if isinstance(renamed, str) else None


def load_gguf_config(path: str | os.PathLike) -> dict:
    return gguf_config(read_gguf_index(path))


def sizing_config(config: dict) -> dict:
    """`config` with the fields its transformers config class fills in (CONFIG_CLASS_DEFAULTS) where it lacks them."""
    return {**CONFIG_CLASS_DEFAULTS.get(config.get("model_type"), {}), **config}
