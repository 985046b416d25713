"""Gold labels and calibration end to end on tiny models: labels judged and carried to the outputs, each method's
calibrated probabilities against an independent computation from the stored raw ones, a resumed calibrated job equal
to an uninterrupted one, content-free inputs run as a side job, refusals with their reasons, and `compare`."""
from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sklearn.metrics import cohen_kappa_score

from batchrun.job.compare import stratified_sample
from batchrun.output import read_parquet_results
from batchrun.quality import SEED, divide_prior, mean_probs
from batchrun.spec import Request
from tests.job.test_resume import assert_same_answers, job_status, run_killed, run_to_end, submit_args
from tests.support import invoke, write_jsonl

REVIEWS = ["great soup, friendly staff", "the parcel came late and broken", "fair price for what it is",
           "too loud to talk", "the app crashes when I open it", "lovely quiet room", "cold food, rude waiter",
           "works exactly as described", "stopped charging after a week", "the best coffee in town",
           "noisy fan and a weak battery", "arrived early and well packed"]
TEMPLATE = "Review: {text}\nIs it positive or negative?"


def labelled_rows() -> list[dict]:
    return [{"id": f"r{i}", "prompt": TEMPLATE.format(text=text), "choices": ["positive", "negative"],
             "label": "positive" if i % 2 == 0 else "negative"} for i, text in enumerate(REVIEWS)]


def corpus_spec(path: Path) -> Path:
    return write_jsonl(path, [{"doc": f"d{i}", "text": text, "gold": "positive" if i % 2 == 0 else "negative",
                               "source": f"site-{i % 3}"} for i, text in enumerate(REVIEWS)])


CORPUS_OPTIONS = ("--template", TEMPLATE, "--id-column", "doc", "--label-column", "gold",
                  "--choices", "positive,negative")


def test_labels_are_judged_and_carried_to_both_outputs(tmp_path, tiny_checkpoint):
    rows = labelled_rows()[:4] + [{"id": "g", "prompt": "Say hi.", "max_new_tokens": 3, "label": "hi",
                                   "metadata": {"batch": 7, "tags": ["a", "b"]}}]
    spec = write_jsonl(tmp_path / "labelled.jsonl", rows)
    model = tiny_checkpoint("llama")
    summary = run_to_end(submit_args(spec, model, tmp_path / "j.db", tmp_path / "a.parquet", "--calibrate", "none"))
    answers = {row["id"]: row for row in read_parquet_results(tmp_path / "a.parquet")}
    for row in rows:
        got = answers[row["id"]]
        assert got["label"] == row["label"]
        expected = got["answer"] == row["label"] if "choices" in row else \
            got["answer"].strip().casefold() == row["label"]
        assert got["correct"] is expected
    assert json.loads(answers["g"]["metadata"]) == {"batch": 7, "tags": ["a", "b"]}
    assert answers["r0"]["metadata"] is None and answers["r0"]["calibrated_probs"] is None
    choice = summary["quality"]["choice"]
    assert choice["labelled"] == 4 and choice["correct"] == sum(answers[f"r{i}"]["correct"] for i in range(4))
    assert summary["quality"]["generation"]["labelled"] == 1
    run_to_end(submit_args(spec, model, tmp_path / "j.db", tmp_path / "a.jsonl", "--calibrate", "none"))
    lines = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "a.jsonl").read_text().splitlines())}
    assert lines["g"]["metadata"] == {"batch": 7, "tags": ["a", "b"]} and lines["g"]["label"] == "hi"
    assert lines["r1"]["correct"] is answers["r1"]["correct"]


