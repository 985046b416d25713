"""A judging task nobody here wrote: the Lee corpus of news documents, rated for similarity by people.

The Lee corpus (Lee, Pincombe & Welsh 2005) is 50 short news documents and the mean human similarity rating of
each of their 1,225 pairs (1-5 scale divided by 5). It ships inside the gensim wheel (gensim/test/test_data/
lee.cor and similarities0-1.txt); the script fetches that wheel with pip at run time into a cache, reads the two
files from it with zipfile and records the wheel's licence. Nothing of the corpus is written to the repository:
the results hold document ids and figures only.

Two jobs per registry model, each run with `batchrun submit --json`:

- graded rows: two documents, "how similar, 1-5?", choices 1..5, label = the human rating rounded (a seeded
  sample, stratified so the rarer grades appear); run with `--calibrate none` and with the default (auto);
- pair rows: documents B and C in the slots {a} and {b}, "which is closer in topic to document A?", for seeded
  triples whose human ratings sim(A,B) and sim(A,C) differ by at least one point on the 1-5 scale.

Then `batchrun compare <graded spec> -m smollm2-135m -m gemma3-270m --panel mean --json` for the panel against
each model alone. From the JSON summaries: kappa, weighted kappa, Spearman (95% bootstrap intervals); pair
consistency, first-slot preference and verdict accuracy. From the Parquet output: the single-order accuracy (order
ab's own pick, p_a_first > 0.5, against the label) beside the both-order verdict's.

    .venv/bin/python -m benchmarks.lee_judging                          # 150 graded rows, 100 pair rows
    .venv/bin/python -m benchmarks.lee_judging --graded 30 --pairs 20   # a quick look

Results: a Markdown table on stdout and benchmarks/results/lee-judging-<machine class>.{json,md}; the tables in
docs/judging.md ("The Lee corpus") are this output.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pyarrow.parquet as pq

from batchrun.quality import cohen_kappa, spearman, wilson_interval
from benchmarks import harness

GENSIM = "gensim==4.4.0"
DATA = "gensim/test/test_data/"
MODELS = ("smollm2-135m", "gemma3-270m")
GRADES = ("1", "2", "3", "4", "5")
GRADED_PROMPT = ("Document 1: {first}\n\nDocument 2: {second}\n\nHow similar in topic are these two news documents, "
                 "from 1 (unrelated) to 5 (the same story)? Answer with one digit.")
PAIR_PROMPT = ("Document A: {anchor}\n\nDocument 1: {{a}}\n\nDocument 2: {{b}}\n\n"
               "Which of documents 1 and 2 is closer in topic to document A? Answer 1 or 2.")


# ---------------------------------------------------------------------------------------------------------------
# The data

def fetch_wheel(cache: Path) -> Path:
    """The gensim wheel in cache, downloaded with pip the first time (no dependencies, no install)."""
    found = sorted(cache.glob("gensim-4.4.0-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", GENSIM, "--no-deps", "--only-binary", ":all:",
                        "-d", str(cache)], check=True)
        found = sorted(cache.glob("gensim-4.4.0-*.whl"))
    return found[0]


def read_lee(wheel: Path) -> tuple[list[str], list[list[float]]]:
    """The 50 documents (one a line, Latin-1: the file has a pound sign) and the 50 x 50 similarity matrix
    (tab-separated, upper triangle filled, 1 on the diagonal, 0 below it)."""
    with zipfile.ZipFile(wheel) as archive:
        documents = archive.read(DATA + "lee.cor").decode("latin-1").splitlines()
        matrix_text = archive.read(DATA + "similarities0-1.txt").decode("ascii")
    matrix = [[float(value) for value in line.split()] for line in matrix_text.splitlines() if line.strip()]
    if len(documents) != 50 or len(matrix) != 50 or any(len(row) != 50 for row in matrix):
        raise SystemExit(f"unexpected Lee data layout: {len(documents)} documents, {len(matrix)} matrix rows")
    return documents, matrix


def wheel_licence(wheel: Path) -> dict:
    """What the wheel says about its licence: METADATA's License field, the licence file's title, and what the
    Lee test module says of the data's origin. The data files carry no licence of their own."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        licence_file = next(n for n in names if "/licenses/" in n and not n.endswith("/"))
        licence_title = archive.read(licence_file).decode().strip().splitlines()[0].strip()
        test_module = archive.read("gensim/test/test_lee.py").decode()
    field = next((line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("License:")), None)
    origin = [line.strip("# ").strip() for line in test_module.splitlines() if "Michael D. Lee" in line or
              "Lee, M., Pincombe" in line]
    data_files = [n for n in names if n.startswith(DATA + "lee.cor") or n.startswith(DATA + "similarities0-1")]
    own_licence = [n for n in names if n.startswith(DATA) and "licen" in n.lower()]
    return {"wheel": wheel.name, "license_field": field, "license_file": licence_file, "license_title": licence_title,
            "data_files": data_files, "data_licence_files": own_licence, "data_origin": origin}


