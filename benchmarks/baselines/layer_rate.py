"""The matmul rate of the checkpoint's own decoder layer, with weights that come from RAM, as a pass meets them.

batchrun's plan probe (batchrun.measure.compute.COMPUTE_SHAPE) times one 256 x 2048 x 2048 matmul again and again: its 16 MB weight
stays in the CPU's caches, and its rate is not the one a pass can reach. A pass multiplies each layer's seven
matrices (here 2048 -> 2048, 2048 -> 256 twice, 2048 -> 2048, 2048 -> 5632 twice, 5632 -> 2048: 176 MB in float32)
once per micro-batch, just after the loader wrote them, so they come from RAM. This module times exactly that: the
2-D weights of decoder layer 0, in the checkpoint's shapes, `copies` layers' worth cycled so that none is still in
the caches when it is used again, multiplied by `tokens` rows with the kernel batchrun picks. The bound's compute
term uses it (the best of `repeats` sweeps: a low reading would make the bound lenient).
Kernel "packed": bfloat16 weights reordered into oneDNN's blocked layout beforehand, untimed, as a long bfloat16
prefill multiplies them (linear_kernels.pack_weights); the bound takes the faster of it and the plain kernel.
"""
from __future__ import annotations

import functools
import re
import time
from pathlib import Path

LAYER_ZERO = re.compile(r"(^|\.)layers\.0\.")
PREFILL_TOKENS = 1024  # rows of one prefill forward call: a micro-batch of the classification sweep has ~800-1,400
CYCLED_BYTES = 512 << 20  # far beyond any L3: the weights a sweep touches again have long left the caches
MAX_COPIES = 16  # a tiny test model's layers stay cached whatever we do: no point in thousands of them


def layer_matrix_shapes(checkpoint: Path) -> list[tuple[int, int]]:
    """[out, in] of every 2-D weight of decoder layer 0 (the matrices one token multiplies in each layer)."""
    from batchrun.checkpoint.resolve import read_tensor_infos

    shapes = [tuple(info.shape) for name, info in read_tensor_infos(checkpoint).items()
              if LAYER_ZERO.search(name) and name.endswith(".weight") and len(info.shape) == 2]
    if not shapes:
        raise ValueError(f"{checkpoint}: no 2-D weights in decoder layer 0")
    return shapes


def layer_matmul_rate(checkpoint: Path, dtype: str, kernel: str, tokens: int = PREFILL_TOKENS,
                      repeats: int = 3) -> float:
    """FLOP/s of `tokens` rows through layer 0's matrices, on `kernel` ("aten", "onednn" or "packed"), best of
    `repeats`."""
    import torch

    from batchrun.runtime import linear_kernels

    torch_dtype = getattr(torch, dtype)
    shapes = layer_matrix_shapes(checkpoint)
    layer_bytes = sum(out * inner for out, inner in shapes) * torch.finfo(torch_dtype).bits // 8
    copies = min(MAX_COPIES, max(2, -(-CYCLED_BYTES // layer_bytes)))
    generator = torch.Generator().manual_seed(0)
    layers = [[torch.randn(out, inner, generator=generator).to(torch_dtype) for out, inner in shapes]
              for _ in range(copies)]
    inputs = {inner: torch.randn(tokens, inner, generator=generator).to(torch_dtype) for _, inner in shapes}
    flops = 2 * tokens * sum(out * inner for out, inner in shapes) * copies
    best = 0.0
    with torch.inference_mode():
        # inputs -> the layer's product, each weight bound in: packed ones reordered now, outside the timing (the
        # reorder is the pass's work, like its attention, not part of the matmul rate)
        if kernel == "packed":
            layers = [[linear_kernels.packed_weight_linear(weight) for weight in layer] for layer in layers]
        else:
            linear = linear_kernels.kernel_linear(kernel)
            layers = [[functools.partial(linear, weight=weight) for weight in layer] for layer in layers]
        widths = [inner for _, inner in shapes]
        for multiply, inner in zip(layers[0], widths):  # first touch and kernel selection, untimed
            multiply(inputs[inner])
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                for multiply, inner in zip(layer, widths):
                    multiply(inputs[inner])
            best = max(best, flops / (time.perf_counter() - start))
    return best
