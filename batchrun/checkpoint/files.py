"""Read what a checkpoint directory holds without loading a weight: config.json, the tensor index, the
safetensors headers, and where the decoder stack is. Everything is validated; errors name the file.

No torch here: planning a 70B model must not cost a torch import.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import struct
from collections import Counter
from pathlib import Path
from typing import Mapping

from batchrun.checkpoint.gguf_index import read_gguf_index
from batchrun.checkpoint.gguf_model import load_gguf_config
from batchrun.checkpoint.tensors import GGUF_SUFFIX, CheckpointError, TensorInfo

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_SHARD_NAME = "model.safetensors"
# Files that hold weights only as pickle: no tensor index, so one layer cannot be read without the whole file.
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")

# Bits per element of every safetensors dtype code (sub-byte types are packed).
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
}


# ---------------------------------------------------------------------------------------------------------------
# Tensor index and safetensors headers


def tensor_index(checkpoint: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> shard file name, from model.safetensors.index.json or the single safetensors file."""
    directory = _checkpoint_dir(checkpoint)
    index_file = _find_index(directory)
    if index_file is not None:
        return read_weight_map(index_file)
    shard = _single_shard(directory)
    return {name: shard.name for name in read_header(shard)}


def storage_dtype(infos: Mapping[str, TensorInfo]) -> str:
    """The checkpoint's dtype (safetensors code): the one holding the most bytes (a few norms may be float32)."""
    bytes_by_dtype: Counter[str] = Counter()
    for info in infos.values():
        bytes_by_dtype[info.dtype] += info.nbytes
    return bytes_by_dtype.most_common(1)[0][0]


