"""One forward pass of the default model: streamed from disk vs the plain in-memory model.

Run by hand: python benchmarks/forward_time.py [--tokens 128] [--repeats 5]
Prints a Markdown table (median seconds, side by side in one run) and saves benchmarks/results/forward_time-<machine class>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from batchrun import StreamedModel, default_model


def timed(call, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    checkpoint = default_model(converted=True)  # a folder transformers' from_pretrained loads as it is
    ids = torch.randint(100, 40000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    resident = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rows = []
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as streamed:
        resident(ids)  # warm-up both, then alternate so noise hits both alike
        streamed(ids)
        resident_times, streamed_times = [], []
        for _ in range(args.repeats):
            resident_times += timed(lambda: resident(ids), 1)
            streamed_times += timed(lambda: streamed(ids), 1)
        max_diff = (streamed(ids).logits - resident(ids).logits).abs().max().item()
        peak_layers = streamed.peak_materialised_layers
    for name, times in (("in-memory transformers", resident_times), ("batchrun StreamedModel", streamed_times)):
        rows.append({"variant": name, "median_s": statistics.median(times), "runs": len(times)})
    ratio = rows[1]["median_s"] / rows[0]["median_s"]
    print(f"| variant | median s (1 x {args.tokens} tokens) |\n|---|---|")
    for row in rows:
        print(f"| {row['variant']} | {row['median_s']:.3f} |")
    print(f"\nstreamed / in-memory: {ratio:.2f}x; max |logit diff| {max_diff:.2e}; "
          f"peak materialised layers {peak_layers}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "forward_time.json").write_text(json.dumps(
        {"rows": rows, "ratio": ratio, "max_logit_diff": max_diff, "peak_layers": peak_layers,
         "tokens": args.tokens, "threads": torch.get_num_threads()}, indent=2))


if __name__ == "__main__":
    main()
