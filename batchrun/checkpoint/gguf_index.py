"""What a GGUF file holds, read without a weight: each tensor's ggml type, shape (rows first, as torch and safetensors
order it), absolute byte range and the bytes of one row, and the file's scalar metadata. A model split by llama.cpp
(`name-00001-of-00003.gguf`) is read as one index over its parts.

Only the types batchrun dequantizes are accepted (GGUF_BLOCKS); any other, or a big-endian file, is refused here,
naming the tensor or the file, before any weight is read. The header is parsed here with struct alone (no gguf-py,
numpy or torch), and the metadata arrays (a tokenizer's vocabulary, most of a small model's header) are skipped
unread, so planning a GGUF model reads little more than its tensor infos.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from batchrun.checkpoint.tensors import CheckpointError, TensorInfo

# ggml type -> (weights per block, bytes per block), as in llama.cpp's ggml-common.h. A row is whole blocks along the
# input dimension; the bytes are the quantized bytes, scales included.
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}
# llama.cpp's converter interleaves the two rotary halves of each q and k head for these GGUF architectures;
# transformers undoes it on load for these only (its LlamaTensorProcessor), and so must a reader of the raw rows.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})
# ggml type number -> name, gguf-py's GGMLQuantizationType: the unsupported types are named when refused.
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # those gguf-py reads; version 1 counted in uint32
GGUF_DEFAULT_ALIGNMENT = 32
# GGUF value type numbers (gguf-py's GGUFValueType): the scalars' little-endian layouts, and the two others.
_SCALARS = {0: struct.Struct("<B"), 1: struct.Struct("<b"), 2: struct.Struct("<H"), 3: struct.Struct("<h"),
            4: struct.Struct("<I"), 5: struct.Struct("<i"), 6: struct.Struct("<f"), 7: struct.Struct("<?"),
            10: struct.Struct("<Q"), 11: struct.Struct("<q"), 12: struct.Struct("<d")}
_STRING, _ARRAY = 8, 9
_U32, _U64 = _SCALARS[4], _SCALARS[10]
_COUNTS = struct.Struct("<QQ")  # tensor count, key/value count
_ARRAY_HEAD = struct.Struct("<IQ")  # item type, item count
_TYPE_AND_OFFSET = struct.Struct("<IQ")  # a tensor's ggml type number and offset in the data section
SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GGUFTensorInfo(TensorInfo):
    """A GGUF tensor: `dtype` is its ggml type ("Q4_K", "F32", ...), `shape` rows first, `nbytes` the quantized
    bytes. A range of rows is a contiguous byte range, so a loader reads a tile of rows as it reads a tensor."""

    @property
    def block_weights(self) -> int:
        return GGUF_BLOCKS[self.dtype][0]

    @property
    def block_bytes(self) -> int:
        return GGUF_BLOCKS[self.dtype][1]

    @property
    def row_width(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return self.numel // self.row_width

    @property
    def row_bytes(self) -> int:
        return self.row_width // self.block_weights * self.block_bytes

    def row_span(self, start: int, stop: int) -> tuple[int, int]:
        """(absolute offset, byte length) of rows start..stop-1."""
        if not 0 <= start <= stop <= self.rows:
            raise ValueError(f"tensor {self.name!r} has {self.rows} rows; rows {start}..{stop} are not among them")
        return self.offset + start * self.row_bytes, (stop - start) * self.row_bytes


@dataclass(frozen=True)
class GGUFIndex:
    files: tuple[Path, ...]  # the parts in order; one file unless split
    metadata: Mapping[str, str | int | float | bool]  # the first part's scalar key/values ("llama.block_count": 30)
    tensors: dict[str, GGUFTensorInfo]  # by GGUF name ("blk.0.attn_q.weight"), in file order
    # the first part's arrays, skipped unread, by key with their item counts (a vocabulary's size is its count)
    array_lengths: Mapping[str, int] = field(default_factory=dict, compare=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def permuted_head_rows(self, name: str) -> int | None:
        """The rows of one attention head when tensor `name`'s rows are in llama.cpp's permuted q/k order (undo with
        the runtime's undo_qk_permutation), None when they are in the checkpoint's own order."""
        arch = self.architecture
        is_q, is_k = ".attn_q." in name, ".attn_k." in name
        if arch not in PERMUTED_QK_ARCHITECTURES or not (is_q or is_k):
            return None
        heads = self.metadata.get(f"{arch}.attention.head_count")
        if is_k:
            heads = self.metadata.get(f"{arch}.attention.head_count_kv", heads)
        info = self.tensors[name]
        if not isinstance(heads, int) or heads < 1 or info.shape[0] % (2 * heads):
            raise CheckpointError(f"{info.file}: tensor {name!r} has {info.shape[0]} rows, which cannot be split into "
                                  f"{heads!r} heads of two rotary halves ({arch}.attention metadata)")
        return info.shape[0] // heads


def split_parts(path: Path) -> tuple[Path, ...]:
    """Every part of a split GGUF named like `path` (any part may be given), or just `path`."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return (path,)
    count = int(match["count"])
    parts = tuple(path.with_name(f"{match['stem']}-{part:05d}-of-{count:05d}.gguf") for part in range(1, count + 1))
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise CheckpointError(f"{path}: part of a GGUF split in {count} files, but {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing beside it (incomplete download?)")
    return parts


def read_gguf_index(path: str | os.PathLike) -> GGUFIndex:
    """Every tensor of a GGUF file (or of all parts of a split one) with its type, shape and byte range, validated."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    parts = split_parts(path)
    tensors: dict[str, GGUFTensorInfo] = {}
    metadata: dict[str, str | int | float | bool] = {}
    array_lengths: dict[str, int] = {}
    for number, part in enumerate(parts):
        part_metadata, part_arrays, part_tensors = _read_part(part)
        if number == 0:
            metadata, array_lengths = part_metadata, part_arrays
        for info in part_tensors:
            if info.name in tensors:
                raise CheckpointError(f"{part}: tensor {info.name!r} is also in {tensors[info.name].file.name}")
            tensors[info.name] = info
    expected = metadata.get("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise CheckpointError(f"{parts[0]}: the split declares {expected} tensors, its {len(parts)} parts hold "
                              f"{len(tensors)}")
    return GGUFIndex(parts, metadata, tensors, array_lengths)


def _read_part(file: Path) -> tuple[dict[str, str | int | float | bool], dict[str, int], list[GGUFTensorInfo]]:
    try:
        with open(file, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            metadata = _read_preamble(file, cursor)
            arrays = _read_metadata(cursor, metadata)
            entries = [_read_tensor_entry(cursor) for _ in range(int(metadata["GGUF.tensor_count"]))]
            data_start = _aligned(cursor.pos, metadata.get("general.alignment"))
            size = len(data)
    except CheckpointError:  # a ValueError too, already naming the file
        raise
    except (_Unreadable, ValueError, OSError) as error:  # mmap refuses an empty file with ValueError
        raise CheckpointError(f"{file}: not a readable GGUF file, or truncated (incomplete download?): {error}") \
            from None
    infos: dict[str, GGUFTensorInfo] = {}
    for name, type_number, shape, offset in entries:
        info = _tensor_info(file, name, type_number, shape, data_start + offset)
        if name in infos:
            raise CheckpointError(f"{file}: tensor {name!r} appears twice in the file")
        if info.offset + info.nbytes > size:  # the data section is short: the file was cut
            raise CheckpointError(f"{file}: not a readable GGUF file, or truncated (incomplete download?): tensor "
                                  f"{name!r} ends at byte {info.offset + info.nbytes}, past the file's {size}")
        infos[name] = info
    return metadata, arrays, list(infos.values())


class _Unreadable(Exception):
    """The header is cut short or is not GGUF; _read_part names the file."""


class _Cursor:
    """A read position in the mapped file: every read is bounds-checked, so a cut header is refused, not misread."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 0

    def skip(self, size: int) -> int:
        """Advance `size` bytes; returns where they start."""
        start, self.pos = self.pos, self.pos + size
        if self.pos > len(self.data):
            raise _Unreadable(f"it ends at byte {len(self.data)}, inside its header")
        return start

    def unpack(self, layout: struct.Struct) -> tuple:
        return layout.unpack_from(self.data, self.skip(layout.size))

    def string(self) -> str:
        (length,) = self.unpack(_U64)
        start = self.skip(length)
        return self.data[start:start + length].decode("utf-8")


def _read_preamble(file: Path, cursor: _Cursor) -> dict[str, str | int | float | bool]:
    """The magic, version and counts, as gguf-py reports them among the fields ("GGUF.version", ...)."""
    if bytes(cursor.data[:4]) != GGUF_MAGIC:
        raise _Unreadable(f"it starts with {bytes(cursor.data[:4])!r}, not GGUF's magic {GGUF_MAGIC!r}")
    cursor.skip(4)
    (version,) = cursor.unpack(_U32)
    if version & 0xFFFF == 0 and version:  # the version's low bytes are zero when its byte order is swapped
        raise CheckpointError(f"{file}: a big-endian GGUF file; batchrun reads little-endian GGUF only (convert it "
                              "again without --bigendian)")
    if version not in GGUF_VERSIONS:
        raise _Unreadable(f"GGUF version {version}; batchrun reads versions {', '.join(map(str, GGUF_VERSIONS))}")
    tensor_count, kv_count = cursor.unpack(_COUNTS)
    return {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}


def _read_metadata(cursor: _Cursor, metadata: dict[str, str | int | float | bool]) -> dict[str, int]:
    """Every key/value into `metadata` but arrays, which are skipped unread: a tokenizer's vocabulary is most of
    a small model's header, and nothing the index serves needs it. Returns each array's item count by key."""
    arrays: dict[str, int] = {}
    for _ in range(int(metadata["GGUF.kv_count"])):
        key = cursor.string()
        (value_type,) = cursor.unpack(_U32)
        if key in metadata or key in arrays:
            raise _Unreadable(f"metadata key {key!r} appears twice")
        if value_type == _ARRAY:
            arrays[key] = _skip_array(cursor)
        elif value_type == _STRING:
            metadata[key] = cursor.string()
        elif value_type in _SCALARS:
            (metadata[key],) = cursor.unpack(_SCALARS[value_type])
        else:
            raise _Unreadable(f"metadata key {key!r} has value type number {value_type}, which GGUF does not define")
    return arrays


def _skip_array(cursor: _Cursor) -> int:
    """Move past an array; returns its item count."""
    item_type, count = cursor.unpack(_ARRAY_HEAD)
    if item_type in _SCALARS:
        cursor.skip(_SCALARS[item_type].size * count)
    elif item_type == _STRING:
        # Each string's length is read to find the next one; a bare loop over the mapping is the fast way to do it
        # without numpy.
        data, pos, length_at = cursor.data, cursor.pos, _U64.unpack_from
        try:
            for _ in range(count):
                pos += 8 + length_at(data, pos)[0]
        except struct.error:
            raise _Unreadable(f"it ends at byte {len(data)}, inside its header") from None
        cursor.skip(pos - cursor.pos)
    elif item_type == _ARRAY:
        for _ in range(count):
            _skip_array(cursor)
    else:
        raise _Unreadable(f"an array of value type number {item_type}, which GGUF does not define")
    return count


def _read_tensor_entry(cursor: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    """(name, ggml type number, shape rows first, offset in the data section) of the next tensor info."""
    name = cursor.string()
    (n_dims,) = cursor.unpack(_U32)
    dims = struct.unpack_from(f"<{n_dims}Q", cursor.data, cursor.skip(8 * n_dims))
    type_number, offset = cursor.unpack(_TYPE_AND_OFFSET)
    return name, type_number, tuple(reversed(dims)), offset


def _aligned(position: int, alignment: object) -> int:
    """Where the data section starts: the end of the tensor infos padded to `general.alignment` (GGUF's default
    when absent)."""
    if alignment is None:
        alignment = GGUF_DEFAULT_ALIGNMENT
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise _Unreadable(f"general.alignment is {alignment!r}, not a power of two")
    return -(-position // alignment) * alignment


def _tensor_info(file: Path, name: str, type_number: int, shape: tuple[int, ...], offset: int) -> GGUFTensorInfo:
    ggml_type = GGML_TYPES.get(type_number)
    if ggml_type is None:  # a type newer than this table
        raise CheckpointError(f"{file}: holds a tensor of ggml type number {type_number}, which gguf-py does not "
                              f"know; batchrun reads {', '.join(GGUF_BLOCKS)} (tensor {name!r})")
    if ggml_type not in GGUF_BLOCKS:
        raise CheckpointError(f"{file}: tensor {name!r} is of ggml type {ggml_type}, which batchrun cannot "
                              f"dequantize (it reads {', '.join(GGUF_BLOCKS)})")
    weights, block_bytes = GGUF_BLOCKS[ggml_type]
    if shape and shape[-1] % weights:  # a row is whole blocks, else rows are no byte ranges
        raise CheckpointError(f"{file}: tensor {name!r} of ggml type {ggml_type} has rows of {shape[-1]} weights, "
                              f"not whole blocks of {weights}")
    return GGUFTensorInfo(name, file, ggml_type, shape, offset, math.prod(shape) // weights * block_bytes)