@pytest.mark.parametrize("method", ["batch", "labels"])
def test_a_resumed_calibrated_job_equals_an_uninterrupted_one(tmp_path, tiny_checkpoint, method):
    spec = write_jsonl(tmp_path / "reviews.jsonl", labelled_rows())
    model = tiny_checkpoint("llama")
    options = ("--batch-size", "4", "--calibrate", method)
    run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet", *options))
    args = submit_args(spec, model, tmp_path / "job.db", tmp_path / "job.parquet", *options)
    run_killed(args, "committed:1", tmp_path / "killed.log")
    assert 0 < job_status(tmp_path / "job.db")["rows_done"] < len(REVIEWS)
    run_to_end(args)
    assert_same_answers(tmp_path / "job.parquet", tmp_path / "ref.parquet")
    got, want = read_parquet_results(tmp_path / "job.parquet"), read_parquet_results(tmp_path / "ref.parquet")
    for row, expected in zip(got, want):
        assert row["calibrated_probs"] == pytest.approx(expected["calibrated_probs"], abs=1e-9)
        assert row["answer"] == max(row["calibrated_probs"], key=row["calibrated_probs"].get)


def test_batch_calibration_divides_the_mean_of_the_stored_probabilities(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "reviews.jsonl", labelled_rows())
    run_to_end(submit_args(spec, tiny_checkpoint("llama"), tmp_path / "j.db", tmp_path / "a.parquet",
                           "--calibrate", "batch"))
    rows = read_parquet_results(tmp_path / "a.parquet")
    prior = mean_probs([row["choice_probs"] for row in rows])
    for row in rows:
        assert row["calibrated_probs"] == pytest.approx(divide_prior(row["choice_probs"], prior), abs=1e-12)


def test_content_free_inputs_run_as_a_side_job_and_give_the_prior(tmp_path, tiny_checkpoint):
    spec = corpus_spec(tmp_path / "corpus.jsonl")
    db = tmp_path / "j.db"
    summary = run_to_end(submit_args(spec, tiny_checkpoint("llama"), db, tmp_path / "a.parquet", *CORPUS_OPTIONS,
                                     "--calibrate", "content-free", "--keep-columns", "source"))
    with sqlite3.connect(db) as conn:
        side_job = json.loads(conn.execute("select settings_json from jobs where id = ?",
                                           (summary["job_id"],)).fetchone()[0])["content_free_job"]
        side = [json.loads(probs) for (probs,) in conn.execute(
            "select choice_probs_json from rows where job_id = ? order by idx", (side_job,))]
        side_spec = conn.execute("select spec_path from jobs where id = ?", (side_job,)).fetchone()[0]
    prompts = [json.loads(line)["prompt"] for line in Path(side_spec).read_text().splitlines()]
    assert prompts == [TEMPLATE.format(text=value) for value in ("N/A", "", "[MASK]")]
    prior = mean_probs(side)
    for row in read_parquet_results(tmp_path / "a.parquet"):
        assert row["calibrated_probs"] == pytest.approx(divide_prior(row["choice_probs"], prior), abs=1e-12)
        assert row["source"].startswith("site-") and row["label"] in ("positive", "negative")


