"""A job run from a GGUF file against the same job on the model's float32 conversion, side by side in one run.

    .venv/bin/python -m benchmarks.gguf_models --gguf SmolLM2-135M-Instruct.Q4_1.gguf
        [--converted DIR] [--job jobs/review-sentiment.jsonl] [--streaming never always]

For each model (the GGUF file; the registry's float32 conversion of it, default the default model's) and each
--streaming mode: `batchrun submit JOB --dtype float32 --calibrate none` in a fresh process (its wall time and peak
RSS, benchmarks/launcher.py), after dropping the page cache where this process may (root). Then whether the answers
and their probabilities are the same for every row, and the bytes one streamed pass reads (a StreamedModel without
read-ahead, one forward of a 32-token prompt). Prints a Markdown table and writes
benchmarks/results/gguf-models-<machine class>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch

from batchrun.checkpoint import checkpoint_sizes, registry_model
from batchrun.runtime import LayerReads, StreamedModel
from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]


def pass_bytes(model: Path) -> int:
    """Layer bytes one streamed pass reads (no read-ahead, so nothing of a next pass is read)."""
    with StreamedModel(model, device="cpu", dtype="float32", reads=LayerReads(prefetch=False)) as streamed:
        streamed(torch.arange(1, 33).unsqueeze(0))
        return streamed.loader.bytes_read


def run_job(job: Path, model: Path, streaming: str, work: Path) -> tuple[dict, dict]:
    """(the run's figures, its answers by column)."""
    name = f"{model.name}-{streaming}"
    out = work / f"{name}.parquet"
    command = [sys.executable, "-m", "batchrun", "submit", str(job), "--model", str(model), "--db",
               str(work / f"{name}.db"), "--output", str(out), "--streaming", streaming, "--dtype", "float32",
               "--calibrate", "none", "-q"]
    if os.geteuid() == 0:
        harness.drop_page_cache()
    result = harness.run_measured(command, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    row = {"model": model.name, "streaming": streaming, "wall_s": result.wall_seconds,
           "peak_rss_mib": result.peak_rss_bytes / 2**20, "foreign_busy_cores": result.foreign_busy_cores}
    return row, pq.read_table(out).to_pydict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--converted", type=Path, default=None, help="default: the default model's conversion")
    parser.add_argument("--job", type=Path, default=REPO / "jobs" / "review-sentiment.jsonl")
    parser.add_argument("--streaming", nargs="*", default=["never", "always"])
    args = parser.parse_args()
    converted = args.converted or registry_model("smollm2-135m:converted")
    rows, answers = [], {}
    with harness.exclusive_machine(), tempfile.TemporaryDirectory() as work:
        busy = harness.wait_for_quiet(timeout_s=120)
        for model in (args.gguf, converted):
            layer_bytes = pass_bytes(model)
            for streaming in args.streaming:
                row, answers[model.name, streaming] = run_job(args.job, model, streaming, Path(work))
                rows.append({**row, "checkpoint_mib": checkpoint_sizes(model).checkpoint_bytes / 2**20,
                             "pass_read_mib": layer_bytes / 2**20})
    reference = answers[converted.name, args.streaming[0]]
    for row in rows:
        ran = answers[row["model"], row["streaming"]]
        row["rows_differing"] = sum(a != b or p != q for a, b, p, q in zip(
            ran["answer"], reference["answer"], ran["choice_probs"], reference["choice_probs"]))
    harness.print_table(rows, ["model", "streaming", "checkpoint_mib", "pass_read_mib", "wall_s", "peak_rss_mib",
                               "rows_differing", "foreign_busy_cores"])
    print(f"\n{args.job.name}, float32 compute; other work kept {busy:.1f} cores busy at the start")
    path = harness.save_results("gguf-models", {"job": str(args.job), "busy_cores_at_start": busy,
                                                "torch": torch.__version__, "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
