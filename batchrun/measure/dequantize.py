"""How fast this machine turns GGUF blocks into a layer's compute-dtype weights, per ggml type: what a streamed GGUF
layer costs its reader besides the read (the loader decodes each tensor to float32, then casts it into its slot).
Measured once, cached per device, dtype, thread count and type (measure.cache), and replaced by what a run observed
where its decodes disagree with it (judge_dequantize_rates); importing this module imports no torch.
"""
from __future__ import annotations

import logging
from typing import Iterable, Mapping

from batchrun.measure.cache import SHAPES_SEPARATOR, cached, compute_key, store
from batchrun.measure.compute import RATE_DISPUTED_BEYOND, _median_seconds, _synchronizer

log = logging.getLogger(__name__)

# A run's decodes of one type judge its cached rate once they add up to this many seconds: timed tensor by tensor,
# a sum this long outlasts the timer's and the machine's noise.
JUDGED_DEQUANTIZE_MIN_SECONDS = 0.5
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


def judge_dequantize_rates(observed: Mapping[str, tuple[int, float]], dtype: str, device: str, threads: int, *,
                           job: str) -> set[str]:
    """A run decoded `observed` (ggml type -> weights, seconds) into `dtype` on `device` with `threads` threads: each
    type with at least JUDGED_DEQUANTIZE_MIN_SECONDS of decodes whose rate lies outside RATE_DISPUTED_BEYOND of the
    cached one (or has none cached) takes the observed rate as its cached figure, which the next plan prices with. A
    measurement in isolation cannot stand for a streamed run whose reader decodes beside the passes' compute, so the
    run's own figure replaces it rather than a new measurement. Returns the types judged."""
    judged = set()
    for ggml_type, (weights, seconds) in observed.items():
        if seconds < JUDGED_DEQUANTIZE_MIN_SECONDS or weights <= 0:
            continue
        judged.add(ggml_type)
        key = compute_key(dtype, device, threads) + SHAPES_SEPARATOR + ggml_type
        rate, entry = weights / seconds, cached("dequantize", key)
        if entry and 1 / RATE_DISPUTED_BEYOND <= rate / entry["weights_per_s"] <= RATE_DISPUTED_BEYOND:
            continue
        store("dequantize", key, {"weights_per_s": rate,
                                  "observed": {"job": job, "weights": weights, "seconds": round(seconds, 3)}})
        log.info("%s blocks decoded at %.3g weights/s in job %s where %s was cached: the next plan prices them at the "
                 "run's rate", ggml_type, rate, job, f"{entry['weights_per_s']:.3g}" if entry else "nothing")
    return judged
