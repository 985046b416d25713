"""Does the plan predict what a run does? Predicted peak memory and seconds per pass against measurement.

For each case the script asks `batchrun plan --json` for its prediction, then runs `batchrun submit` with the
same options in a fresh subprocess (inside a cgroup v1 memory cap for the large model, page cache dropped before
each streamed run) and measures:
  - the process's peak RSS (its own wait4 ru_maxrss, benchmarks/launcher.py): what an OOM killer sees, nothing excluded;
  - the time of every pass, from the moment the model's forward starts to the moment the pass's results are
    committed (what the executor calls a pass), split into the prefill pass (first of a batch) and decode passes.
Targets: peak within 20% and median seconds per pass within 30%.

    .venv/bin/python -m benchmarks.plan_accuracy              # all cases (~10 min on 2 cores)
    .venv/bin/python -m benchmarks.plan_accuracy --cases default-resident-generate,large-streamed-generate
    .venv/bin/python -m benchmarks.plan_accuracy --model default:converted   # the default model's float32 conversion

Results: a Markdown table on stdout and benchmarks/results/plan_accuracy-<machine class>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks import harness

# Other work on the 2 shared cores makes torch's threads wait on each other: a measured run waits (up to a limit)
# until the rest of the machine keeps at most this many cores busy, and records what it saw.
QUIET_BUSY_CORES = 0.3
QUIET_WAIT_SECONDS = 300
PEAK_TOLERANCE = 0.20
PASS_TOLERANCE = 0.30
# The large model's cap, as a share of its checkpoint: well under it, so every pass really reads from disk.
LARGE_CAP_SHARE = 0.60
# Budget given to the default-model cases: enough for one batch of every row, and the same number for plan and run.
DEFAULT_MEMORY_GB = 8.0
# The registry name the "default" cases run: the default model as users get it (its GGUF file).
DEFAULT_MODEL = "default"
WORDS = ("the order arrived late and the box was crushed but the blender inside works well enough although the lid "
         "does not seal and the motor makes a grinding noise when I press the pulse button so I would like a "
         "replacement or a refund please tell me which one you can offer and how long it will take to process "
         "because I need it for a party next weekend").split()


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "default", "gemma3" (the registry's Gemma 3 270M) or "large"
    streaming: str  # never | always | auto
    job: str  # generate | choice
    rows: int
    words: tuple[int, int]  # prompt length range in words
    max_new_tokens: int = 8
    batch_size: int | None = None
    memory_gb: float | None = None  # a budget that makes a registry model stream (default: DEFAULT_MEMORY_GB)


CASES = [
    Case("default-resident-generate", "default", "never", "generate", 16, (80, 220)),
    Case("default-streamed-generate", "default", "always", "generate", 16, (80, 220)),
    # four rows a pass: later rows are admitted as earlier ones finish (refill.py), prefilled beside decode steps
    Case("default-streamed-generate-refilled", "default", "always", "generate", 16, (80, 220), batch_size=4),
    Case("default-resident-choice", "default", "never", "choice", 32, (80, 220), batch_size=8),
    Case("default-streamed-choice", "default", "always", "choice", 32, (80, 220), batch_size=8),
    # the registry models as users bring them, streamed because the budget leaves no room to hold them: the plan
    # places the token matrices itself
    Case("default-budget-choice", "default", "auto", "choice", 48, (80, 220), memory_gb=0.7),
    Case("default-budget-generate", "default", "auto", "generate", 8, (80, 220), memory_gb=0.7),
    Case("gemma3-budget-choice", "gemma3", "auto", "choice", 48, (80, 220), memory_gb=1.0),
    Case("gemma3-streamed-generate", "gemma3", "always", "generate", 8, (80, 220)),
    Case("large-streamed-generate", "large", "always", "generate", 4, (60, 100)),
    Case("large-streamed-choice", "large", "always", "choice", 8, (40, 60), batch_size=2),
]


# ---------------------------------------------------------------------------------------------------------------
# Specs


def write_spec(case: Case, directory: Path) -> Path:
    """A deterministic JSONL spec: prompts of varying length from a fixed word list."""
    low, high = case.words
    lines = []
    for index in range(case.rows):
        count = low + (high - low) * index // max(case.rows - 1, 1)
        text = " ".join(WORDS[(index * 7 + k) % len(WORDS)] for k in range(count))
        row: dict = {"id": f"{case.name}-{index}"}
        if case.job == "choice":
            row.update(prompt=f"Review: {text}\nIs this review positive or negative?",
                       choices=["positive", "negative"])
        else:
            row.update(prompt=f"Ticket: {text}\nSummarise the ticket in one sentence.",
                       max_new_tokens=case.max_new_tokens)
        lines.append(json.dumps(row))
    path = directory / f"{case.name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def job_arguments(case: Case, checkpoint: Path, memory_gb: float, bandwidth_gbps: float) -> list[str]:
    """The options plan and submit share: same budget, batch size, policy and bandwidth."""
    arguments = ["--model", str(checkpoint), "--streaming", case.streaming, "--memory", f"{memory_gb:.3f}",
                 "--bandwidth", f"{bandwidth_gbps:.4f}"]
    if case.batch_size:
        arguments += ["--batch-size", str(case.batch_size)]
    return arguments


# ---------------------------------------------------------------------------------------------------------------
# Prediction


def predict(spec: Path, arguments: list[str]) -> dict:
    """`batchrun plan --json` (the candidate), plus the prefill and decode pass times from the same arithmetic,
    which the JSON folds into one median.

    Until batchrun.job.prepare.plan_rows passes the measured memory read rate to make_plan (the candidate then reports
    memory_bytes_per_s), the prediction is made in-process with that rate added, and the row says so."""
    plan = subprocess.run([sys.executable, "-m", "batchrun", "plan", str(spec), *arguments, "--json"],
                          capture_output=True, text=True, check=False)
    if plan.returncode != 0:
        raise RuntimeError(f"batchrun plan failed: {plan.stderr[-3000:]}")
    candidate = json.loads(plan.stdout)["candidates"][0]
    wired = candidate.get("memory_bytes_per_s") is not None
    with _memory_rate_passed(wired):
        if not wired:
            candidate = _plan_in_process(spec, arguments)
        prefill, decode = predicted_pass_kinds(spec, arguments)
    return {**candidate, "predicted_prefill_seconds": prefill, "predicted_decode_seconds": decode,
            "memory_rate_wired_in_cli": wired}


@contextlib.contextmanager
def _memory_rate_passed(already: bool):
    """make_plan as prepare.plan_rows will call it once it passes measure.memory_read_rate."""
    import batchrun.job.prepare as prepare
    from batchrun import measure

    original = prepare.make_plan
    if not already:
        prepare.make_plan = lambda sizes, rows, request, rates, **kwargs: original(sizes, rows, request, replace(
            rates, memory_bytes_per_s=rates.memory_bytes_per_s or measure.memory_read_rate(request.compute_dtype,
                                                                                           request.device)), **kwargs)
    try:
        yield
    finally:
        prepare.make_plan = original


def _plan_in_process(spec: Path, arguments: list[str]) -> dict:
    from batchrun.job.prepare import plan_report

    options = _options_from_arguments(arguments)
    return plan_report(spec, [options.model], options)["candidates"][0]


def predicted_pass_kinds(spec: Path, arguments: list[str]) -> tuple[float | None, float | None]:
    """Median predicted seconds of the first pass of each batch (prefill) and of the later ones (decode)."""
    from batchrun.job.prepare import plan_rows, prepare_job, row_costs

    options = _options_from_arguments(arguments)
    prepared = prepare_job(spec, options)
    runnable = [r for r in prepared.rows if not r.error]
    costs = row_costs(runnable)
    candidate = plan_rows(prepared.model, runnable, options, prepared.device)
    predicted = candidate.time.pass_seconds
    prefill, decode, position = [], [], 0
    for batch in candidate.batching.batches:
        passes = max(costs[i].passes() for i in batch)
        prefill.append(predicted[position])
        decode += predicted[position + 1:position + passes]
        position += passes
    return (statistics.median(prefill) if prefill else None, statistics.median(decode) if decode else None)


def _forget_decode_rates() -> None:
    """Drop the cached rates of checkpoints' layer matrices (measure.decode_rates) and a layer call's fixed cost
    (measure.layer_call_seconds) from the state directory: measured again, as the other rates are."""
    from batchrun import measure
    from batchrun.host.paths import state_dir

    file = state_dir() / measure.MEASUREMENTS_FILE
    measurements = json.loads(file.read_text()) if file.exists() else {}
    dropped = [measurements.pop(section, None) for section in ("decode", "layer_call")]
    if any(section is not None for section in dropped):
        file.write_text(json.dumps(measurements, indent=2))


def _options_from_arguments(arguments: list[str]):
    from batchrun.job.prepare import JobOptions

    values = dict(zip(arguments[::2], arguments[1::2]))
    return JobOptions(model=values["--model"], streaming=values["--streaming"], memory_gb=float(values["--memory"]),
                      bandwidth_gbps=float(values["--bandwidth"]),
                      batch_size=int(values["--batch-size"]) if "--batch-size" in values else None)


# ---------------------------------------------------------------------------------------------------------------
# Measurement: `batchrun submit` in a subprocess that records when each pass starts and ends


def probe(events_file: Path, submit_arguments: list[str]) -> int:
    """Run `batchrun submit` in this process, recording pass timings to events_file (runs in the subprocess).

    Timing hooks only: the model's own forward pre/post hooks and the executor's named fault points
    (`pass` after a pass computed, `committed` after its results are stored)."""
    import batchrun.job.execute as execute
    from batchrun.host import faults
    from batchrun.cli import cli

    events: list[list] = [["imported", time.perf_counter(), _rss_now()]]
    real_open = execute.open_model
    real_reached = faults.reached

    def timed_open(*args, **kwargs):
        started = time.perf_counter()
        model = real_open(*args, **kwargs)
        events.append(["loaded", started, time.perf_counter(), _rss_now()])

        def before(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            events.append(["forward", time.perf_counter(), list(ids.shape) if ids is not None else None,
                           _rss_now()])

        def after(module, args, kwargs, output):
            events.append(["forward_end", time.perf_counter(), _rss_now()])

        model.model.register_forward_pre_hook(before, with_kwargs=True)
        model.model.register_forward_hook(after, with_kwargs=True)
        return model

    def reached(point: str) -> None:
        if point in ("pass", "committed"):
            events.append([point, time.perf_counter(), _rss_now()])
        real_reached(point)

    execute.open_model = timed_open
    faults.reached = reached
    try:
        cli.main(args=["submit", *submit_arguments], standalone_mode=False)
        return 0
    finally:
        events_file.write_text(json.dumps(events))


def _rss_now() -> dict:
    """Current and peak resident set of this process, bytes (diagnoses where memory goes)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def passes_from_events(events: list[list]) -> dict:
    """Per pass: seconds from the first forward after the previous commit to this commit, and whether it was a
    prefill (more than one token per sequence) or a decode pass."""
    passes = []
    start = shape = None
    forward_seconds = 0.0
    forward_started = None
    load_seconds = None
    rss_start = None
    rss_loaded = rss_imported = None
    for event in events:
        kind, moment = event[0], event[1]
        if kind == "imported":
            rss_imported = event[2]
        elif kind == "loaded":
            load_seconds, rss_loaded = event[2] - moment, event[3]
        elif kind == "forward":
            if start is None:
                start, shape, rss_start = moment, event[2], event[3]
            forward_started = moment
        elif kind == "forward_end" and forward_started is not None:
            forward_seconds += moment - forward_started
            forward_started = None
        elif kind == "committed" and start is not None:
            passes.append({"kind": "prefill" if shape and shape[-1] > 1 else "decode", "shape": shape,
                           "seconds": moment - start, "forward_seconds": forward_seconds, "rss_start": rss_start,
                           "rss_end": event[2]})
            start = shape = None
            forward_seconds = 0.0
    return {"load_seconds": load_seconds, "rss_imported": rss_imported, "rss_loaded": rss_loaded, "passes": passes}