def test_calibrations_that_cannot_apply_are_refused_with_the_reason(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    prompts = write_jsonl(tmp_path / "reviews.jsonl", labelled_rows())
    refused = invoke("submit", prompts, "--model", model, "--db", tmp_path / "j.db", "--calibrate", "content-free")
    assert refused.exit_code == 1 and "needs corpus mode (--template)" in refused.stderr
    unlabelled = write_jsonl(tmp_path / "plain.jsonl", [{key: value for key, value in row.items() if key != "label"}
                                                        for row in labelled_rows()])
    refused = invoke("submit", unlabelled, "--model", model, "--db", tmp_path / "j.db", "--calibrate", "labels")
    assert refused.exit_code == 1 and "no choice row of this job has a label" in refused.stderr
    generation = write_jsonl(tmp_path / "gen.jsonl", [{"id": 1, "prompt": "Say hi.", "max_new_tokens": 2}])
    refused = invoke("submit", generation, "--model", model, "--db", tmp_path / "j.db", "--calibrate", "batch")
    assert refused.exit_code == 1 and "calibration applies to choice rows" in refused.stderr


def test_labels_calibration_with_one_class_is_refused_before_any_row_runs(tmp_path, tiny_checkpoint):
    one_class = write_jsonl(tmp_path / "yes.jsonl", [{**row, "label": "positive"} for row in labelled_rows()[:10]])
    db = tmp_path / "j.db"
    refused = invoke("submit", one_class, "--model", tiny_checkpoint("llama"), "--db", db, "--calibrate", "labels",
                     "--json")
    assert refused.exit_code == 1, refused.output
    found = json.loads(refused.stdout)
    assert found["kind"] == "SettingRefused" and found["error"] == (
        "calibrate labels: every labelled choice row of this job is labelled 'positive'; a fit on one class answers "
        "it everywhere, and accuracy would then say nothing about the choices. Label rows of two classes or more, "
        "or use --calibrate auto (the model's own answers)")
    assert f"Error: {found['error']}" in refused.stderr
    assert invoke("status", "--db", db).exit_code == 1  # no job was recorded, no row computed


def test_labels_calibration_leaves_a_one_class_choice_set_raw_and_says_so(tmp_path, tiny_checkpoint, caplog):
    colours = [{"id": f"c{i}", "prompt": f"Sky {i}: red or blue?", "choices": ["red", "blue"], "label": "blue"}
               for i in range(4)]
    spec = write_jsonl(tmp_path / "mixed.jsonl", labelled_rows() + colours)
    summary = run_to_end(submit_args(spec, tiny_checkpoint("llama"), tmp_path / "j.db", tmp_path / "a.parquet",
                                     "--calibrate", "labels"))
    note = ("labels calibration: every one of the 4 labelled row(s) offering ['red', 'blue'] is labelled 'blue', so a "
            "fit on them would answer 'blue' everywhere and their accuracy would say nothing about the choices: those "
            "rows are left uncalibrated (the model's own answers stand; label rows of two classes)")
    assert note in summary["notes"]
    assert note in [record.getMessage() for record in caplog.records if record.name == "batchrun"]
    answers = {row["id"]: row for row in read_parquet_results(tmp_path / "a.parquet")}
    assert all(answers[row["id"]]["calibrated_probs"] is None for row in colours)
    assert all(answers[row["id"]]["calibrated_probs"] is not None for row in labelled_rows())


def test_auto_without_labels_is_the_uncalibrated_job(tmp_path, tiny_checkpoint):
    unlabelled = write_jsonl(tmp_path / "plain.jsonl", [{key: value for key, value in row.items() if key != "label"}
                                                        for row in labelled_rows()])
    model = tiny_checkpoint("llama")
    auto = run_to_end(submit_args(unlabelled, model, tmp_path / "j.db", tmp_path / "a.parquet"))
    none = run_to_end(submit_args(unlabelled, model, tmp_path / "j.db", tmp_path / "b.parquet", "--calibrate", "none"))
    assert auto["job_id"] == none["job_id"] and none["rows_computed_now"] == 0 and auto["quality"] is None


def test_summary_and_status_show_accuracy_with_its_interval(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "reviews.jsonl", labelled_rows())
    db = tmp_path / "j.db"
    result = invoke("submit", spec, "--model", tiny_checkpoint("llama"), "--db", db, "-q", "--calibrate", "none")
    assert result.exit_code == 0, result.output
    assert "accuracy " in result.stdout and "(95% CI " in result.stdout and "per class" in result.stdout
    status = invoke("status", "--db", db)
    for figure in ("accuracy", "agreement (95% CI): kappa "):
        shown = next(line for line in status.stdout.splitlines() if figure in line)
        assert shown.strip() == next(line for line in result.stdout.splitlines() if figure in line).strip()


def test_agreement_and_corrected_shares_reach_the_summary_and_status_from_the_same_answers(tmp_path, tiny_checkpoint):
    unlabelled = [{**row, "id": f"u{i}"} for i, row in enumerate(labelled_rows()[:8])]
    for row in unlabelled:
        del row["label"]
    spec = write_jsonl(tmp_path / "sample.jsonl", labelled_rows() + unlabelled)
    summary = run_to_end(submit_args(spec, tiny_checkpoint("llama"), tmp_path / "j.db", tmp_path / "a.parquet",
                                     "--calibrate", "none"))
    answers = read_parquet_results(tmp_path / "a.parquet")
    labelled = [row for row in answers if row["label"] is not None]
    found = summary["quality"]["agreement"]
    assert found["rows"] == len(labelled) == 12 and found["seed"] == SEED
    assert found["kappa"]["value"] == pytest.approx(
        cohen_kappa_score([row["label"] for row in labelled], [row["answer"] for row in labelled]), abs=1e-9)
    assert found["scale"] is found["spearman"] is None  # the choices are words: no order, no score
    assert found["disagreements"] == sum(not row["correct"] for row in labelled)
    assert [share["verdict"] for share in found["shares"]] == ["positive", "negative"]
    for share in found["shares"]:
        assert (share["rows"], share["labelled"]) == (20, 12)
        assert share["raw"] == sum(row["answer"] == share["verdict"] for row in answers) / 20
    assert job_status(tmp_path / "j.db")["quality"]["agreement"] == found  # seeded: the same intervals again


def test_compare_judges_each_model_and_a_full_submit_reuses_its_rows(tmp_path, tiny_checkpoint):
    spec = corpus_spec(tmp_path / "corpus.jsonl")
    db = tmp_path / "j.db"
    llama, qwen = tiny_checkpoint("llama"), tiny_checkpoint("qwen2")
    result = invoke("compare", spec, "--model", llama, "--model", qwen, "--sample", "6", "--db", db, "--json",
                    *CORPUS_OPTIONS)
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["sample_rows"] == 6 and found["labelled_rows"] == len(REVIEWS)
    assert [model["model"] for model in found["models"]] == [str(llama), str(qwen)]
    for model in found["models"]:
        assert model["raw"]["labelled"] == 6 and model["eta_seconds"] > 0 and model["passes"] >= 1
    assert found["verdict"].endswith(".") and ("points more accurate" in found["verdict"]
                                                or "as accurate" in found["verdict"])
    full = run_to_end(submit_args(spec, qwen, db, tmp_path / "a.parquet", *CORPUS_OPTIONS))
    assert full["rows_computed_now"] == len(REVIEWS) - 6
    sampled = pq.read_table(tmp_path / "a.parquet").to_pylist()
    assert len(sampled) == len(REVIEWS) and {row["label"] for row in sampled} == {"positive", "negative"}


def sample_rows(labels: list[str]) -> list[Request]:
    return [Request(index=i, id=f"r{i}", location=f"rev.jsonl:{i + 1}", messages=(("user", f"Review {i}"),),
                    prompt=f"Review {i}", choices=("positive", "negative", "mixed"), max_new_tokens=0, stop=(),
                    label=label) for i, label in enumerate(labels)]


@pytest.mark.parametrize("labels", [
    ["positive", "negative"] * 10,  # even classes: each share lands on a half
    ["positive"] * 13 + ["negative"] * 5 + ["mixed"] * 2,
    ["positive"] * 18 + ["negative"] + ["mixed"],  # rare classes the sample still shows
], ids=["even", "uneven", "rare"])
def test_compare_samples_exactly_the_rows_asked_for(labels):
    rows = sample_rows(labels)
    for size in range(1, len(rows) + 3):
        chosen = stratified_sample(rows, size)
        assert len(chosen) == min(size, len(rows)), size
        assert [row.index for row in chosen] == sorted(row.index for row in chosen)  # spec order
        if size >= len(set(labels)):
            assert {row.label for row in chosen} == set(labels), size
    shares = Counter(row.label for row in stratified_sample(rows, 10))
    assert all(abs(shares[label] - 10 * count / len(rows)) <= 1 for label, count in Counter(labels).items())
