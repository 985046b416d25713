"""An overnight job as a user meets it: does `batchrun plan` predict the first pass of a 100,000-row spec, and the
whole of the ready jobs and a 1,500-row job?

Two parts, each on the default model (resident), in a state directory of the benchmark's own:

- **first-pass**: a 100,000-row classification spec (reviews built from the ready job's sentences). `plan --json`
  gives the pass bound, the longest planned pass and the planned peak memory; `submit` then runs until its first
  pass commits and is killed with SIGKILL. Measured: the process's peak resident memory (VmHWM, read from /proc
  every 0.2 s), the first pass's seconds, and whether `status` moved inside the first pass. Targets: every planned
  pass within the bound, the planned peak within 20% of the measured one, and the kill losing at most one pass.
- **eta**: each ready job in jobs/, a 1,500-row spec and 10 generation rows of 40 new tokens: `plan --json` for the
  ETA from `submit` (start + load + passes), then `submit`'s wall time. Target: within 30%. Each run waits for a
  quiet machine first (at most 0.3 cores busy over 3 s, from /proc/stat) and records what it saw before and during
  the run.
- **healing**: in a state directory of its own (the converted model shared), this machine's rates are measured while
  busy loops hold every core; then, on a quiet machine, the 10 generation rows are planned, run, and planned again
  (resident, and with `--streaming always` beside the ready review job's first rows). Target: the plan after the
  run within 2x of the run's wall time.

    .venv/bin/python -m benchmarks.overnight                 # every part (~20 min on 2 cores)
    .venv/bin/python -m benchmarks.overnight --parts eta,healing

Results: a Markdown table on stdout and benchmarks/results/overnight-<machine class>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

READY_JOBS = ("review-sentiment.jsonl", "ticket-triage.jsonl")
QUESTION = "Is this review positive or negative? Answer with one word."
PEAK_TOLERANCE = 0.20
ETA_TOLERANCE = 0.30
QUIET_BUSY_CORES = 0.3
SAMPLE_EVERY_S = 0.2


def review_spec(rows: int, path: Path, seed: int = 0) -> Path:
    """`rows` reviews of one to four sentences drawn from the ready review job's, with its question and choices."""
    sentences = []
    for line in (harness.REPO_ROOT / "jobs" / "review-sentiment.jsonl").read_text().splitlines():
        body = json.loads(line)["prompt"].split("\n")[0].removeprefix("Review: ")
        sentences += [s for s in re.split(r"(?<=[.!?])\s+", body) if s]
    generator = random.Random(seed)
    with path.open("w") as out:
        for index in range(rows):
            body = " ".join(generator.sample(sentences, generator.choice((1, 2, 2, 3, 3, 4))))
            out.write(json.dumps({"id": f"review-{index}", "prompt": f"Review: {body}\n{QUESTION}",
                                  "choices": ["positive", "negative"]}) + "\n")
    return path


def generation_spec(path: Path, rows: int = 10, new_tokens: int = 40) -> Path:
    """`rows` requests for a paragraph each, answered to `new_tokens` tokens: a job of decode passes."""
    topics = ["bread", "bridges", "clocks", "maps", "paper", "glass", "bicycles", "tea", "salt", "lighthouses"]
    with path.open("w") as out:
        for index in range(rows):
            out.write(json.dumps({"id": f"g-{index}", "max_new_tokens": new_tokens,
                                  "prompt": f"Write a long, detailed paragraph about the history of "
                                            f"{topics[index % len(topics)]}."}) + "\n")
    return path


def mixed_spec(path: Path, generation: Path, choice_rows: int = 10) -> Path:
    """The ready review job's first `choice_rows` rows, then the generation rows."""
    reviews = (harness.REPO_ROOT / "jobs" / READY_JOBS[0]).read_text().splitlines()[:choice_rows]
    path.write_text("\n".join(reviews) + "\n" + generation.read_text())
    return path


def batchrun(*arguments: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrun", *arguments], capture_output=True, text=True, env=env,
                          check=check)


def plan_candidate(spec: Path, env: dict, *options: str) -> dict:
    report = json.loads(batchrun("plan", str(spec), "--json", *options, env=env).stdout)
    return report["candidates"][0]


def peak_resident_bytes(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


def committed_passes(database: Path) -> list[tuple[float, int | None]]:
    """(seconds, recorded peak memory) of the passes the job's database holds, oldest first."""
    if not database.exists():
        return []
    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1) as connection:
            return connection.execute("select seconds, peak_memory_bytes from passes order by rowid").fetchall()
    except sqlite3.Error:
        return []  # not created yet


