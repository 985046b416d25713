"""Run the ticket-triage extraction job (short greedy generations) and print each ticket's answer."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from batchrun import JobOptions, submit

SPEC = Path(__file__).resolve().parent.parent / "jobs" / "ticket-triage.jsonl"
# Outside the repository so the example leaves the working tree clean; force=True lets it run repeatedly.
OUTPUT = Path(tempfile.gettempdir()) / "batchrun-examples" / "ticket-triage.answers.parquet"


def main() -> None:
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    summary = submit(SPEC, options=JobOptions(), output=OUTPUT, force=True, quiet=False)
    print(f"job {summary.job_id[:12]}: {summary.rows_done} rows done, {summary.rows_errored} errored "
          f"in {summary.seconds:.1f} s -> {summary.output}\n")

    for row in pq.read_table(summary.output).to_pylist():
        if row["error"] is not None:
            print(f"{row['id']:<5} ERROR {row['error']}")
        else:
            print(f"{row['id']:<5} {row['answer'].strip()!r:<45} ({row['finish_reason']}, {row['output_tokens']} tokens)")


if __name__ == "__main__":
    main()