def grade(similarity: float) -> str:
    """The 0-1 mean rating back on the 1-5 scale, rounded to a whole grade."""
    return str(min(5, max(1, round(similarity * 5))))


# ---------------------------------------------------------------------------------------------------------------
# The rows

def graded_rows(documents: list[str], matrix: list[list[float]], count: int, rng: random.Random) -> list[dict]:
    """count document pairs, stratified by rounded grade: an equal share per grade where a grade has that many
    (the rare grades then appear in full), the rest from the common grades at random."""
    by_grade: dict[str, list[tuple[int, int]]] = {g: [] for g in GRADES}
    for i, j in itertools.combinations(range(len(documents)), 2):
        by_grade[grade(matrix[i][j])].append((i, j))
    chosen: list[tuple[int, int]] = []
    share = count // len(GRADES)
    for pairs in by_grade.values():
        chosen += rng.sample(pairs, min(share, len(pairs)))
    rest = [pair for pairs in by_grade.values() for pair in pairs if pair not in set(chosen)]
    chosen += rng.sample(rest, count - len(chosen))
    rng.shuffle(chosen)
    return [{"id": f"g{i:02d}-{j:02d}", "prompt": GRADED_PROMPT.format(first=documents[i], second=documents[j]),
             "choices": list(GRADES), "label": grade(matrix[i][j]), "metadata": {"similarity": round(matrix[i][j] * 5, 3)}}
            for i, j in chosen]


def similarity(matrix: list[list[float]], i: int, j: int) -> float:
    """The 1-5 human rating of documents i and j (the matrix holds the upper triangle)."""
    return 5 * matrix[min(i, j)][max(i, j)]


def pair_rows(documents: list[str], matrix: list[list[float]], count: int,
              rng: random.Random) -> tuple[list[dict], int]:
    """count triples (A, B, C) whose ratings sim(A,B) and sim(A,C) differ by at least one point; the closer document
    goes to slot a or b at random, so the label is a or b alike. Also returns how many triples qualified."""
    n = len(documents)
    triples = [(a, b, c) for a in range(n) for b, c in itertools.combinations([d for d in range(n) if d != a], 2)
               if abs(similarity(matrix, a, b) - similarity(matrix, a, c)) >= 1]
    rows = []
    for anchor, b, c in rng.sample(triples, count):
        closer, farther = (b, c) if similarity(matrix, anchor, b) > similarity(matrix, anchor, c) else (c, b)
        first, second, label = (closer, farther, "a") if rng.random() < 0.5 else (farther, closer, "b")
        rows.append({"id": f"p{anchor:02d}-{first:02d}-{second:02d}", "prompt": PAIR_PROMPT.format(anchor=documents[anchor]),
                     "a": documents[first], "b": documents[second], "choices": ["1", "2"], "label": label,
                     "metadata": {"gap": round(abs(similarity(matrix, anchor, b) - similarity(matrix, anchor, c)), 3)}})
    return rows, len(triples)


