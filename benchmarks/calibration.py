"""Which calibration should be the default? Raw answers against each method, on labelled corpora and two models.

For every corpus in benchmarks/corpora/ and every registry model, the script runs the corpus through batchrun
once per method (the first run computes the answers; the others take them from the same database, so every method
sees the same raw probabilities). As a user would, the job sees the labels of one row in three (stratified by
label); every method is judged on the other two thirds, whose labels no method saw: accuracy and macro-F1 (the
mean over classes of F1, which shows what accuracy hides on the imbalanced corpus).

    .venv/bin/python -m benchmarks.calibration                      # both models, every corpus (~6 min on 2 cores)
    .venv/bin/python -m benchmarks.calibration --models smollm2-135m --corpora reviews,topics

Results: a Markdown table on stdout and benchmarks/results/calibration-<machine class>.{json,md}; the table in
docs/calibration.md is this output.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import batchrun
from batchrun.quality import label_metrics, macro_f1
from benchmarks import harness

CORPORA_DIR = harness.REPO_ROOT / "benchmarks" / "corpora"
CORPORA = {  # name -> (template, choices): benchmarks/corpora/README.md
    "reviews": ("Review: {text}\nIs this review positive or negative? Answer with one word.", ("positive", "negative")),
    "topics": ("Headline: {text}\nWhich topic is this: sport, business, science or politics? Answer with one word.",
               ("sport", "business", "science", "politics")),
    "hazard-reports": ("Message: {text}\nDoes this message report a safety hazard? Answer yes or no.", ("yes", "no")),
    "ratings": ("Comment: {text}\nHow many stars (1-5) does this customer give? Answer with one digit.",
                ("1", "2", "3", "4", "5")),
}
METHODS = ("none", "batch", "content-free", "labels", "auto")
LABELLED_SHARE = 3  # the job sees the label of one row in this many
MODELS = ("smollm2-135m", "gemma3-270m")


def partly_labelled(corpus: str, scratch: Path) -> tuple[Path, dict]:
    """The corpus with the labels of one row in LABELLED_SHARE per class kept (the rest unlabelled), and the gold
    labels of the rows the job does not see."""
    rows = [json.loads(line) for line in (CORPORA_DIR / f"{corpus}.jsonl").read_text().splitlines() if line.strip()]
    seen_per_label: dict[str, int] = {}
    unseen = {}
    for row in rows:
        count = seen_per_label.get(row["label"], 0)
        seen_per_label[row["label"]] = count + 1
        if count % LABELLED_SHARE:
            unseen[row["id"]] = row.pop("label")
    path = scratch / f"{corpus}.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path, unseen


def score_method(corpus: str, model: str, method: str, scratch: Path) -> dict:
    template, choices = CORPORA[corpus]
    spec, unseen = partly_labelled(corpus, scratch)
    options = batchrun.JobOptions(model=model, template=template, id_column="id", label_column="label",
                                  choices=choices, calibrate=method)
    started = time.monotonic()
    table = batchrun.submit(spec, options=options, db=scratch / "calibration.db")
    judged = [row for row in table.to_pylist() if row["id"] in unseen and row["error"] is None]
    metrics = label_metrics([unseen[row["id"]] for row in judged], [row["answer"] for row in judged])
    return {"corpus": corpus, "model": model, "method": method, "labelled": len(table) - len(unseen),
            "judged": metrics.labelled, "accuracy": round(metrics.rate, 4), "macro_f1": round(macro_f1(metrics), 4),
            "interval": [round(bound, 4) for bound in metrics.interval],
            "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--corpora", default=",".join(CORPORA))
    args = parser.parse_args()
    found = []
    with harness.exclusive_machine(), tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            for corpus in args.corpora.split(","):
                for method in METHODS:
                    found.append(score_method(corpus, model, method, Path(scratch)))
                    print(found[-1], flush=True)
    columns = {"corpus": "corpus", "model": "model", "method": "method", "labelled": "labels seen",
               "judged": "rows judged", "accuracy": "accuracy", "macro_f1": "macro-F1"}
    table = harness.format_table(found, columns)
    print(table)
    path = harness.save_results("calibration", {"rows": found, "machine": harness.machine_description()})
    path.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
