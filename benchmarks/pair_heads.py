"""A pair row's two orders computing their shared head once (runtime/group_prefix.py), against the same orders
written out as plain choice rows (each computes the whole prompt), side by side on the default model.

    .venv/bin/python -m benchmarks.pair_heads [--pairs 24] [--document-words 180] [--repeats 3]   (~3 min on 2 cores)

Each pair: a synthetic document (seeded words) then two one-sentence answers, "which is better, A or B?"; the
document is the head the two orders share. Both jobs run resident in float32, each in a database of its own
(nothing reused), alternating, --repeats times; the medians of the jobs' computing seconds are compared, and the
probabilities checked equal within 1e-5. Prints a Markdown table and writes benchmarks/results/pair-heads-<machine
class>.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from batchrun.job import JobOptions, submit
from benchmarks import harness

WORDS = ("council river market school bridge harvest station winter budget museum festival railway library "
         "hospital election storm factory garden theatre harbour mayor teachers farmers visitors engineers "
         "approved delayed opened closed repaired expanded questioned welcomed announced reported").split()
TEMPLATE = "Document: {d}\n\nAnswer A: {a}\n\nAnswer B: {b}\n\nWhich answer summarises the document better, A or B?"
TOLERANCE = 1e-5


def documents(pairs: int, words: int, seed: int = 66) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(pairs)]


def write_specs(folder: Path, pairs: int, words: int) -> tuple[Path, Path]:
    """(pair rows, the same orders written out as plain rows)."""
    rows, written = [], []
    for number, document in enumerate(documents(pairs, words)):
        a, b = f"The {document.split()[0]} was {document.split()[1]}.", "Nothing happened."
        prompt = TEMPLATE.replace("{d}", document)
        rows.append({"id": f"p{number}", "prompt": prompt, "a": a, "b": b, "choices": [" A", " B"]})
        for order, (first, second) in (("ab", (a, b)), ("ba", (b, a))):
            written.append({"id": f"p{number}-{order}", "choices": [" A", " B"],
                            "prompt": prompt.replace("{a}", first).replace("{b}", second)})
    paths = folder / "pairs.jsonl", folder / "written.jsonl"
    for path, lines in zip(paths, (rows, written)):
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return paths


def run(spec: Path, folder: Path, name: str) -> tuple[float, list[dict]]:
    import pyarrow.parquet as pq

    out = folder / f"{name}.parquet"
    for stale in (out, folder / f"{name}.db"):
        stale.unlink(missing_ok=True)
    summary = submit(spec, options=JobOptions(streaming="never", dtype="float32", calibrate="none"), output=out,
                     db=folder / f"{name}.db")
    return summary.seconds, pq.read_table(out).to_pylist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--document-words", type=int, default=180)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        folder = Path(temp)
        pairs, written = write_specs(folder, args.pairs, args.document_words)
        seconds = {"pairs": [], "written": []}
        for _ in range(args.repeats):
            shared, pair_rows = run(pairs, folder, "pairs")
            apart, plain = run(written, folder, "written")
            seconds["pairs"].append(shared)
            seconds["written"].append(apart)
        worst = max(max(abs(row["p_a_first"] - dict(plain[2 * n]["choice_probs"])[" A"]),
                        abs(row["p_a_second"] - dict(plain[2 * n + 1]["choice_probs"])[" B"]))
                    for n, row in enumerate(pair_rows))
    if worst > TOLERANCE:
        raise SystemExit(f"the two jobs' probabilities differ by {worst:.2g}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    table = [{"job": "pair rows (head once a pair)", "median s": f"{medians['pairs']:.1f}",
              "runs": ", ".join(f"{s:.1f}" for s in seconds["pairs"])},
             {"job": "orders written out", "median s": f"{medians['written']:.1f}",
              "runs": ", ".join(f"{s:.1f}" for s in seconds["written"])}]
    harness.print_table(table, ["job", "median s", "runs"])
    print(f"\nspeedup {medians['written'] / medians['pairs']:.2f}x; largest probability difference {worst:.2g}")
    path = harness.save_results("pair-heads", {"pairs": args.pairs, "document_words": args.document_words,
                                               "seconds": seconds, "medians": medians, "largest_difference": worst,
                                               "machine": harness.machine_description()})
    print(f"written to {path}")


if __name__ == "__main__":
    main()
