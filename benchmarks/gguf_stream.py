"""A Llama checkpoint streamed as bfloat16 safetensors against its own Q8_0 and Q4_0 GGUF files, side by side under
one memory cap: bytes read per pass, answers per hour of a decode-heavy sweep, the time of a prefill-heavy
classification, peak memory against the plan, and each run against its bound.

    .venv/bin/python -m benchmarks.gguf_stream                 # ~25 min on 2 busy cores (+~5 min the first time: the
                                                               # 2.2 GB checkpoint and its two GGUF files)
    .venv/bin/python -m benchmarks.gguf_stream --decode-rows 4 --new-tokens 4 --classify-rows 4 --name gguf-dev

The checkpoint is a random-weight Llama of TinyLlama's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, untied
32,000-token vocabulary; 2.2 GB in bfloat16), built once by `harness.large_checkpoint`; its GGUF files are written
beside it by `batchrun quantize` and kept. Each run is `batchrun submit --streaming always --dtype bfloat16` in its
own process inside a fresh cgroup capped at half the bfloat16 checkpoint, the page cache dropped before it, with the
read bandwidth measured just before it (`--bandwidth`); `batchrun plan --json` with the same options gives its
predicted peak, ETA and pass times. The three formats run back to back for each job so they share the machine's
conditions (the load average is recorded beside each run).

The bound of a run: load (non-decoder bytes at the cold read rate, plus dequantizing them), then per pass the slower
of its layer reads at the cold read rate and its work on the cores: its FLOPs at the layer-matmul rate
(baselines/layer_rate.py) plus, for a GGUF, dequantizing its layers once at the measured per-type rates
(batchrun.measure.dequantize_rates, the figures the plan uses). Reads need the disk, not the cores; dequantizing and
multiplying both need the cores, and both rates are measured on all of them.

Results: a Markdown table and the verdict per target on stdout, benchmarks/results/NAME-<machine class>.{md,json}.
"""
from __future__ import annotations

import argparse
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
from benchmarks.baselines import layer_rate, sweeps
from benchmarks.baselines.bounds import ModelShape, batch_pass_flops
from benchmarks.baselines.common import encode_prompts
from benchmarks.throughput import Setting, runner_record

CHECKPOINT_BYTES = 2_200_000_000  # TinyLlama-1.1B's shape at a 32k vocabulary
VOCAB = 32_000
CAP_SHARE = 0.5
DTYPE = "bfloat16"  # what --dtype auto picks for the bfloat16 checkpoint on a CPU with bfloat16 units; every run
# computes in it, so the formats differ only in what they read and decode
FORMATS = ("bf16", "Q8_0", "Q4_0")
# The targets, each GGUF type against the bfloat16 stream.
BYTES_TARGET = {"Q8_0": 0.55, "Q4_0": 0.30}
DECODE_SPEEDUP_TARGET = {"Q8_0": 1.4, "Q4_0": 1.8}
CLASSIFY_SLOWDOWN_LIMIT = 1.1
PEAK_TOLERANCE = 0.20
BOUND_TOLERANCE = 1.25
QUIET_CORES = 0.3
# How long a run waits for other work to quiet down before it starts anyway (the busy cores it saw are recorded).
QUIET_WAIT_S = 45


@dataclass(frozen=True)
class Model:
    fmt: str  # "bf16" | a ggml type
    path: Path
    pass_bytes: int  # the decoder layers as stored
    load_bytes: int  # everything else
    layer_dequantize_seconds: float  # dequantizing the decoder layers once, at the measured rates
    load_dequantize_seconds: float
    dequantize_rates: dict[str, float]  # weights/s into DTYPE by ggml type, the bound's


