"""What the Ray path costs against a plain `batchrun submit`, and that it answers the same (run by hand; about 3
minutes on 2 cores).

The ready review job (jobs/review-sentiment.jsonl, 60 choice rows) widened to --rows rows (each review again with a
copy number, so no row repeats another), run on the default model three ways, each from a fresh database and each
with the same passes (--batch-size rows a pass, a shard a pass), so that only the path differs:

  plain         `batchrun submit` on this machine
  ray-1         `batchrun submit --ray` on a local one-node Ray cluster holding both cores: the shards one by one
  ray-1-whole   the same with the whole job in one shard: against ray-1, what a shard costs and what a run costs
  ray-2         the shards on two local nodes of one core each

Every way must give the answers of the plain run (probabilities to 1e-5). On a 2-core machine the two nodes share
the cores the plain run has alone, so two nodes cannot be faster here: what this measures is the Ray path's
overhead (connecting, actors starting, shards each opening the model, publishing and merging) and its correctness.
On N real machines the answers per hour grow about N times, less that overhead (docs/distributed.md).

    .venv/bin/python -m benchmarks.distributed [--rows 240] [--batch-size 60] [--model MODEL]

Prints a Markdown table and writes benchmarks/results/distributed-<machine class>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from batchrun.checkpoint import resolve_checkpoint
from batchrun.errors import BatchrunError

from benchmarks import harness

REVIEW_JOB = harness.REPO_ROOT / "jobs" / "review-sentiment.jsonl"
DEFAULT_MODEL = "default:converted"  # the default model's float32 conversion, as batchrun provisions it
TOLERANCE = 1e-5
OBJECT_STORE_BYTES = 100 << 20


def widened_job(path: Path, rows: int) -> Path:
    """The review job's rows, repeated with a copy number in each review until there are `rows` of them."""
    base = [json.loads(line) for line in REVIEW_JOB.read_text().splitlines() if line.strip()]
    lines = []
    for number in range(rows):
        row = dict(base[number % len(base)])
        copy = number // len(base)
        if copy:
            row["id"] = f"{row['id']}-{copy}"
            row["prompt"] = row["prompt"].replace("Review: ", f"Review (copy {copy}): ", 1)
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def submit(spec: Path, model: Path, work: Path, name: str, home: Path, *options: str) -> dict:
    """One measured `batchrun submit` into a fresh database and output, on a quiet machine; its wall time, peak RSS
    and answers."""
    output = work / f"{name}.parquet"
    command = [sys.executable, "-m", "batchrun", "submit", str(spec), "--model", str(model), "--db",
               str(work / f"{name}.db"), "-o", str(output), "--json", *options]
    harness.wait_for_quiet()
    run = harness.run_measured(command, env={"BATCHRUN_HOME": str(home), "HF_HUB_OFFLINE": "1"}, cwd=harness.REPO_ROOT)
    if run.returncode != 0:
        raise SystemExit(f"{name} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    summary = json.loads(run.stdout)
    return {"way": name, "wall_seconds": run.wall_seconds, "peak_rss_bytes": run.peak_rss_bytes,
            "rows": summary["rows_total"], "passes": summary["passes_now"], "notes": summary["notes"],
            "answers": pq.read_table(output).to_pylist()}


def same_answers(got: list[dict], want: list[dict]) -> float:
    """The largest probability difference; raises where an id, answer or error differs."""
    worst = 0.0
    for mine, theirs in zip(got, want, strict=True):
        if (mine["id"], mine["answer"], mine["error"]) != (theirs["id"], theirs["answer"], theirs["error"]):
            raise SystemExit(f"row {theirs['id']}: {mine['answer']!r} against {theirs['answer']!r}")
        for (_, p), (_, q) in zip(mine["choice_probs"] or [], theirs["choice_probs"] or []):
            worst = max(worst, abs(p - q))
    if worst > TOLERANCE:
        raise SystemExit(f"probabilities differ by {worst:.2e}, more than {TOLERANCE}")
    return worst


def on_cluster(name: str, nodes: list[int], home: Path, work: Path, run) -> tuple[dict, float]:
    """`run(address, shared)` on a fresh local cluster of len(nodes) nodes with those CPUs, each node's state
    directory a copy of `home`'s measurements; (its result, seconds the cluster took to start)."""
    from ray.cluster_utils import Cluster

    homes = []
    for number in range(len(nodes)):
        node_home = work / f"{name}-node-{number}"
        node_home.mkdir()
        for measured in home.glob("*.json"):
            shutil.copy(measured, node_home / measured.name)
        homes.append(node_home)
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": nodes[0], "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False,
        "env_vars": {"BATCHRUN_HOME": str(homes[0])}})
    try:
        for cpus, node_home in zip(nodes[1:], homes[1:]):
            cluster.add_node(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES,
                             env_vars={"BATCHRUN_HOME": str(node_home)})
        startup = time.monotonic() - started
        shared = work / f"{name}-shared"
        shared.mkdir()
        return run(cluster.address, shared), startup
    finally:
        cluster.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--batch-size", type=int, default=60)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="as batchrun's --model takes it: a checkpoint, a "
                        "registry name or a hub id (default: the default model's float32 conversion)")
    args = parser.parse_args()
    try:  # where batchrun finds it (a registry model provisioned once in the state directory)
        model = resolve_checkpoint(args.model)
    except BatchrunError as error:
        raise SystemExit(f"--model {args.model}: {error}") from None
    with tempfile.TemporaryDirectory(prefix="batchrun-distributed-") as temp, harness.exclusive_machine():
        work = Path(temp)
        home = work / "home"
        home.mkdir()
        spec = widened_job(work / "reviews.jsonl", args.rows)
        batch = ("--batch-size", str(args.batch_size))
        submit(widened_job(work / "warm.jsonl", 8), model, work, "warm-up", home)  # measures, warms the cache
        plain = submit(spec, model, work, "plain", home, *batch)
        results = [plain]
        for name, nodes, shard_rows in (("ray-1", [2], args.batch_size), ("ray-1-whole", [2], args.rows),
                                        ("ray-2", [1, 1], args.batch_size)):
            def run(address: str, shared: Path, name: str = name, rows: int = shard_rows) -> dict:
                return submit(spec, model, work, name, home, *batch, "--shard-rows", str(rows), "--ray", address,
                              "--shared", str(shared))

            result, startup = on_cluster(name, nodes, home, work, run)
            result["cluster_start_seconds"] = startup
            result["max_probability_difference"] = same_answers(result["answers"], plain["answers"])
            results.append(result)
    table = []
    for result in results:
        result["answers_per_hour"] = result["rows"] / result["wall_seconds"] * 3600
        result["overhead"] = result["wall_seconds"] / plain["wall_seconds"] - 1
        table.append({"way": result["way"], "nodes": 2 if result["way"] == "ray-2" else 1,
                      "rows": result["rows"], "wall s": f"{result['wall_seconds']:.1f}",
                      "answers/hour": f"{result['answers_per_hour']:,.0f}",
                      "overhead": f"{result['overhead']:+.0%}" if result is not plain else "",
                      "driver peak RSS MB": f"{result['peak_rss_bytes'] / 1e6:.0f}",
                      "max |dp|": f"{result.get('max_probability_difference', 0.0):.1e}"})
        del result["answers"]
    harness.print_table(table, list(table[0]))
    shards = -(-args.rows // args.batch_size)
    sharded, whole = results[1]["wall_seconds"], results[2]["wall_seconds"]
    per_shard = (sharded - whole) / max(shards - 1, 1)
    per_run = whole - plain["wall_seconds"] - per_shard
    print(f"the Ray path on one node: {per_run:.1f} s a run (connecting, the actor starting, finishing on the driver) "
          f"and {per_shard:.1f} s a shard of {args.batch_size} rows")
    path = harness.save_results("distributed", {
        "model": str(model), "rows": args.rows, "batch_size": args.batch_size, "shards": shards,
        "overhead_seconds_per_run": per_run, "overhead_seconds_per_shard": per_shard, "results": results,
        "cores": f"{os.cpu_count()} shared by every node: the overhead is the point, not a speed-up"})
    print(f"saved {path}")


if __name__ == "__main__":
    main()
