"""Small GGUF files and raw ggml blocks for the GGUF tests, written with gguf-py's own writer.

Any bytes are valid blocks of every supported type, so random bytes test the decoders on every bit pattern; the fp16
scales at the front of the first blocks are then set to the values an exact decoder must carry through (NaN, both
infinities, subnormals, signed zero, the largest half).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# fp16 bit patterns: quiet NaN, a NaN with payload, +Inf, -Inf, smallest and largest subnormal, -0, largest normal.
SPECIAL_HALVES = np.array([0x7E00, 0x7C01, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x8000, 0x7BFF], dtype=np.uint16)
# The same for bfloat16 (F32's high halves).
SPECIAL_BFLOATS = np.array([0x7FC0, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x007F, 0x8000, 0x7F7F], dtype=np.uint16)
# The same for F32: quiet NaN, NaN with payload, +Inf, -Inf, smallest and largest subnormal, -0, largest normal.
SPECIAL_SINGLES = np.array([0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x80000000,
                            0x7F7FFFFF], dtype=np.uint32)
# Byte offsets of each block's fp16 scales (d, and m or dmin) per type; the F16 and BF16 values are all "scales".
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,), "F16": (0,), "BF16": (0,)}


def random_blocks(ggml_type: str, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, blocks_per_row * block bytes] random uint8 rows of `ggml_type` blocks, the first blocks' scales set
    to SPECIAL_HALVES (SPECIAL_BFLOATS for BF16), the first F32 values to SPECIAL_SINGLES."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, block_bytes), dtype=np.uint8)
    if ggml_type == "F32":
        count = min(len(SPECIAL_SINGLES), len(blocks))
        blocks[:count] = SPECIAL_SINGLES.view(np.uint8).reshape(-1, 4)[:count]
    specials = (SPECIAL_BFLOATS if ggml_type == "BF16" else SPECIAL_HALVES).view(np.uint8).reshape(-1, 2)
    for index, offset in enumerate(SCALE_OFFSETS.get(ggml_type, ())):
        count = min(len(specials), len(blocks))
        blocks[:count, offset:offset + 2] = np.roll(specials, index, axis=0)[:count]  # d and m differ per block
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]], *, arch: str = "llama",
               metadata: dict[str, int] | None = None, big_endian: bool = False,
               tensors_per_file: int = 0) -> list[Path]:
    """Write `tensors` (name -> (ggml type, uint8 rows of its blocks)) as a GGUF file, or as llama.cpp-style
    split files of `tensors_per_file` each; returns the files written."""
    from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter

    endianess = GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE
    writer = GGUFWriter(path, arch, endianess=endianess, split_max_tensors=tensors_per_file)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    for name, (ggml_type, raw) in tensors.items():
        # uint8 bytes with a raw type: the writer stores them as they are, whatever its byte order
        writer.add_tensor(name, raw, raw_shape=None, raw_dtype=GGMLQuantizationType[ggml_type])
    files = writer.format_shard_names(path) if tensors_per_file else [path]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files
