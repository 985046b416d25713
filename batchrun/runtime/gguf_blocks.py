"""GGUF blocks -> float weights in torch ops, vectorised over blocks, giving exactly gguf-py's numbers.

Each block decoder takes [n, block bytes] uint8 and returns [n, block weights] float32. The arithmetic repeats
gguf.quants step by step in float32 (scale times scale, then times the quant, then the offset), each product
rounded on its own as numpy rounds it: no fused multiply-add, no reassociation, so the results are bit for bit
gguf-py's. Rows are whole blocks, so any range of rows dequantizes on its own (a tile). Multi-byte fields are read
in host byte order, which is GGUF's own on the little-endian hosts torch runs on (big-endian files are refused by
the index).

llama.cpp stores the q and k rows of Llama-family attention with each head's two rotary halves interleaved;
undo_qk_permutation restores the checkpoint's order, as transformers does when it loads a GGUF.
"""
from __future__ import annotations

import math
import os
import threading
from typing import Callable

import torch

from batchrun.checkpoint import GGUF_BLOCKS, GGUFTensorInfo
from batchrun.runtime.linear_kernels import thread_buffer
from batchrun.runtime.weights import read_into

QK_K = 256  # weights per K-quant super-block


def _field(blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes start..stop of every block as `dtype` (little-endian, as GGUF stores them): [n, (stop - start) / size]."""
    part = blocks[:, start:stop].contiguous()
    if part.storage_offset() % dtype.itemsize:  # a tile read at an odd place in a larger buffer
        part = part.clone()
    return part.view(dtype)


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, widened to float32 exactly (NaN, Inf, subnormals kept): [n, 1]."""
    return _field(blocks, start, start + 2, torch.float16).float()


def _nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k] 4-bit values (uint8): each run of `width` bytes gives its low nibbles, then its high
    ones."""
    n = packed.shape[0]
    packed = packed.contiguous().view(-1)
    if packed.storage_offset() % 4:  # a block's nibbles start at an even byte; a word view needs four
        packed = packed.clone()
    words = packed.view(torch.int32).view(n, -1, width // 4)  # [n, k / width, width / 4]: 4 at once
    low = (words & 0x0F0F0F0F).view(torch.uint8)  # [n, k / width, width]
    high = ((words >> 4) & 0x0F0F0F0F).view(torch.uint8)
    return torch.cat((low, high), dim=2).view(n, -1)


def _spread_table(bits: int) -> torch.Tensor:
    """Byte -> its fields of `bits` bits, least significant first, each moved to bit 4 (the high bits of a 5- or
    6-bit quant): [256, 8 / bits] uint8, viewed as one wide integer per byte so a gather moves each byte's fields at
    once."""
    byte = torch.arange(256, dtype=torch.int64).unsqueeze(1)
    shifts = torch.arange(0, 8, bits, dtype=torch.int64)
    fields = (((byte >> shifts) & ((1 << bits) - 1)) << 4).to(torch.uint8)  # [256, 8 / bits]
    return fields.view(torch.int64 if bits == 1 else torch.int32).squeeze(1)


ONE_BIT_FIELDS = _spread_table(1)  # [256] int64: 8 fields of 1 bit
TWO_BIT_FIELDS = _spread_table(2)  # [256] int32: 4 fields of 2 bits


def _spread(packed: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, k, fields] uint8 through a _spread_table (one gather, no shift per field)."""
    gathered = table.index_select(0, packed.reshape(-1).to(torch.int64))
    return gathered.view(torch.uint8).view(*packed.shape, -1)


def _halves(blocks: torch.Tensor) -> torch.Tensor:
    """[n, bytes] blocks of an even size as [n, bytes / 2] int16, a view where the blocks start at an even byte:
    the small blocks' scales and nibbles read in place, without a copy per field (a decode pass decodes every weight
    of every layer)."""
    if blocks.storage_offset() % 2 or not blocks.is_contiguous():
        blocks = blocks.clone()
    return blocks.view(torch.int16)


def _half_scale(halves: torch.Tensor, index: int) -> torch.Tensor:
    """The fp16 at halfword `index` of every block, widened to float32 exactly: [n, 1]."""
    return halves[:, index:index + 1].view(torch.float16).float()