def quantized_beside(checkpoint: Path, quant_type: str) -> Path:
    """The checkpoint's GGUF of `quant_type` beside it, written by `batchrun quantize` the first time."""
    out = checkpoint.parent / f"{checkpoint.name}.{quant_type}.gguf"
    if not out.exists():
        print(f"writing {out.name} (batchrun quantize, ~2 min)", flush=True)
        subprocess.run([sys.executable, "-m", "batchrun", "quantize", str(checkpoint), "-o", str(out), "--type",
                        quant_type.lower(), "-q"], check=True, cwd=harness.REPO_ROOT)
    return out


def best_dequantize_rates(ggml_types: set[str], repeats: int = 3) -> dict[str, float]:
    """Weights per second decoded into DTYPE per type, the best of `repeats` measurements by the plan's own probe
    (measure.dequantize_rates; a low reading, taken while other work shares the cores, would make the bound lenient).
    The plan keeps the last one."""
    from batchrun.measure.dequantize import dequantize_rates

    best: dict[str, float] = {}
    for _ in range(repeats):
        forget_plan_rates(("dequantize",))
        for kind, rate in dequantize_rates(ggml_types, DTYPE).items():
            best[kind] = max(best.get(kind, 0.0), rate)
    return best


def describe(fmt: str, path: Path, rates: dict[str, float]) -> Model:
    from batchrun.checkpoint.sizes import checkpoint_sizes

    sizes = checkpoint_sizes(path)

    def seconds(by_type: dict[str, int]) -> float:
        return sum(count / rates[kind] for kind, count in by_type.items())

    return Model(fmt, path, sizes.decoder_bytes, sizes.non_decoder_bytes, seconds(sizes.layer_params_by_type),
                 seconds(sizes.non_decoder_params_by_type),
                 {kind: rates[kind] for kind in {*sizes.layer_params_by_type, *sizes.non_decoder_params_by_type}})


def make_jobs(tokenizer, args) -> dict[str, sweeps.Sweep]:
    """The decode-heavy sweep (short prompts, many new tokens) and the prefill-heavy classification (a short shared
    instruction, reviews of a few hundred tokens each)."""
    decode = sweeps.short_answer(tokenizer, args.decode_rows, instruction_tokens=60, ticket_tokens=(20, 40),
                                 max_new_tokens=args.new_tokens)
    classify = sweeps.classification(tokenizer, args.classify_rows, instruction_tokens=40,
                                     review_tokens=(args.review_tokens - 40, args.review_tokens + 40))
    return {"decode": replace(decode, name="decode"), "classification": classify}


def job_options(model: Model, cap_bytes: int, bandwidth: float) -> list[str]:
    return ["--model", str(model.path), "--memory", f"{cap_bytes / 1e9:.3f}", "--bandwidth", f"{bandwidth / 1e9:.4f}",
            "--streaming", "always", "--dtype", DTYPE, "--raw", "--calibrate", "none"]


