"""What a GGUF file holds, read without a weight: each tensor's ggml type, shape (rows first, as torch and safetensors
order it), absolute byte range and the bytes of one row, and the file's scalar metadata. A model split by llama.cpp
(`name-00001-of-00003.gguf`) is read as one index over its parts.

Only the types batchrun dequantizes are accepted (GGUF_BLOCKS); any other, or a big-endian file, is refused here,
naming the tensor or the file, before any weight is read. gguf-py is imported inside the reader (it brings numpy, no
torch): planning a safetensors model pays nothing for it.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from batchrun.checkpoint.files import CheckpointError, TensorInfo

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
UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")  # gguf-py's words for it
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
    for number, part in enumerate(parts):
        part_metadata, part_tensors = _read_part(part)
        if number == 0:
            metadata = part_metadata
        for info in part_tensors:
            if info.name in tensors:
                raise CheckpointError(f"{part}: tensor {info.name!r} is also in {tensors[info.name].file.name}")
            tensors[info.name] = info
    expected = metadata.get("split.tensors.count")
    if isinstance(expected, int) and expected != len(tensors):
        raise CheckpointError(f"{parts[0]}: the split declares {expected} tensors, its {len(parts)} parts hold "
                              f"{len(tensors)}")
    return GGUFIndex(parts, metadata, tensors)


def _read_part(file: Path) -> tuple[dict[str, str | int | float | bool], list[GGUFTensorInfo]]:
    try:
        from gguf import GGUFEndian, GGUFReader, GGUFValueType
    except ImportError as error:
        raise CheckpointError(f"{file}: reading GGUF needs the gguf package: pip install gguf ({error})") from error
    try:
        reader = GGUFReader(file)
    except (ValueError, OSError, IndexError) as error:
        unknown = UNKNOWN_TYPE.search(str(error))
        if unknown:  # a type number newer than gguf-py: it stops before naming the tensor
            raise CheckpointError(f"{file}: holds a tensor of ggml type number {unknown[1]}, which gguf-py does not "
                                  f"know; batchrun reads {', '.join(GGUF_BLOCKS)}") from None
        # gguf-py maps each tensor's bytes as it indexes them: a truncated file fails here, as a short tensor
        raise CheckpointError(f"{file}: not a readable GGUF file, or truncated (incomplete download?): {error}") \
            from None
    if reader.endianess == GGUFEndian.BIG:
        raise CheckpointError(f"{file}: a big-endian GGUF file; batchrun reads little-endian GGUF only (convert it "
                              "again without --bigendian)")
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if len(field.types) == 1 and field.types[0] != GGUFValueType.ARRAY}
    infos = [_tensor_info(file, tensor.name, tensor.tensor_type.name, tuple(int(d) for d in reversed(tensor.shape)),
                          int(tensor.data_offset)) for tensor in reader.tensors]
    return metadata, infos


def _tensor_info(file: Path, name: str, ggml_type: str, shape: tuple[int, ...], offset: int) -> GGUFTensorInfo:
    if ggml_type not in GGUF_BLOCKS:
        raise CheckpointError(f"{file}: tensor {name!r} is of ggml type {ggml_type}, which batchrun cannot "
                              f"dequantize (it reads {', '.join(GGUF_BLOCKS)})")
    weights, block_bytes = GGUF_BLOCKS[ggml_type]  # gguf-py has checked that rows are whole blocks
    return GGUFTensorInfo(name, file, ggml_type, shape, offset, math.prod(shape) // weights * block_bytes)