def status_in_flight(database: Path, env: dict) -> dict | None:
    shown = batchrun("status", "--db", str(database), "--json", env=env, check=False)
    try:
        jobs = json.loads(shown.stdout)
    except json.JSONDecodeError:
        return None
    job = jobs[0] if isinstance(jobs, list) and jobs else jobs
    return (job or {}).get("in_pass") if isinstance(job, dict) else None


def first_pass(workdir: Path, env: dict, rows: int) -> dict:
    """Plan the 100,000-row spec, run submit until its first pass commits, SIGKILL it, and compare."""
    spec = review_spec(rows, workdir / f"reviews-{rows}.jsonl")
    candidate = plan_candidate(spec, env)
    print(f"planned: {candidate['passes']} passes of up to {candidate['batch_size']} rows, peak "
          f"{candidate['peak_memory_bytes']:,} B", file=sys.stderr, flush=True)
    database, output = workdir / "first-pass.db", workdir / "first-pass.parquet"
    harness.wait_for_quiet(QUIET_BUSY_CORES)
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "batchrun", "submit", str(spec), "--db", str(database),
                                "-o", str(output), "--quiet"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    peak, in_flight, next_status = 0, [], started + 60
    while process.poll() is None and not committed_passes(database):
        peak = max(peak, peak_resident_bytes(process.pid) or 0)
        if time.monotonic() >= next_status:  # status from another process, inside the first pass
            shown = status_in_flight(database, env)
            if shown:
                in_flight.append({"after_s": round(time.monotonic() - started), **shown})
            next_status += 120
        time.sleep(SAMPLE_EVERY_S)
    peak = max(peak, peak_resident_bytes(process.pid) or 0)
    if process.poll() is None:  # it may have ended on its own (or been killed from outside) since
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    passes = committed_passes(database)
    print(f"first pass committed: {passes[:1]}, peak {peak:,} B sampled", file=sys.stderr, flush=True)
    planned_peak = candidate["peak_memory_bytes"]
    return {"rows": rows, "planned_passes": candidate["passes"], "pass_bound_s": candidate["pass_bound_seconds"],
            "longest_planned_pass_s": candidate["longest_pass_seconds"], "batch_size": candidate["batch_size"],
            "planned_peak_bytes": planned_peak, "measured_peak_bytes": peak,
            "recorded_peak_bytes": passes[0][1] if passes else None,
            "peak_error": planned_peak / peak - 1 if peak else None,
            "first_pass_s": passes[0][0] if passes else None, "planned_pass_s": candidate.get("seconds_per_pass"),
            "submit_to_first_commit_s": time.monotonic() - started, "status_in_flight": in_flight}


def eta_case(spec: Path, workdir: Path, env: dict, *options: str, name: str | None = None) -> dict:
    """plan's ETA from submit, against submit's wall time on a quiet machine."""
    candidate = plan_candidate(spec, env, *options)
    name = name or spec.stem
    database, output = workdir / f"{name}.db", workdir / f"{name}.parquet"
    quiet_before = harness.wait_for_quiet(QUIET_BUSY_CORES)
    busy = _BusyDuring()
    started = time.monotonic()
    with busy:
        run = batchrun("submit", str(spec), "--db", str(database), "-o", str(output), "--quiet", "--json", *options,
                       env=env)
    wall = time.monotonic() - started
    summary = json.loads(run.stdout)
    eta = candidate["eta_seconds"] + (candidate.get("start_seconds") or 0.0)
    return {"job": name, "rows": summary.get("rows_total"), "mode": candidate["mode"], "passes": candidate["passes"],
            "planned_eta_s": eta, "planned_start_s": candidate.get("start_seconds"),
            "planned_work_s": candidate["eta_seconds"], "submit_wall_s": wall, "job_seconds": summary.get("seconds"),
            "eta_error": eta / wall - 1, "busy_cores_before": quiet_before, "busy_cores_during": busy.cores}


