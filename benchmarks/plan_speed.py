"""How long `batchrun plan` takes on a 10,000-row spec (run by hand). Planning reads no weights, so its time is
reading + validating the spec, tokenizing every prompt and the arithmetic; a user waits for all of it.

    python benchmarks/plan_speed.py [--model MODEL] [--rows 10000]

Times the command as a user runs it (a fresh process, so imports included; median of 3) and, in-process, the
steps: spec reading, tokenizing, the whole plan report. Prints a Markdown table; writes
benchmarks/results/plan_speed-<machine class>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchrun.checkpoint import resolve_checkpoint
from batchrun.errors import BatchrunError

DEFAULT_MODEL = "default:converted"  # the default model's float32 conversion, as batchrun provisions it
RESULTS = Path(__file__).resolve().parent / "results" / "plan_speed.json"
WORDS = ("delivery late parcel box damaged refund support agent friendly slow quick price value quality battery "
         "screen phone app crash update login password order invoice hotel room staff breakfast noisy clean").split()


def write_spec(path: Path, rows: int) -> Path:
    """Reviews of 20-200 words; every third row a classification, the rest short generations."""
    rng = random.Random(0)
    with open(path, "w") as out:
        for i in range(rows):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200)))
            row = {"id": f"doc-{i}", "prompt": f"Review: {text}\nSentiment?"}
            if i % 3 == 0:
                row["choices"] = ["positive", "negative", "mixed"]
            else:
                row["max_new_tokens"] = 32
            out.write(json.dumps(row) + "\n")
    return path


def timed(function):
    start = time.perf_counter()
    value = function()
    return time.perf_counter() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="as batchrun's --model takes it: a checkpoint, a "
                        "registry name or a hub id (default: the default model's float32 conversion)")
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()
    try:  # where batchrun finds it (a registry model provisioned once in the state directory)
        model = resolve_checkpoint(args.model)
    except BatchrunError as error:
        raise SystemExit(f"--model {args.model}: {error}") from None
    work = Path(tempfile.mkdtemp(prefix="batchrun-plan-speed-"))
    os.environ.setdefault("BATCHRUN_HOME", str(work / "home"))
    spec = write_spec(work / "reviews.jsonl", args.rows)
    command = [sys.executable, "-m", "batchrun", "plan", str(spec), "--model", str(model), "--json"]
    subprocess.run(command, check=True, capture_output=True)  # first run measures the machine once, then cached
    cli_runs = [timed(lambda: subprocess.run(command, check=True, capture_output=True))[0] for _ in range(3)]

    from batchrun.job.prepare import JobOptions, plan_report, prepare_model, read_job_spec
    from batchrun.spec.encode import encode_requests

    options = JobOptions(model=str(model))
    read_s, job_spec = timed(lambda: read_job_spec(spec, options))
    prepared = prepare_model(str(model), options)
    tokenize_s, encoded = timed(lambda: encode_requests(prepared.tokenizer, job_spec.requests, raw=False,
                                                        context_length=prepared.context_length))
    report_s, report = timed(lambda: plan_report(spec, [str(model)], options))
    result = {
        "rows": args.rows, "spec_bytes": spec.stat().st_size, "prompt_tokens_total": report["prompt_tokens_total"],
        "cli_wall_s_median": statistics.median(cli_runs), "cli_wall_s_runs": cli_runs,
        "read_spec_s": read_s, "tokenize_s": tokenize_s, "plan_report_s": report_s,
        "planned_passes": report["candidates"][0]["passes"], "planned_mode": report["candidates"][0]["mode"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"`batchrun plan` on {args.rows:,} rows ({result['spec_bytes'] / 1e6:.1f} MB, "
          f"{result['prompt_tokens_total']:,} prompt tokens), model {args.model} ({model.name})\n")
    print("| step | seconds |\n|---|---|")
    print(f"| `batchrun plan --json` (fresh process, median of 3) | {result['cli_wall_s_median']:.2f} |")
    print(f"| read + validate spec (in-process) | {read_s:.2f} |")
    print(f"| tokenize {len(encoded):,} prompts (in-process) | {tokenize_s:.2f} |")
    print(f"| whole plan report (in-process) | {report_s:.2f} |")


if __name__ == "__main__":
    main()