def planned(spec: Path, options: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "batchrun", "plan", str(spec), *options, "--json"],
                          capture_output=True, text=True, cwd=harness.REPO_ROOT)
    if not done.stdout.strip():
        raise RuntimeError(f"batchrun plan {' '.join(options)}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)["candidates"][0]


def run_one(spec: Path, model: Model, cap_bytes: int, stem: Path) -> dict:
    """Plan, then submit in a fresh process inside the cap, the page cache dropped first and the read rate measured
    just before."""
    busy = harness.wait_for_quiet(QUIET_CORES, timeout_s=QUIET_WAIT_S)
    bandwidth = harness.cold_read_bandwidth(model.path)
    options = job_options(model, cap_bytes, bandwidth)
    plan = planned(spec, options)
    arguments = [str(spec), *options, "--quiet", "--force", "--db", str(stem.with_suffix(".db")),
                 "--output", str(stem.with_suffix(".parquet"))]
    load_before = os.getloadavg()[0]
    harness.drop_page_cache()
    result_file = stem.with_suffix(".result.json")
    run = harness.run_measured([sys.executable, "-m", "benchmarks.baselines.batchrun_runner", str(result_file),
                                *arguments], cwd=harness.REPO_ROOT, memory_cap_bytes=cap_bytes)
    record = {"format": model.fmt, "command": "batchrun submit " + " ".join(arguments), "bandwidth": bandwidth,
              "busy_cores_before": busy, "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
              "wall_seconds": run.wall_seconds, "peak_rss_bytes": run.peak_rss_bytes, "oom_killed": run.oom_killed,
              "cgroup_max_usage_bytes": run.cgroup_max_usage_bytes, "foreign_busy_cores": run.foreign_busy_cores,
              "plan": {key: plan[key] for key in (
                  "peak_memory_bytes", "eta_seconds", "seconds_per_pass", "io_seconds_per_pass",
                  "compute_seconds_per_pass", "load_seconds", "batch_size", "passes", "token_matrices",
                  "linear_kernel", "packs_weights", "prefetch_depth", "decode_prefetch_depth", "caveats")}}
    if run.returncode != 0:
        killed = "killed for lack of memory under the cap; " if run.oom_killed else ""
        return record | {"failed": f"{killed}exit {run.returncode}: {(run.stderr or run.stdout)[-3000:]}"}
    return record | runner_record(json.loads(result_file.read_text()))


def bound(record: dict, model: Model, shape: ModelShape, prompts: list[list[int]], compute_rate: float) -> dict:
    """The run's bound at the rates measured now (module docstring): its passes' FLOPs for the batches it ran."""
    new_tokens = [max(t or 1, 1) for t in record["output_tokens"]]
    batch = record["batch_size"] or len(prompts)
    flops: list[int] = []
    for start in range(0, len(prompts), batch):
        flops += batch_pass_flops(shape, prompts[start:start + batch], new_tokens[start:start + batch], True)
    bandwidth = record["bandwidth"]
    read, dequantize = model.pass_bytes / bandwidth, model.layer_dequantize_seconds
    passes = [max(read, f / compute_rate + dequantize) for f in flops]
    load = model.load_bytes / bandwidth + model.load_dequantize_seconds
    return {"passes": len(flops), "load_seconds": load, "read_seconds_per_pass": read,
            "dequantize_seconds_per_pass": dequantize, "compute_seconds": [f / compute_rate for f in flops],
            "pass_seconds": passes, "seconds": load + sum(passes)}


def add_figures(record: dict, model: Model, shape: ModelShape, prompts: list[list[int]], compute_rate: float) -> None:
    if "failed" in record:
        return
    record["answers_per_hour"] = len(prompts) / record["answer_seconds"] * 3600
    record["bytes_per_pass"] = record["bytes_read"] / max(record["passes"], 1)
    record["median_pass_seconds"] = statistics.median(record["pass_seconds"]) if record["pass_seconds"] else None
    record["peak_over_plan"] = record["peak_rss_bytes"] / record["plan"]["peak_memory_bytes"]
    record["bound"] = bound(record, model, shape, prompts, compute_rate)
    record["over_bound"] = record["answer_seconds"] / record["bound"]["seconds"]
    record["over_plan_eta"] = (record["answer_seconds"] / record["plan"]["eta_seconds"]
                               if record["plan"]["eta_seconds"] else None)


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def decode_pass_arithmetic(record: dict) -> str:
    """A decode pass's bound, term by term (the median pass of the run's bound)."""
    b = record["bound"]
    decode = sorted(b["compute_seconds"][1:]) or b["compute_seconds"]
    compute = decode[len(decode) // 2]
    return (f"read {b['read_seconds_per_pass']:.2f} s ({record['bandwidth'] / 1e9:.2f} GB/s), dequantize "
            f"{b['dequantize_seconds_per_pass']:.2f} s, compute {compute:.3f} s")


def bytes_targets(runs: dict[str, dict]) -> list[str]:
    base = runs["bf16"]["bytes_per_pass"]
    return [f"bytes read per pass, {fmt}: {runs[fmt]['bytes_per_pass'] / base:.3f}x of bf16 (target <= {limit}): "
            f"{verdict(runs[fmt]['bytes_per_pass'] / base <= limit)}" for fmt, limit in BYTES_TARGET.items()]


def decode_targets(runs: dict[str, dict]) -> list[str]:
    base = runs["bf16"]
    lines = [f"bf16 decode pass bound: {decode_pass_arithmetic(base)}; run {base['over_bound']:.2f}x its bound"]
    for fmt, target in DECODE_SPEEDUP_TARGET.items():
        run = runs[fmt]
        gain = run["answers_per_hour"] / base["answers_per_hour"]
        bound_gain = base["bound"]["seconds"] / run["bound"]["seconds"]
        line = (f"decode sweep, {fmt}: {gain:.2f}x the answers per hour of bf16 (target >= {target}): "
                f"{verdict(gain >= target)}; the bounds allow {bound_gain:.2f}x ({decode_pass_arithmetic(run)} a "
                f"decode pass)")
        if bound_gain < target:
            line += (f"; the bound caps the gain below the target, and the run is {run['over_bound']:.2f}x its "
                     f"bound (target within {BOUND_TOLERANCE}x): {verdict(run['over_bound'] <= BOUND_TOLERANCE)}")
        lines.append(line)
    return lines


def classify_targets(runs: dict[str, dict]) -> list[str]:
    base = runs["bf16"]["answer_seconds"]
    return [f"classification, {fmt}: {runs[fmt]['answer_seconds'] / base:.2f}x the time of bf16 (target <= "
            f"{CLASSIFY_SLOWDOWN_LIMIT}): {verdict(runs[fmt]['answer_seconds'] / base <= CLASSIFY_SLOWDOWN_LIMIT)}"
            for fmt in BYTES_TARGET]


def common_targets(job: str, runs: dict[str, dict]) -> list[str]:
    lines = []
    for fmt, run in runs.items():
        over = run["peak_over_plan"]
        lines.append(f"{job}, {fmt}: peak RSS {run['peak_rss_bytes'] / 1e6:.0f} MB = {over:.2f}x the plan's "
                     f"{run['plan']['peak_memory_bytes'] / 1e6:.0f} MB (target within 20%): "
                     f"{verdict(abs(over - 1) <= PEAK_TOLERANCE)}; {run['over_bound']:.2f}x its bound of "
                     f"{run['bound']['seconds']:.1f} s (within {BOUND_TOLERANCE}x: "
                     f"{verdict(run['over_bound'] <= BOUND_TOLERANCE)})")
    return lines


def targets(job: str, runs: dict[str, dict]) -> list[str]:
    failed = [f"{job}, {fmt}: FAILED: {run['failed'][-300:]}" for fmt, run in runs.items() if "failed" in run]
    if failed or "bf16" not in runs:
        return failed
    lines = bytes_targets(runs) if job == "decode" else []
    lines += decode_targets(runs) if job == "decode" else classify_targets(runs)
    return lines + common_targets(job, runs)


COLUMNS = {"job": "job", "format": "format", "rows": "rows", "batch_size": "batch", "passes": "passes",
           "bytes_per_pass_gb": "GB read / pass", "answer_seconds": "answer s", "answers_per_hour": "answers/h",
           "median_pass_seconds": "median pass s", "plan_pass_seconds": "plan pass s", "plan_eta": "plan ETA s",
           "bound_seconds": "bound s", "over_bound": "x bound", "peak_rss_mb": "peak RSS MB",
           "plan_peak_mb": "plan peak MB", "cgroup_peak_mb": "cgroup peak MB", "bandwidth_gbps": "GB/s",
           "load": "load avg"}


def table_row(job: str, rows: int, run: dict) -> dict:
    if "failed" in run:
        return {"job": job, "format": run["format"], "rows": rows, "answer_seconds": "failed"}
    return {"job": job, "format": run["format"], "rows": rows, "batch_size": run["batch_size"],
            "passes": run["passes"], "bytes_per_pass_gb": run["bytes_per_pass"] / 1e9,
            "answer_seconds": run["answer_seconds"], "answers_per_hour": run["answers_per_hour"],
            "median_pass_seconds": run["median_pass_seconds"], "plan_pass_seconds": run["plan"]["seconds_per_pass"],
            "plan_eta": run["plan"]["eta_seconds"], "bound_seconds": run["bound"]["seconds"],
            "over_bound": run["over_bound"], "peak_rss_mb": run["peak_rss_bytes"] / 1e6,
            "plan_peak_mb": run["plan"]["peak_memory_bytes"] / 1e6,
            "cgroup_peak_mb": (run["cgroup_max_usage_bytes"] or 0) / 1e6, "bandwidth_gbps": run["bandwidth"] / 1e9,
            "load": f"{run['load_average_before']:.1f}-{run['load_average_after']:.1f}"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-bytes", type=float, default=CHECKPOINT_BYTES)
    parser.add_argument("--cap-gb", type=float, help=f"memory cap (default: {CAP_SHARE} x the bf16 checkpoint)")
    parser.add_argument("--decode-rows", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24, help="new tokens of every decode row")
    parser.add_argument("--classify-rows", type=int, default=24)
    parser.add_argument("--review-tokens", type=int, default=220, help="mean review length of a classification row")
    parser.add_argument("--jobs", default="decode,classification")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--name", default="gguf-stream-2gb-llama", help="results file stem under benchmarks/results")
    return parser.parse_args(argv)


# The plan's cached rates, dropped at the start: a shared machine's earlier readings (taken under other work) would
# price every run, so the plans and the bounds take this machine's rates as they are now.
PLAN_RATE_SECTIONS = ("compute", "memory", "decode", "layer_call", "dequantize")


def forget_plan_rates(sections: tuple[str, ...] = PLAN_RATE_SECTIONS) -> None:
    from batchrun import measure
    from batchrun.host.paths import state_dir

    file = state_dir() / measure.MEASUREMENTS_FILE
    measurements = json.loads(file.read_text()) if file.exists() else {}
    if any([measurements.pop(section, None) is not None for section in sections]):
        file.write_text(json.dumps(measurements, indent=2))


def prepare(args) -> tuple[Path, dict[str, Model], Setting]:
    """The checkpoint, its GGUF files, and the rates measured at the start (the plan's among them)."""
    checkpoint = harness.large_checkpoint(int(args.checkpoint_bytes), "bfloat16", vocab_size=VOCAB)
    paths = {"bf16": checkpoint, **{kind: quantized_beside(checkpoint, kind) for kind in FORMATS[1:]}}
    harness.wait_for_quiet(QUIET_CORES, timeout_s=QUIET_WAIT_S)
    forget_plan_rates()
    rates = best_dequantize_rates({"F32", *(kind for kind in FORMATS[1:] if kind in args.formats.split(","))})
    models = {fmt: describe(fmt, paths[fmt], rates) for fmt in args.formats.split(",")}
    cap = int(args.cap_gb * 1e9) if args.cap_gb else int(harness.checkpoint_bytes(checkpoint) * CAP_SHARE)
    bandwidth, rate, kernel, probe = compute_and_read_rates(checkpoint)
    setting = Setting(checkpoint, ModelShape.of(checkpoint), cap, bandwidth, rate, 0, checkpoint, linear_kernel=kernel,
                      dtype=DTYPE, dtype_given=True, probe_rate=probe)
    return checkpoint, models, setting


def compute_and_read_rates(checkpoint: Path) -> tuple[float, float, str, float]:
    """(cold read bytes/s, FLOP/s of the checkpoint's own layer matmuls on the faster of batchrun's kernel and packed
    weights, that kernel, the plan probe's FLOP/s), as the throughput benchmark measures them."""
    from batchrun import measure
    from batchrun.runtime import linear_kernels

    harness.drop_page_cache()
    bandwidth = harness.cold_read_bandwidth(checkpoint)
    probe = max(measure.measure_compute_rate(DTYPE, "cpu") for _ in range(3))
    kernel = measure.linear_kernel(DTYPE, "cpu")
    rate = layer_rate.layer_matmul_rate(checkpoint, DTYPE, kernel)
    if linear_kernels.packing_available():
        rate, kernel = max((rate, kernel), (layer_rate.layer_matmul_rate(checkpoint, DTYPE, "packed"), "packed"))
    return bandwidth, rate, kernel, probe


def header(checkpoint: Path, models: dict[str, Model], setting: Setting) -> str:
    rates = {kind: rate for model in models.values() for kind, rate in model.dequantize_rates.items()}
    sizes = ", ".join(f"{fmt} {(m.pass_bytes + m.load_bytes) / 1e9:.2f} GB (layers {m.pass_bytes / 1e9:.2f})"
                      for fmt, m in models.items())
    dequant = ", ".join(f"{kind} {rate / 1e9:.3f} G weights/s" for kind, rate in sorted(rates.items()))
    return (f"Checkpoint {checkpoint.name}: {sizes}; memory cap {setting.cap_bytes / 1e9:.2f} GB; cold read "
            f"{setting.bandwidth / 1e9:.2f} GB/s at the start (each run's own just before it, column GB/s); {DTYPE} "
            f"compute {setting.compute_rate / 1e9:.0f} GFLOP/s (the layer's matmuls, {setting.linear_kernel}; plan "
            f"probe {setting.probe_rate / 1e9:.0f}); dequantization into {DTYPE} (best of 3): {dequant}; "
            f"{os.cpu_count()} cores; commit {git_commit()}.")


def git_commit() -> str:
    done = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                          cwd=harness.REPO_ROOT)
    return done.stdout.strip()[:100]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("BATCHRUN_HOME", str(harness.bench_cache_dir() / "home"))
    Path(os.environ["BATCHRUN_HOME"]).mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    records, verdicts, rows = [], [], []
    started = time.perf_counter()
    with harness.exclusive_machine(), tempfile.TemporaryDirectory(prefix="gguf-stream-") as temporary:
        checkpoint, models, setting = prepare(args)
        print(header(checkpoint, models, setting), flush=True)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        jobs = make_jobs(tokenizer, args)
        for job in args.jobs.split(","):
            sweep = jobs[job]
            spec = sweep.write_spec(Path(temporary) / f"{job}.jsonl")
            prompts = encode_prompts(tokenizer, sweep.prompts)
            runs = {}
            for fmt, model in models.items():
                print(f"{job}: {fmt}", flush=True)
                run = run_one(spec, model, setting.cap_bytes, Path(temporary) / f"{job}-{fmt}")
                add_figures(run, model, setting.shape, prompts, setting.compute_rate)
                runs[fmt] = run | {"job": job}
                print("  -> " + json.dumps({key: run.get(key) for key in (
                    "answer_seconds", "passes", "bytes_per_pass", "peak_rss_bytes", "over_bound", "failed")}),
                      flush=True)
                rows.append(table_row(job, len(prompts), run))
            records += runs.values()
            verdicts += targets(job, runs)
    text = (f"{header(checkpoint, models, setting)}\n\n{harness.format_table(rows, COLUMNS)}\n\nTargets:\n"
            + "\n".join(f"- {line}" for line in verdicts) + f"\n\nBenchmark wall time "
            f"{time.perf_counter() - started:.0f} s.\n")
    print("\n" + text)
    stem = harness.result_stem(args.name)
    (harness.RESULTS_DIR / f"{stem}.md").write_text(text)
    path = harness.save_results(args.name, {
        "command": "python -m benchmarks.gguf_stream " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(), "checkpoint": str(checkpoint), "models": {f: m.__dict__ for f, m in models.items()},
        "cap_bytes": setting.cap_bytes, "compute_flops_per_s": setting.compute_rate,
        "probe_flops_per_s": setting.probe_rate, "linear_kernel": setting.linear_kernel, "dtype": DTYPE,
        "targets": verdicts, "records": records, "table": text})
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