def _half_nibbles(halves: torch.Tensor, start: int) -> torch.Tensor:
    """The 16 bytes of nibbles at halfword `start` -> [n, 32] uint8: the low nibbles in byte order, then the high."""
    packed = halves[:, start:start + 8]  # [n, 8]: two bytes each
    out = torch.empty(halves.shape[0], 2, 8, dtype=torch.int16)
    torch.bitwise_and(packed, 0x0F0F, out=out[:, 0])
    torch.bitwise_and(packed >> 4, 0x0F0F, out=out[:, 1])  # the sign bits shifted in are masked off
    return out.view(torch.uint8).view(halves.shape[0], 32)


def _q8_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # fp16 d, 32 int8 q: w = q * d (int8 times float32 widens the int8 exactly)
    return torch.mul(blocks[:, 2:34].view(torch.int8), _half_scale(_halves(blocks), 0), out=out)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # fp16 d, 16 bytes of nibbles: w = d * (q - 8)
    halves = _halves(blocks)
    return torch.mul(_half_scale(halves, 0), _half_nibbles(halves, 1).view(torch.int8) - 8, out=out)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m, each product and sum rounded on its own
    halves = _halves(blocks)
    return torch.mul(_half_scale(halves, 0), _half_nibbles(halves, 2), out=out).add_(_half_scale(halves, 1))


