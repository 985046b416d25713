"""How fast this machine turns GGUF blocks into a layer's compute-dtype weights, per ggml type: what a streamed GGUF
layer costs its reader besides the read (the loader decodes each tensor to float32, then casts it into its slot).
Cached per device, dtype, thread count and type (measure.cache); importing this module imports no torch.
"""
from __future__ import annotations

from typing import Iterable

from batchrun.measure.cache import SHAPES_SEPARATOR, cached, compute_key, store
from batchrun.measure.compute import _median_seconds, _synchronizer

# A matrix of this many rows of this many weights (whole K-quant super-blocks), decoded whole as the loader decodes
# a tensor: large enough to leave the CPU caches, small enough to time in a fraction of a second.
DEQUANTIZE_SHAPE = (1024, 2048)


def dequantize_rates(ggml_types: Iterable[str], dtype: str, device: str = "cpu") -> dict[str, float]:
    """Weights per second decoded from each of `ggml_types` into `dtype` on `device`, cached, measured where not."""
    import torch

    rates = {}
    for ggml_type in sorted(set(ggml_types)):
        key = compute_key(dtype, device, torch.get_num_threads()) + SHAPES_SEPARATOR + ggml_type
        entry = cached("dequantize", key)
        rates[ggml_type] = entry["weights_per_s"] if entry else _measure(ggml_type, dtype, device, key)
    return rates


def _measure(ggml_type: str, dtype: str, device: str, key: str) -> float:
    import torch

    from batchrun.checkpoint import GGUF_BLOCKS
    from batchrun.runtime import dequantize

    rows, width = DEQUANTIZE_SHAPE
    weights, block_bytes = GGUF_BLOCKS[ggml_type]
    # any bytes are valid blocks, and NaN or infinite scales decode as fast as finite ones
    raw = torch.randint(0, 256, (rows * width // weights * block_bytes,), dtype=torch.uint8)
    slot = torch.empty(rows, width, dtype=getattr(torch, dtype), device=device)
    seconds = _median_seconds(lambda: slot.copy_(dequantize(raw, ggml_type, (rows, width))),
                              _synchronizer(torch, device))
    rate = rows * width / seconds
    store("dequantize", key, {"weights_per_s": rate})
    return rate
