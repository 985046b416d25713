"""Run the review-sentiment classification job through the Python API and summarise the answers."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import batchrun

SPEC = Path(__file__).resolve().parent.parent / "jobs" / "review-sentiment.jsonl"

# Labels for the first ten reviews, written with the spec, to show whether the model gets them right.
EXPECTED = {
    "rev-001": "positive", "rev-002": "negative", "rev-003": "positive", "rev-004": "negative",
    "rev-005": "positive", "rev-006": "negative", "rev-007": "negative", "rev-008": "positive",
    "rev-009": "negative", "rev-010": "positive",
}


def p_positive(probs) -> str:
    """P(positive) from a map column, which Arrow returns as (key, value) pairs; "-" where there is none (a failed
    row, or no calibration)."""
    found = dict(probs or [])
    return f"{found['positive']:.3f}" if "positive" in found else "-"


def main() -> None:
    # A pyarrow Table, one row per spec row; a second run answers from the database and computes nothing.
    rows = batchrun.submit(SPEC, quiet=False).to_pylist()

    # `answer` follows the calibrated probabilities where the job calibrates (the default, `auto`, does where the
    # labelled rows show a gain), so both are shown: the model's own P(positive) and the calibrated one.
    print(f"\n{'id':<9} {'answer':<9} {'P(positive)':>11} {'calibrated':>10}  expected")
    for row in rows[:10]:
        expected = EXPECTED[row["id"]]
        mark = "ok" if row["answer"] == expected else "MISS"
        print(f"{row['id']:<9} {row['answer'] or '(error)':<9} {p_positive(row['choice_probs']):>11} "
              f"{p_positive(row['calibrated_probs']):>10}  {expected} {mark}")

    right = sum(row["answer"] == EXPECTED[row["id"]] for row in rows[:10])
    print(f"\nfirst ten: {right}/10 match the expected label")
    counts = Counter(row["answer"] if row["error"] is None else "(error)" for row in rows)
    print("answers over all rows:", ", ".join(f"{answer}={count}" for answer, count in counts.most_common()))


if __name__ == "__main__":
    main()