# Decoders that write their float32 weights into a given tensor (dequantize_into), no copy between.
DECODERS_INTO = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 high bits (a little-endian uint32 at byte `start`, bit i for weight i) -> [n, 32], each 0 or
    16."""
    return _spread(blocks[:, start:start + 4], ONE_BIT_FIELDS).view(blocks.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, 32 high bits, 16 bytes of low nibbles: w = d * (q - 16)
    quants = _nibbles(blocks[:, 6:], 16) | _fifth_bits(blocks, 2)
    return _scale(blocks, 0) * (quants.view(torch.int8) - 16)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles: w = d * q + m
    quants = _nibbles(blocks[:, 8:], 16) | _fifth_bits(blocks, 4)
    return _scale(blocks, 0) * quants + _scale(blocks, 2)


def _k_scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, [n, 8] each, as float32."""
    n = packed.shape[0]
    low, high, mixed = packed.reshape(n, 3, 4).unbind(1)  # [n, 4] each
    scales = torch.cat((low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    mins = torch.cat((high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)), dim=1)
    return scales.float(), mins.float()


def _k_quant(blocks: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """w = (d * scale) * q - (dmin * min) per sub-block of 32; quants [n, 256] uint8 -> [n, 256] float32."""
    n = blocks.shape[0]
    scales, mins = _k_scales_and_mins(blocks[:, 4:16])
    step = (_scale(blocks, 0) * scales).unsqueeze(-1)  # [n, 8, 1]
    offset = (_scale(blocks, 2) * mins).unsqueeze(-1)  # [n, 8, 1]
    return (step * quants.view(n, 8, 32) - offset).view(n, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    # fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles (runs of 32 bytes: low, then high)
    return _k_quant(blocks, _nibbles(blocks[:, 16:], 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    # as Q4_K with 32 bytes of fifth bits after the scales: bit j of byte i belongs to weight 32 * j + i
    high = _spread(blocks[:, 16:48], ONE_BIT_FIELDS).transpose(1, 2)  # [n, 32, 8] -> [n, 8, 32]
    return _k_quant(blocks, _nibbles(blocks[:, 48:], 32) | high.reshape(blocks.shape[0], QK_K))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d: w = (d * scale) * (q - 32)
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64)  # [n, 256]
    high = _spread(blocks[:, 128:192].reshape(n * 2, 32), TWO_BIT_FIELDS).transpose(1, 2)  # [2n, 4, 32]
    quants = ((low | high.reshape(n, QK_K)).view(torch.int8) - 32).view(n, 16, 16)
    step = (_scale(blocks, 208) * _field(blocks, 192, 208, torch.int8)).unsqueeze(-1)  # [n, 16, 1]
    return (step * quants).view(n, QK_K)


BLOCK_DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": lambda blocks: _field(blocks, 0, 4, torch.float32),
    "F16": lambda blocks: _field(blocks, 0, 2, torch.float16).float(),
    "BF16": lambda blocks: _field(blocks, 0, 2, torch.bfloat16).float(),
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def _whole_blocks(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(weights, bytes) of one `ggml_type` block, once `raw` is checked to be the whole blocks of a `shape` tensor."""
    weights, block_bytes = GGUF_BLOCKS[ggml_type]
    count = math.prod(shape)
    if raw.dtype != torch.uint8 or raw.numel() * weights != count * block_bytes or count % weights:
        raise ValueError(f"{raw.numel()} bytes of {raw.dtype} are not the whole {ggml_type} blocks of a "
                         f"{list(shape)} tensor ({block_bytes} bytes per {weights} weights)")
    return weights, block_bytes


def dequantize(raw: torch.Tensor, ggml_type: str, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Whole blocks of `ggml_type` (a uint8 tensor, any shape) -> a `dtype` tensor of `shape` (rows first: a tile of
    rows passes its own row count). Computed in float32, then rounded once to `dtype`; F32 into float32 is a view
    of `raw` itself, so a caller reusing `raw` copies it first."""
    decoder = BLOCK_DECODERS.get(ggml_type)
    if decoder is None:
        raise ValueError(f"no dequantizer for ggml type {ggml_type!r}; batchrun reads {', '.join(BLOCK_DECODERS)}")
    weights, block_bytes = _whole_blocks(raw, ggml_type, shape)
    values = decoder(raw.reshape(-1, block_bytes)).view(shape)
    return values if dtype == torch.float32 else values.to(dtype)


def dequantize_into(raw: torch.Tensor, ggml_type: str, out: torch.Tensor) -> None:
    """dequantize(raw, ggml_type, out.shape) written into `out`: for the types DECODERS_INTO holds, straight into a
    contiguous float32 tensor beside the blocks, or through this thread's float32 scratch into a half-precision one
    (rounded once, as a copy of the float32 values rounds); through a copy of dequantize's result otherwise."""
    decoder = DECODERS_INTO.get(ggml_type)
    if decoder is None or not out.is_contiguous() or out.device != raw.device or out.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        out.copy_(dequantize(raw, ggml_type, tuple(out.shape)))
        return
    weights, block_bytes = _whole_blocks(raw, ggml_type, tuple(out.shape))
    blocks = raw.reshape(-1, block_bytes)
    if out.dtype == torch.float32:
        decoder(blocks, out=out.view(-1, weights))
        return
    values = thread_buffer(_scratch, out.numel(), torch.float32)[:out.numel()]
    decoder(blocks, out=values.view(-1, weights))
    out.view(-1).copy_(values)


# This thread's float32 values of a half-precision tile, decoded there and rounded once (dequantize_into).
_scratch = threading.local()


def undo_qk_permutation(weight: torch.Tensor, head_rows: int) -> torch.Tensor:
    """llama.cpp's q/k row order -> the checkpoint's, head by head: within each head of `head_rows` rows, row
    2i + h holds what the checkpoint has at h * head_rows / 2 + i. Any whole heads (a tile) undo on their own."""
    rows = weight.shape[0]
    if head_rows % 2 or rows % head_rows:
        raise ValueError(f"{rows} rows are not whole heads of {head_rows} rows in two rotary halves")
    halves = weight.reshape(rows // head_rows, head_rows // 2, 2, *weight.shape[1:])  # [heads, half, 2, ...]
    return halves.transpose(1, 2).reshape(weight.shape)


def read_gguf_blocks(info: GGUFTensorInfo, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """The quantized bytes of rows start..stop-1 of a GGUF tensor, read from its file: a uint8 tensor."""
    stop = info.rows if stop is None else stop
    offset, length = info.row_span(start, stop)
    raw = torch.empty(length, dtype=torch.uint8)
    fd = os.open(info.file, os.O_RDONLY)
    try:
        read_into(fd, memoryview(raw.numpy()), offset, info.file)
    finally:
        os.close(fd)
    return raw


def read_gguf_rows(info: GGUFTensorInfo, start: int = 0, stop: int | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows start..stop-1 of a GGUF tensor read from its file and dequantized: the tensor's own shape when that is
    all its rows, else [stop - start, row width]. A 1-D tensor (a norm, a bias) is one row."""
    stop = info.rows if stop is None else stop
    shape = info.shape if (start, stop) == (0, info.rows) else (stop - start, info.row_width)
    return dequantize(read_gguf_blocks(info, start, stop), info.dtype, shape, dtype)