def measure_run(case: Case, spec: Path, arguments: list[str], cap_bytes: int | None, work: Path) -> dict:
    events_file = work / f"{case.name}.events.json"
    submit_arguments = [str(spec), *arguments, "--json", "--force", "--db", str(work / f"{case.name}.db"),
                        "--output", str(work / f"{case.name}.parquet")]
    busy_before = harness.wait_for_quiet(QUIET_BUSY_CORES, QUIET_WAIT_SECONDS)
    if case.streaming == "always":
        harness.drop_page_cache()  # a streamed run must read from disk, as it would overnight
    run = harness.run_measured(
        [sys.executable, "-m", "benchmarks.plan_accuracy", "probe", str(events_file), "--", *submit_arguments],
        cwd=harness.REPO_ROOT, memory_cap_bytes=cap_bytes)
    run.check()
    timings = passes_from_events(json.loads(events_file.read_text()))
    seconds = [p["seconds"] for p in timings["passes"]]
    return {
        "peak_rss_bytes": run.peak_rss_bytes, "cgroup_max_usage_bytes": run.cgroup_max_usage_bytes,
        "cap_bytes": cap_bytes, "oom_killed": run.oom_killed, "wall_seconds": run.wall_seconds,
        "busy_cores_before": busy_before, "foreign_busy_cores": run.foreign_busy_cores,
        "summary": run.json_stdout(), **timings,
        "median_seconds_per_pass": statistics.median(seconds) if seconds else None,
        "median_prefill_seconds": _median_of(timings["passes"], "prefill"),
        "median_decode_seconds": _median_of(timings["passes"], "decode"),
    }