def healing(workdir: Path, env: dict) -> list[dict]:
    """Rates measured on a busy machine, then a quiet run of each job and the plan after it."""
    home = workdir / "busy-home"
    home.mkdir()
    (home / "models").symlink_to(Path(env["BATCHRUN_HOME"]) / "models")
    busy_env = {**env, "BATCHRUN_HOME": str(home)}
    generation = generation_spec(workdir / "generation-10x40.jsonl")
    cases = [("generation-10x40", generation, ()),
             ("mixed-streamed", mixed_spec(workdir / "mixed.jsonl", generation), ("--streaming", "always"))]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        busy_plans = {name: plan_candidate(spec, busy_env, *options) for name, spec, options in cases}
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    results = []
    for name, spec, options in cases:
        run = eta_case(spec, workdir, busy_env, *options, name=f"{name}-after-busy-rates")
        after = plan_candidate(spec, busy_env, *options)
        after_eta = after["eta_seconds"] + (after.get("start_seconds") or 0.0)
        before = busy_plans[name]
        results.append({"job": name, "busy_plan_eta_s": before["eta_seconds"] + (before.get("start_seconds") or 0.0),
                        "run_planned_eta_s": run["planned_eta_s"], "submit_wall_s": run["submit_wall_s"],
                        "plan_after_eta_s": after_eta, "plan_after_ratio": after_eta / run["submit_wall_s"],
                        "busy_cores_before": run["busy_cores_before"]})
    return results


class _BusyDuring:
    """Cores busy on the whole machine while the block runs (from /proc/stat), batchrun's own included: on 2 cores a
    run keeps ~2 busy, so a figure near 2 says nothing else competed, only that the run used the machine."""

    def __enter__(self):
        self._start = harness._cpu_ticks()
        return self

    def __exit__(self, *exc):
        busy, total = harness._cpu_ticks()
        self.cores = (busy - self._start[0]) / max(total - self._start[1], 1) * (os.cpu_count() or 1)


def _earlier_parts(parts: set[str]) -> dict:
    """The saved results of the parts this run leaves out (each with the time it was measured), kept beside it."""
    saved = harness.RESULTS_DIR / f"{harness.result_stem('overnight')}.json"
    if not saved.exists():
        return {}
    earlier = json.loads(saved.read_text())
    kept = {key: earlier[key] for key in ("eta", "first_pass", "healing")
            if key in earlier and key.replace("_", "-") not in parts}
    return {**kept, "earlier_parts_measured_at": earlier.get("measured_at")} if kept else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="first-pass,eta,healing",
                        help="first-pass, eta and/or healing, comma-separated")
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the first-pass spec")
    options = parser.parse_args(argv)
    parts = set(options.parts.split(","))
    results: dict = {"parts": sorted(parts)}
    with harness.exclusive_machine(), tempfile.TemporaryDirectory(prefix="batchrun-overnight-") as scratch:
        workdir = Path(scratch)
        env = {**os.environ, "BATCHRUN_HOME": str(harness.bench_cache_dir() / "overnight-home")}
        batchrun("plan", str(harness.REPO_ROOT / "jobs" / READY_JOBS[0]), env=env)  # convert and measure first
        if "eta" in parts:
            specs = [harness.REPO_ROOT / "jobs" / name for name in READY_JOBS]
            specs.append(review_spec(1500, workdir / "reviews-1500.jsonl", seed=1))
            specs.append(generation_spec(workdir / "generation-10x40.jsonl"))
            results["eta"] = [eta_case(spec, workdir, env) for spec in specs]
            harness.print_table(results["eta"], {"job": "job", "passes": "passes", "planned_eta_s": "ETA (s)",
                                                 "submit_wall_s": "submit (s)", "eta_error": "error",
                                                 "busy_cores_before": "busy before"})
        if "healing" in parts:
            results["healing"] = healing(workdir, env)
            harness.print_table(results["healing"], {"job": "job", "busy_plan_eta_s": "busy-rate plan (s)",
                                                     "submit_wall_s": "submit (s)",
                                                     "plan_after_eta_s": "plan after (s)",
                                                     "plan_after_ratio": "after / run"})
        if "first-pass" in parts:
            results["first_pass"] = first_pass(workdir, env, options.rows)
            harness.print_table([results["first_pass"]],
                                {"rows": "rows", "batch_size": "rows a pass", "pass_bound_s": "bound (s)",
                                 "longest_planned_pass_s": "longest planned (s)", "first_pass_s": "first pass (s)",
                                 "planned_peak_bytes": "planned peak", "measured_peak_bytes": "measured peak",
                                 "peak_error": "error"})
    print(f"saved {harness.save_results('overnight', {**_earlier_parts(parts), **results})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