def read_tensor_infos(checkpoint: str | os.PathLike) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape and absolute byte range, read from the shard headers and validated; a GGUF
    file's tensors by their GGUF names, their dtype the ggml type."""
    if is_gguf_file(checkpoint):
        return dict(read_gguf_index(checkpoint).tensors)
    directory = _checkpoint_dir(checkpoint)
    if not (directory / CONFIG_NAME).is_file():
        raise _missing_config(directory)
    index_file = _find_index(directory)
    if index_file is None:
        return read_header(_single_shard(directory))
    names_by_shard: dict[str, list[str]] = {}
    for name, shard_name in read_weight_map(index_file).items():
        names_by_shard.setdefault(shard_name, []).append(name)
    infos: dict[str, TensorInfo] = {}
    for shard_name, names in sorted(names_by_shard.items()):
        shard = directory / shard_name
        if not shard.is_file():
            raise CheckpointError(
                f"{shard}: missing; {index_file.name} places tensors in it (incomplete download?)"
            )
        in_shard = read_header(shard)
        for name in names:
            if name not in in_shard:
                raise CheckpointError(f"{shard}: has no tensor {name!r} although {index_file.name} places it there")
            infos[name] = in_shard[name]
    return infos


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header (8-byte little-endian length, then JSON) without reading tensor data."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        length_bytes = handle.read(8)
        if len(length_bytes) < 8:
            raise CheckpointError(f"{file}: truncated: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", length_bytes)
        if header_len > size - 8:
            raise CheckpointError(
                f"{file}: header length {header_len} bytes is larger than the file ({size} bytes): "
                "truncated, or not a safetensors file"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: malformed safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: malformed safetensors header: expected a JSON object")
    data_start = 8 + header_len
    return {
        name: _tensor_info(file, name, entry, data_start, size)
        for name, entry in header.items()
        if name != "__metadata__"
    }


def weight_sample_digest(infos: dict[str, TensorInfo], bytes_per_tensor: int = 4096) -> str:
    """sha256 of the first `bytes_per_tensor` bytes of every tensor's data: two checkpoints with the same config and
    shapes (a base model and its fine-tune) differ here, since training moves essentially every weight. A few KiB
    per tensor (~3 MB for a 70B model) instead of hashing hundreds of GB. Files are read in offset order."""
    digest = hashlib.sha256()
    by_file: dict[Path, list[TensorInfo]] = {}
    for info in infos.values():
        by_file.setdefault(info.file, []).append(info)
    for file in sorted(by_file):
        with open(file, "rb") as handle:
            for info in sorted(by_file[file], key=lambda i: (i.offset, i.name)):
                handle.seek(info.offset)
                digest.update(info.name.encode())
                digest.update(handle.read(min(info.nbytes, bytes_per_tensor)))
    return digest.hexdigest()


def _tensor_info(file: Path, name: str, entry, data_start: int, file_size: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{file}: malformed header entry for tensor {name!r}: needs dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise CheckpointError(f"{file}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(dim, int) and dim >= 0 for dim in shape):
        raise CheckpointError(f"{file}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{file}: tensor {name!r} has invalid data_offsets {offsets!r}")
    info = TensorInfo(name, file, dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    expected = (info.numel * DTYPE_BITS[dtype] + 7) // 8
    if info.nbytes != expected:
        raise CheckpointError(
            f"{file}: tensor {name!r} spans {info.nbytes} bytes but {dtype} {list(shape)} needs {expected}"
        )
    if info.offset + info.nbytes > file_size:
        raise CheckpointError(
            f"{file}: header places tensor {name!r} at bytes {info.offset}..{info.offset + info.nbytes} "
            f"but the file has only {file_size} bytes: the shard is truncated (incomplete download?)"
        )
    return info


def is_gguf_file(checkpoint: str | os.PathLike) -> bool:
    """Whether `checkpoint` is a GGUF file (the model is then the file, not a directory)."""
    path = Path(checkpoint)
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def _checkpoint_dir(checkpoint: str | os.PathLike) -> Path:
    directory = Path(checkpoint).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    return directory


def _find_index(directory: Path) -> Path | None:
    if (directory / INDEX_NAME).is_file():
        return directory / INDEX_NAME
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    return indexes[0] if len(indexes) == 1 else None


def read_weight_map(index_file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise CheckpointError(f"{index_file}: malformed index: {error}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(shard, str) and shard and ".." not in Path(shard).parts for shard in weight_map.values()
    ):
        raise CheckpointError(f"{index_file}: malformed index: 'weight_map' must map tensor names to shard files")
    return weight_map


def _single_shard(directory: Path) -> Path:
    if (directory / SINGLE_SHARD_NAME).is_file():
        return directory / SINGLE_SHARD_NAME
    shards = sorted(directory.glob("*.safetensors"))
    if len(shards) == 1:
        return shards[0]
    if not shards:
        refuse_without_safetensors(directory, [p.name for p in directory.iterdir()])
    names = ", ".join(shard.name for shard in shards)
    raise CheckpointError(f"{directory}: several safetensors files ({names}) and no {INDEX_NAME} to say which to use")


def refuse_without_safetensors(where: Path | str, file_names: list[str]) -> None:
    pickles = sorted(n for n in file_names if any(fnmatch.fnmatch(Path(n).name, p) for p in PICKLE_PATTERNS))
    if pickles:
        raise CheckpointError(
            f"{where}: weights only as pickle ({', '.join(pickles)}): pickle has no tensor index, so one layer "
            "cannot be read without reading the whole file. batchrun requires safetensors; convert the checkpoint "
            "(load it once with transformers and save_pretrained, which writes safetensors)."
        )
    raise CheckpointError(f"{where}: no *.safetensors weight files")


# ---------------------------------------------------------------------------------------------------------------
# config.json and the decoder stack


def load_config(checkpoint: str | os.PathLike, trust_remote_code: bool = False) -> dict:
    """config.json as a dict (a GGUF file's: the config transformers builds from its metadata). A config that needs
    the repository's own Python code (`auto_map` for an architecture transformers does not ship) is refused unless
    trust_remote_code=True."""
    if is_gguf_file(checkpoint):
        return load_gguf_config(checkpoint)
    directory = _checkpoint_dir(checkpoint)
    file = directory / CONFIG_NAME
    if not file.is_file():
        raise _missing_config(directory)
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: malformed JSON: {error}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    model_type = config.get("model_type")
    if config.get("auto_map") and not trust_remote_code and not _transformers_ships(model_type):
        raise CheckpointError(
            f"{file}: declares auto_map for model_type {model_type!r}, which transformers does not ship: running it "
            "means executing Python code from the model repository. Pass trust_remote_code=True "
            "(--trust-remote-code) only if you trust its authors."
        )
    return config


def _transformers_ships(model_type: str | None) -> bool:
    """Whether transformers has its own class for model_type (then auto_map is ignored and no remote code runs).
    Reads transformers' generated name table, which imports no torch; an older transformers without it -> False."""
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING_NAMES


def _missing_config(directory: Path) -> CheckpointError:
    return CheckpointError(f"{directory / CONFIG_NAME}: missing; a checkpoint needs its config.json")


def decoder_layer_prefix(tensor_names, num_layers: int) -> str:
    """The prefix P of the decoder stack: tensors "P.{i}." exist for exactly i in range(num_layers).
    Found from the names alone (model.layers, transformer.h, gpt_neox.layers, ...), no per-family table."""
    found: dict[str, set[int]] = {}
    for name in tensor_names:
        parts = name.split(".")
        for position in range(1, len(parts) - 1):
            if parts[position].isdecimal():
                found.setdefault(".".join(parts[:position]), set()).add(int(parts[position]))
    # A numbered stack nested inside a numbered module (experts inside layer 3) is never the decoder stack.
    outermost = {p: idx for p, idx in found.items() if not any(part.isdecimal() for part in p.split("."))}
    matches = [p for p, idx in outermost.items() if idx == set(range(num_layers))]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CheckpointError(f"ambiguous decoder stack: {', '.join(sorted(matches))} all have {num_layers} layers")
    stacks = ", ".join(f"{p} ({len(idx)})" for p, idx in sorted(outermost.items())) or "none"
    raise CheckpointError(
        f"no tensor stack numbered 0..{num_layers - 1} matching num_hidden_layers={num_layers}; "
        f"numbered stacks: {stacks}"
    )