def _median_of(passes: list[dict], kind: str) -> float | None:
    values = [p["seconds"] for p in passes if p["kind"] == kind]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------------------------
# The benchmark


def checkpoint_for(model: str, default_name: str = DEFAULT_MODEL) -> Path:
    """The checkpoint a case's model names; "default" is the registry model default_name (--model)."""
    if model == "large":
        return harness.large_checkpoint()
    from batchrun.checkpoint.provision import registry_model

    # Gemma 3's float32 conversion, as its cases' recorded figures were measured on
    return registry_model("gemma3-270m:converted" if model == "gemma3" else default_name)


def run_case(case: Case, bandwidth: float, work: Path, default_name: str = DEFAULT_MODEL) -> dict:
    checkpoint = checkpoint_for(case.model, default_name)
    size = harness.checkpoint_bytes(checkpoint)
    cap = int(size * LARGE_CAP_SHARE) if case.model == "large" else None
    memory_gb = cap / 1e9 if cap else case.memory_gb or DEFAULT_MEMORY_GB
    spec = write_spec(case, work)
    arguments = job_arguments(case, checkpoint, memory_gb, bandwidth / 1e9)
    predicted = predict(spec, arguments)
    measured = measure_run(case, spec, arguments, cap, work)
    measured["rates"] = _rates_now(predicted["compute_dtype"])
    row = {
        "case": case.name, "model": checkpoint.name, "checkpoint_bytes": size, "mode": predicted["mode"],
        "job": case.job, "rows": case.rows, "batch_size": predicted["batch_size"], "passes": predicted["passes"],
        "measured_passes": len(measured["passes"]), "cap_bytes": cap,
        "predicted_peak_bytes": predicted["peak_memory_bytes"], "measured_peak_bytes": measured["peak_rss_bytes"],
        "predicted_seconds_per_pass": predicted["seconds_per_pass"],
        "measured_seconds_per_pass": measured["median_seconds_per_pass"],
        "predicted_prefill_seconds": predicted["predicted_prefill_seconds"],
        "measured_prefill_seconds": measured["median_prefill_seconds"],
        "predicted_decode_seconds": predicted["predicted_decode_seconds"],
        "measured_decode_seconds": measured["median_decode_seconds"],
        "predicted_load_seconds": predicted["load_seconds"], "measured_load_seconds": measured["load_seconds"],
        "foreign_busy_cores": measured["foreign_busy_cores"],
        "memory_rate_wired_in_cli": predicted["memory_rate_wired_in_cli"],
    }
    row["peak_ratio"] = _ratio(row["predicted_peak_bytes"], row["measured_peak_bytes"])
    row["pass_ratio"] = _ratio(row["predicted_seconds_per_pass"], row["measured_seconds_per_pass"])
    row["within_tolerance"] = (abs(row["peak_ratio"] - 1) <= PEAK_TOLERANCE
                               and abs(row["pass_ratio"] - 1) <= PASS_TOLERANCE)
    return {"row": row, "predicted": predicted, "measured": measured}


