"""How fast a checkpoint's own layer matrices multiply, with weights coming from RAM as a pass meets them.

A pass multiplies every layer's matrices once per forward call, and by the time a layer comes round again its
weights have left the CPU's caches. A probe of one fixed shape misses two things that decide a decode step: the
checkpoint's own shapes, and the row count: a small model's matrices stream several times faster at one row than at
a few dozen, and neither rate is the fixed probe's (docs/planning.md#time). So decode passes are priced at their own
row count's rate, timed on layer 0's shapes.
Importing this module imports no torch.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Sequence

# Layers' worth of matrices cycled per sweep: beyond the CPU caches (a server's L3 can hold hundreds of MiB), or the
# whole decoder of a model smaller than that, which is the working set its decode passes meet.
CYCLED_BYTES = 512 << 20


def cycled_shapes(shapes: Sequence[tuple[int, int]], element_bytes: int, num_layers: int,
                  cycled_bytes: int = CYCLED_BYTES) -> list[tuple[int, int]]:
    """The matrices to allocate: copies of the layer up to cycled_bytes (no more layers than the model has, at
    least one). A layer larger than cycled_bytes gives its matrices in order until the next would pass it (at least
    one), so the measurement never holds much more than cycled_bytes."""
    layer_bytes = sum(out * inner for out, inner in shapes) * element_bytes
    if layer_bytes <= cycled_bytes:
        copies = max(1, min(num_layers, math.ceil(cycled_bytes / max(layer_bytes, 1))))
        return list(shapes) * copies
    chosen, total = [], 0
    for out, inner in shapes:
        size = out * inner * element_bytes
        if chosen and total + size > cycled_bytes:
            break
        chosen.append((out, inner))
        total += size
    return chosen


def weight_read_rates(shapes: Sequence[tuple[int, int]], num_layers: int, dtype: str, device: str,
                      rows: Sequence[int], linear, wait, repeats: int = 3) -> dict[int, float]:
    """{rows: weight bytes/s} of `linear(input, weight)` over the cycled matrices at each row count: the median of
    `repeats` sweeps after an untimed one (first touch, kernel selection). `wait` returns once an accelerator has
    finished what it was given."""
    import torch

    torch_dtype = getattr(torch, dtype)
    element_bytes = torch.finfo(torch_dtype).bits // 8
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inner, generator=generator).to(device=device, dtype=torch_dtype)
               for out, inner in cycled_shapes(shapes, element_bytes, num_layers)]
    streamed = sum(weight.numel() for weight in weights) * element_bytes
    rates = {}
    with torch.inference_mode():
        for count in rows:
            inputs = {inner: torch.randn(count, inner, generator=generator).to(device=device, dtype=torch_dtype)
                      for inner in {weight.shape[1] for weight in weights}}
            seconds = []
            for sweep in range(repeats + 1):
                start = time.perf_counter()
                for weight in weights:
                    linear(inputs[weight.shape[1]], weight)
                wait()
                if sweep:
                    seconds.append(time.perf_counter() - start)
            rates[count] = streamed / max(statistics.median(seconds), 1e-9)
    return rates