def write_spec(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# The runs

def batchrun(*arguments: str, env: dict) -> dict:
    """Run a batchrun command with --json and return its JSON (the last line that parses, progress aside)."""
    command = [sys.executable, "-m", "batchrun", *arguments, "--json", "-q"]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    summary["_seconds"] = round(time.monotonic() - started, 1)
    return summary


def interval_figure(agreement: dict, name: str) -> dict | None:
    figure = (agreement or {}).get(name)
    if figure is None:
        return None
    if isinstance(figure, dict):
        return {"value": figure.get("value"), "interval": figure.get("interval")}
    return {"value": figure, "interval": None}


def agreement_figures(quality: dict) -> dict:
    agreement = quality.get("agreement") or {}
    figures = {name: interval_figure(agreement, name) for name in ("kappa", "weighted_kappa", "spearman")}
    accuracy = quality.get("choice") or {}
    figures["accuracy"] = {"value": accuracy.get("rate"), "interval": accuracy.get("interval")}
    figures["rows"] = accuracy.get("labelled")
    return figures


def run_graded(spec: Path, model: str, calibrate: str, scratch: Path, env: dict) -> dict:
    output = scratch / f"graded-{model}-{calibrate}.parquet"
    summary = batchrun("submit", str(spec), "-m", model, "--calibrate", calibrate, "-o", str(output), "--force",
                       "--db", str(scratch / "lee.db"), env=env)
    answers = pq.read_table(output).to_pylist()
    counts = {g: sum(1 for row in answers if row["answer"] == g) for g in GRADES}
    return {"model": model, "calibrate": calibrate, "seconds": summary["_seconds"],
            "rows_computed_now": summary.get("rows_computed_now"), "answer_counts": counts,
            **agreement_figures(summary.get("quality") or {}), "summary_quality": summary.get("quality")}


def share(count: int, total: int) -> dict:
    return {"count": count, "of": total, "rate": round(count / total, 4) if total else None,
            "interval": [round(bound, 4) for bound in wilson_interval(count, total)] if total else None}


def run_pairs(spec: Path, model: str, calibrate: str, scratch: Path, env: dict) -> dict:
    output = scratch / f"pairs-{model}-{calibrate}.parquet"
    summary = batchrun("submit", str(spec), "-m", model, "--calibrate", calibrate, "-o", str(output), "--force",
                       "--db", str(scratch / "lee.db"), env=env)
    answered = [row for row in pq.read_table(output).to_pylist() if row["error"] is None and row["p_a_first"] is not None]
    single = sum(1 for row in answered if (row["p_a_first"] > 0.5) == (row["label"] == "a"))
    second = sum(1 for row in answered if (row["p_a_second"] > 0.5) == (row["label"] == "a"))
    averaged = sum(1 for row in answered if (row["p_a"] > 0.5) == (row["label"] == "a"))
    both = sum(1 for row in answered if row["correct"])
    pairs = (summary.get("quality") or {}).get("pairs") or {}
    return {"model": model, "calibrate": calibrate, "seconds": summary["_seconds"],
            "rows_computed_now": summary.get("rows_computed_now"), "pairs": len(answered),
            "single_order_accuracy": share(single, len(answered)),
            "order_ba_accuracy": share(second, len(answered)),
            "averaged_p_a_accuracy": share(averaged, len(answered)),
            "both_order_accuracy": share(both, len(answered)),
            "ties": sum(1 for row in answered if row["answer"] == "tie"),
            "summary_pairs": pairs}


def run_panel(spec: Path, models: list[str], calibrate: str, rows: int, scratch: Path, env: dict) -> dict:
    arguments = ["compare", str(spec), "--panel", "mean", "--calibrate", calibrate, "--sample", str(rows),
                 "-o", str(scratch / "graded.panel.parquet"), "--force", "--report", str(scratch / "compare.html"),
                 "--db", str(scratch / "lee.db")]
    for model in models:
        arguments += ["-m", model]
    comparison = batchrun(*arguments, env=env)
    return {"calibrate": calibrate, "seconds": comparison["_seconds"], "comparison": comparison,
            "panel_agreement": panel_agreement(scratch / "graded.panel.parquet", models)}


def panel_agreement(path: Path, models: list[str]) -> dict:
    """Weighted kappa and Spearman of the panel and of each judge, from the panel's answers file (which holds each
    judge's answer and probabilities; compare reports accuracy and kappa only), by the functions and bootstrap the
    job summaries use."""
    rows = [row for row in pq.read_table(path).to_pylist() if row["label"] is not None and row["answer"] is not None]
    labels = [row["label"] for row in rows]
    judged = {"panel": ([row["answer"] for row in rows], [row["score"] for row in rows])}
    for k, model in enumerate(models):
        judged[model] = ([row["judge_answers"][k] for row in rows],
                         [sum(p * float(choice) for choice, p in row["judge_probs"][k]) for row in rows])
    found = {}
    for name, (answers, scores) in judged.items():
        weighted = cohen_kappa(labels, answers, scale=GRADES, weighted=True)
        rho = spearman(scores, [float(label) for label in labels])
        found[name] = {"rows": len(rows), "weighted_kappa": weighted.to_json() if weighted else None,
                       "spearman": rho.to_json() if rho else None}
    return found


# ---------------------------------------------------------------------------------------------------------------
# The report

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graded", type=int, default=150, help="graded rows (document pairs), stratified by grade")
    parser.add_argument("--pairs", type=int, default=100, help="pair rows (triples A, B, C)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seed", type=int, default=66)
    parser.add_argument("--skip-auto", action="store_true", help="graded rows with --calibrate none only")
    parser.add_argument("--cache", type=Path, default=harness.bench_cache_dir() / "gensim-wheel")
    parser.add_argument("--keep", type=Path, help="keep the specs, outputs and database here")
    args = parser.parse_args()
    models = args.models.split(",")
    wheel = fetch_wheel(args.cache)
    documents, matrix = read_lee(wheel)
    rng = random.Random(args.seed)
    graded = graded_rows(documents, matrix, args.graded, rng)
    pairs, eligible = pair_rows(documents, matrix, args.pairs, rng)
    env = dict(os.environ, PYTHONPATH=str(harness.REPO_ROOT))
    with harness.exclusive_machine(), tempfile.TemporaryDirectory() as temporary:
        scratch = args.keep or Path(temporary)
        scratch.mkdir(parents=True, exist_ok=True)
        graded_spec = write_spec(scratch / "graded.jsonl", graded)
        pair_spec = write_spec(scratch / "pairs.jsonl", pairs)
        methods = ["none"] if args.skip_auto else ["none", "auto"]
        graded_results = [run_graded(graded_spec, model, method, scratch, env) for model in models for method in methods]
        for result in graded_results:
            print({k: v for k, v in result.items() if k != "summary_quality"}, flush=True)
        pair_results = [run_pairs(pair_spec, model, "none", scratch, env) for model in models]
        for result in pair_results:
            print({k: v for k, v in result.items() if k != "summary_pairs"}, flush=True)
        panel = run_panel(graded_spec, models, "none", len(graded), scratch, env)
    record = {"command": " ".join(sys.argv), "seed": args.seed, "models": models, "licence": wheel_licence(wheel),
              "sample": sample_description(graded, pairs, eligible),
              "graded": graded_results, "pairs": pair_results, "panel": panel}
    path = harness.save_results("lee-judging", record)
    text = tables(record)
    print(text)
    path.with_suffix(".md").write_text(text + "\n")
    print(path)


def sample_description(graded: list[dict], pairs: list[dict], eligible: int) -> dict:
    return {"graded_rows": len(graded), "graded_labels": {g: sum(1 for r in graded if r["label"] == g) for g in GRADES},
            "graded_ids": [row["id"] for row in graded], "pair_rows": len(pairs), "eligible_triples": eligible,
            "pair_labels": {s: sum(1 for r in pairs if r["label"] == s) for s in ("a", "b")},
            "pair_ids": [row["id"] for row in pairs]}


def estimate(figure: dict | None) -> str:
    """0.12 (0.03 to 0.2) from a {value, interval} figure, or a dash."""
    if not figure or figure.get("value") is None:
        return "-"
    low_high = figure.get("interval")
    return f"{figure['value']:.2f}" + (f" ({low_high[0]:.2f} to {low_high[1]:.2f})" if low_high else "")


def rate(figure: dict | None) -> str:
    """7/10 = 0.70 (0.40 to 0.89) from a {count|correct, of|labelled, rate, interval} share."""
    if not figure or figure.get("rate") is None:
        return "-"
    count, total = figure.get("count", figure.get("correct")), figure.get("of", figure.get("labelled"))
    return f"{count}/{total} = " + estimate({"value": figure["rate"], "interval": figure.get("interval")})


def tables(record: dict) -> str:
    graded = [{"model": r["model"], "calibrate": r["calibrate"], "rows": r["rows"], "accuracy": estimate(r["accuracy"]),
               "kappa": estimate(r["kappa"]), "weighted_kappa": estimate(r["weighted_kappa"]),
               "spearman": estimate(r["spearman"])} for r in record["graded"]]
    pairs = [{"model": r["model"], "pairs": r["pairs"], "consistency": rate(r["summary_pairs"].get("consistency")),
              "first_slot": rate(r["summary_pairs"].get("first_slot")), "single": rate(r["single_order_accuracy"]),
              "averaged": rate(r["averaged_p_a_accuracy"]), "both": rate(r["both_order_accuracy"]), "ties": r["ties"]}
             for r in record["pairs"]]
    figures = record["panel"]["comparison"]["panel"]
    extra = record["panel"]["panel_agreement"]
    judges = [(model, judge) for model, judge in zip(record["models"], figures["judges"])] + [("panel", figures["panel"])]
    panel = [{"judge": f"panel ({figures['method']})" if name == "panel" else name,
              "accuracy": rate(found["accuracy"]), "kappa": estimate(found["kappa"]),
              "weighted_kappa": estimate(extra[name]["weighted_kappa"]), "spearman": estimate(extra[name]["spearman"])}
             for name, found in judges]
    return "\n\n".join([
        harness.format_table(graded, {"model": "model", "calibrate": "calibration", "rows": "rows",
                                      "accuracy": "accuracy", "kappa": "kappa", "weighted_kappa": "weighted kappa",
                                      "spearman": "Spearman"}),
        harness.format_table(pairs, {"model": "model", "pairs": "pair rows", "consistency": "consistency",
                                     "first_slot": "first-slot preference", "single": "single-order accuracy (ab)",
                                     "averaged": "accuracy of p_a (both orders averaged)",
                                     "both": "both-order verdict accuracy", "ties": "ties"}),
        harness.format_table(panel, {"judge": "judge", "accuracy": "accuracy", "kappa": "kappa",
                                     "weighted_kappa": "weighted kappa", "spearman": "Spearman"})])


if __name__ == "__main__":
    main()