def _rates_now(dtype: str) -> dict:
    """The cached rates the plan priced this case with (its compute dtype: --dtype auto's choice here)."""
    from batchrun import measure

    return {"compute_dtype": dtype, "compute_flops_per_s": measure.compute_rate(dtype, "cpu"),
            "memory_bytes_per_s": measure.memory_read_rate(dtype, "cpu")}


def _ratio(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured if predicted and measured else None


TABLE_COLUMNS = {
    "case": "case", "mode": "mode", "checkpoint_gb": "ckpt GB", "cap_gb": "cap GB", "passes": "passes",
    "predicted_peak_mb": "pred peak MB", "measured_peak_mb": "meas peak MB", "peak_ratio": "peak ratio",
    "predicted_seconds_per_pass": "pred s/pass", "measured_seconds_per_pass": "meas s/pass", "pass_ratio": "pass ratio",
    "predicted_prefill_seconds": "pred prefill s", "measured_prefill_seconds": "meas prefill s",
    "predicted_decode_seconds": "pred decode s", "measured_decode_seconds": "meas decode s",
    "foreign_busy_cores": "other load (cores)", "within_tolerance": "ok",
}


def table_row(row: dict) -> dict:
    return {**row, "checkpoint_gb": row["checkpoint_bytes"] / 1e9,
            "cap_gb": row["cap_bytes"] / 1e9 if row["cap_bytes"] else None,
            "predicted_peak_mb": row["predicted_peak_bytes"] / 1e6,
            "measured_peak_mb": row["measured_peak_bytes"] / 1e6}


def _merged_with_earlier_cases(results: list[dict]) -> list[dict]:
    """Rerunning some cases (--cases) replaces those in the saved results and keeps the others, in CASES order;
    each case records its own rates and foreign load."""
    saved = harness.RESULTS_DIR / "plan_accuracy.json"
    by_name = {}
    if saved.exists():
        by_name = {case["row"]["case"]: case for case in json.loads(saved.read_text()).get("cases", [])}
    by_name.update({case["row"]["case"]: case for case in results})
    return [by_name[case.name] for case in CASES if case.name in by_name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["probe"]:
        return probe(Path(argv[1]), argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all): "
                        + ", ".join(c.name for c in CASES))
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the registry model the default-* cases run "
                        f"(default: {DEFAULT_MODEL}, its GGUF file; default:converted, its float32 conversion)")
    args = parser.parse_args(argv)
    wanted = set(args.cases.split(",")) if args.cases else {c.name for c in CASES}
    unknown = wanted - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    os.environ.setdefault("BATCHRUN_HOME", str(harness.bench_cache_dir() / "home"))
    Path(os.environ["BATCHRUN_HOME"]).mkdir(parents=True, exist_ok=True)
    from batchrun.errors import BatchrunError

    try:  # provisioned once in the state directory, before the machine is held
        checkpoint_for("default", args.model)
    except BatchrunError as error:
        parser.error(f"--model {args.model}: {error}")
    results = []
    with harness.exclusive_machine(), tempfile.TemporaryDirectory(prefix="plan-accuracy-") as temporary:
        work = Path(temporary)
        # the disk's cold read rate, on the large checkpoint where a case runs it (else on the default model's)
        large = checkpoint_for("large" if any(c.model == "large" for c in CASES if c.name in wanted) else "default",
                               args.model)
        from batchrun import measure

        harness.drop_page_cache()
        bandwidth = harness.cold_read_bandwidth(large)
        harness.wait_for_quiet(QUIET_BUSY_CORES, QUIET_WAIT_SECONDS)
        rates = []
        for dtype in ("float32", "bfloat16"):  # bfloat16: --dtype auto picks it for the large model on such a CPU
            compute = measure.measure_compute_rate(dtype, "cpu")  # now, on the machine as it is now
            memory = measure.measure_memory_read_rate(dtype, "cpu")
            rates.append(f"{dtype} compute {compute / 1e9:.0f} GFLOP/s, memory read {memory / 1e9:.1f} GB/s")
        measure.runtime_overhead_bytes()
        _forget_decode_rates()  # each case's plan measures its model's decode rates now, as the rates above
        print(f"cold read {bandwidth / 1e9:.2f} GB/s; {'; '.join(rates)}", flush=True)
        for case in CASES:
            if case.name in wanted:
                result = run_case(case, bandwidth, work, args.model)
                results.append(result)
                harness.print_table([table_row(result["row"])], TABLE_COLUMNS)
    results = _merged_with_earlier_cases(results)
    print()
    harness.print_table([table_row(r["row"]) for r in results], TABLE_COLUMNS)
    path = harness.save_results("plan_accuracy", {
        "default_model": args.model, "read_bandwidth_bytes_per_s": bandwidth, "compute_flops_per_s": compute,
        "memory_bytes_per_s": memory,
        "tolerances": {"peak": PEAK_TOLERANCE, "seconds_per_pass": PASS_TOLERANCE}, "cases": results})
    print(f"saved {path}")
    return 0 if all(r["row"]["within_tolerance"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
