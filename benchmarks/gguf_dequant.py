"""GGUF dequantization speed per ggml type: batchrun's torch decoders against gguf-py's numpy reference, one thread.

    .venv/bin/python -m benchmarks.gguf_dequant [--size 2048] [--tile-rows 64] [--repeats 7]   (~1 min on 2 cores)

For each supported type, a size x size matrix of blocks: the types gguf-py can write are quantized from normal
weights (std 0.02, as in trained layers), the K-quants are random bytes with fp16 scales of a trained layer's range
(any bytes are valid blocks). Timed: the whole matrix into float32, the same matrix tile by tile (tile-rows rows at a
time, as a streaming loader reads it), and gguf.quants.dequantize on the whole; the median of --repeats runs each,
after a check that the torch result equals gguf-py's bit for bit. Prints a Markdown table and writes
benchmarks/results/gguf-dequant-<machine class>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from batchrun.checkpoint import GGUF_BLOCKS
from batchrun.runtime import dequantize
from benchmarks import harness

# fp16 scale bytes of each K-quant block: Q4_K/Q5_K's d and dmin, Q6_K's d.
K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def matrix_blocks(ggml_type: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """[size, row bytes] uint8: a size x size matrix stored as `ggml_type`."""
    from gguf import GGMLQuantizationType, quants

    if ggml_type not in K_SCALE_OFFSETS:
        weights = rng.standard_normal((size, size), dtype=np.float32) * np.float32(0.02)
        if ggml_type == "F32":
            return weights.view(np.uint8)
        return np.ascontiguousarray(quants.quantize(weights, GGMLQuantizationType[ggml_type])).view(np.uint8)
    weights_per_block, block_bytes = GGUF_BLOCKS[ggml_type]
    blocks = rng.integers(0, 256, size=(size * size // weights_per_block, block_bytes), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(1e-4, 1e-2, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(size, -1)


def median_seconds(call, repeats: int) -> float:
    call()  # warm-up: first-touch of the allocator's pages
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_type(ggml_type: str, size: int, tile_rows: int, repeats: int, rng: np.random.Generator) -> dict:
    from gguf import GGMLQuantizationType, quants

    raw = matrix_blocks(ggml_type, size, rng)
    stored = torch.from_numpy(raw.copy())
    reference = quants.dequantize(raw, GGMLQuantizationType[ggml_type])
    ours = dequantize(stored, ggml_type, (size, size))
    if not torch.equal(ours, torch.from_numpy(np.ascontiguousarray(reference))):
        raise SystemExit(f"{ggml_type}: the torch result differs from gguf-py's")

    def tiles():
        for start in range(0, size, tile_rows):
            dequantize(stored[start:start + tile_rows], ggml_type, (min(tile_rows, size - start), size))

    weights = size * size
    whole = median_seconds(lambda: dequantize(stored, ggml_type, (size, size)), repeats)
    tiled = median_seconds(tiles, repeats)
    numpy_s = median_seconds(lambda: quants.dequantize(raw, GGMLQuantizationType[ggml_type]), repeats)
    return {"type": ggml_type, "bits_per_weight": GGUF_BLOCKS[ggml_type][1] * 8 / GGUF_BLOCKS[ggml_type][0],
            "torch_whole_ms": whole * 1e3, "torch_whole_gws": weights / whole / 1e9,
            "torch_tiles_ms": tiled * 1e3, "torch_tiles_gws": weights / tiled / 1e9,
            "gguf_py_ms": numpy_s * 1e3, "gguf_py_gws": weights / numpy_s / 1e9,
            "tiles_over_gguf_py": numpy_s / tiled}


COLUMNS = {"type": "type", "bits_per_weight": "bits/weight", "torch_whole_ms": "torch whole (ms)",
           "torch_whole_gws": "G weights/s", "torch_tiles_ms": "torch tiles (ms)", "torch_tiles_gws": "G weights/s",
           "gguf_py_ms": "gguf-py (ms)", "gguf_py_gws": "G weights/s", "tiles_over_gguf_py": "tiles vs gguf-py"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2048, help="rows and columns of the matrix (a multiple of 256)")
    parser.add_argument("--tile-rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--types", nargs="*", default=list(GGUF_BLOCKS), choices=list(GGUF_BLOCKS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    with harness.exclusive_machine():
        busy = harness.wait_for_quiet(timeout_s=120)
        rows = [measure_type(name, args.size, args.tile_rows, args.repeats, rng) for name in args.types]
    harness.print_table(rows, COLUMNS)
    print(f"\n{args.size} x {args.size}, tiles of {args.tile_rows} rows, median of {args.repeats}, one thread; "
          f"other work kept {busy:.1f} cores busy at the start")
    path = harness.save_results("gguf-dequant", {"size": args.size, "tile_rows": args.tile_rows,
                                                 "repeats": args.repeats, "busy_cores_at_start": busy,
                                                 "torch": torch.__version__, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
