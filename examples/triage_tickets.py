"""Run the ticket-triage extraction job (short greedy generations) and print each ticket's answer."""
from __future__ import annotations

from pathlib import Path

import batchrun

SPEC = Path(__file__).resolve().parent.parent / "jobs" / "ticket-triage.jsonl"


def main() -> None:
    answers = batchrun.submit(SPEC, quiet=False)  # a pyarrow Table, one row per ticket, in spec order
    for row in answers.to_pylist():
        if row["error"] is not None:
            print(f"{row['id']:<5} ERROR {row['error']}")
        else:
            answer = row["answer"].strip()
            print(f"{row['id']:<5} {answer!r:<45} ({row['finish_reason']}, {row['output_tokens']} tokens)")


if __name__ == "__main__":
    main()
