"""`compare --panel` end to end on tiny models: the panel's answers file against the judges' own answers combined
independently, its figures against the formulas, a panel of one equal to its model, and the refusals."""
from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction

import pyarrow.parquet as pq
import pytest
from sklearn.metrics import cohen_kappa_score

from batchrun.output import PANEL_COLUMNS, answers_table, read_parquet_results
from batchrun.store import Store
from tests.job.test_labels_and_calibration import CORPUS_OPTIONS, REVIEWS, corpus_spec
from tests.support import invoke, write_jsonl


def job_rows(db, job_id: str) -> dict:
    """A job's answers as its Parquet file has them, by id, with the probabilities its answer comes from."""
    store = Store(db)
    try:
        rows = answers_table(store, job_id).to_pylist()
    finally:
        store.close()
    return {row["id"]: {**row, "probs": dict(row["calibrated_probs"] or row["choice_probs"])} for row in rows}


def run_compare(spec, db, *args):
    result = invoke("compare", spec, "--sample", "8", "--db", db, "--json", "-q", *CORPUS_OPTIONS, *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def fleiss(ratings: list[list[str]]) -> float:
    judges, categories = len(ratings[0]), sorted({answer for row in ratings for answer in row})
    counts = [[row.count(category) for category in categories] for row in ratings]
    observed = sum(Fraction(sum(n * n for n in row) - judges, judges * (judges - 1)) for row in counts) / len(counts)
    chance = sum(Fraction(sum(row[j] for row in counts), len(counts) * judges) ** 2 for j in range(len(categories)))
    return float((observed - chance) / (1 - chance))


def test_a_panel_of_two_models_writes_the_combined_answers_and_judges_them(tmp_path, tiny_checkpoint):
    spec, db = corpus_spec(tmp_path / "corpus.jsonl"), tmp_path / "j.db"
    llama, qwen = tiny_checkpoint("llama"), tiny_checkpoint("qwen2")
    # batch calibration: the judges' calibrated probabilities are what the panel combines, and they differ by row
    found = run_compare(spec, db, "-m", llama, "-m", qwen, "--panel", "mean", "--calibrate", "batch")
    panel = found["panel"]
    assert found["sample_rows"] == 8 and found["labelled_rows"] == len(REVIEWS)
    assert panel["output"] == str(tmp_path / "corpus.panel.parquet") and panel["method"] == "mean"
    judges = [job_rows(db, model["job_id"]) for model in found["models"]]
    written = read_parquet_results(panel["output"])
    assert len(written) == panel["rows"] == panel["labelled"] == 8
    assert set(PANEL_COLUMNS) <= set(pq.read_table(panel["output"]).column_names)
    for row in written:
        own = [judge[row["id"]] for judge in judges]
        assert all(judge["calibrated_probs"] is not None for judge in own)
        mean = {choice: (own[0]["probs"][choice] + own[1]["probs"][choice]) / 2 for choice in own[0]["probs"]}
        assert row["choice_probs"] == pytest.approx(mean, abs=1e-12)
        assert row["answer"] == max(mean, key=mean.get) and row["correct"] is (row["answer"] == row["label"])
        assert row["judge_answers"] == [judge["answer"] for judge in own]
        assert [dict(probs) for probs in row["judge_probs"]] == [judge["probs"] for judge in own]
    ratings = [row["judge_answers"] for row in written]
    assert len({answer for row in ratings for answer in row}) == 2  # both answers given: the kappa is defined
    assert panel["fleiss_kappa"]["value"] == pytest.approx(fleiss(ratings), abs=1e-9)
    labels = [row["label"] for row in written]
    for k, judge in enumerate(panel["judges"]):
        answers = [row["judge_answers"][k] for row in written]
        assert judge["accuracy"]["correct"] == sum(a == b for a, b in zip(answers, labels))
        if judge["kappa"]:
            assert judge["kappa"]["value"] == pytest.approx(cohen_kappa_score(labels, answers), abs=1e-9)
    assert panel["panel"]["accuracy"]["correct"] == sum(row["correct"] for row in written)
    about = json.loads(pq.read_schema(panel["output"]).metadata[b"batchrun.panel"])
    assert about == {"method": "mean", "judges": [{"model": model["model"], "job_id": model["job_id"]}
                                                  for model in found["models"]]}


def test_the_panel_file_is_not_overwritten_without_force_and_the_text_names_the_figures(tmp_path, tiny_checkpoint):
    spec, db = corpus_spec(tmp_path / "corpus.jsonl"), tmp_path / "j.db"
    out = tmp_path / "panel.parquet"
    llama, qwen = tiny_checkpoint("llama"), tiny_checkpoint("qwen2")
    args = ("compare", spec, "--sample", "8", "--db", db, "-q", *CORPUS_OPTIONS, "-m", llama, "-m", qwen,
            "--panel", "majority", "-o", out, "--calibrate", "batch")
    first = invoke(*args)
    assert first.exit_code == 0, first.output
    assert "panel (majority) of 2 judge(s) on the 8 rows all answered" in first.stdout
    assert "Fleiss' kappa" in first.stdout and f"panel's answers: {out}" in first.stdout
    before = out.read_bytes()
    again = invoke(*args)
    assert again.exit_code == 1 and f"{out} exists; pass --force to overwrite" in again.output
    assert out.read_bytes() == before
    forced = invoke(*args, "--force")
    assert forced.exit_code == 0, forced.output
    written = read_parquet_results(out)
    for row in written:  # a majority of two: the vote where they agree, else the higher mean probability
        votes = Counter(row["judge_answers"]).most_common()
        if votes[0][1] == 2:
            assert row["answer"] == votes[0][0]
        else:
            mean = dict(row["choice_probs"])
            assert mean[row["answer"]] == max(mean[answer] for answer in row["judge_answers"])


@pytest.mark.parametrize("method", ["mean", "majority"])
@pytest.mark.parametrize("calibrate", ["none", "batch"])
def test_a_panel_of_one_equals_its_model(method, calibrate, tmp_path, tiny_checkpoint):
    spec, db = corpus_spec(tmp_path / "corpus.jsonl"), tmp_path / "j.db"
    found = run_compare(spec, db, "-m", tiny_checkpoint("llama"), "--panel", method, "--calibrate", calibrate)
    assert len(found["models"]) == 1 and found["verdict"] == ""
    model = job_rows(db, found["models"][0]["job_id"])
    assert all((row["calibrated_probs"] is not None) == (calibrate == "batch") for row in model.values())
    written = read_parquet_results(found["panel"]["output"])
    assert len(written) == len(model) == 8
    for row in written:
        assert row["answer"] == model[row["id"]]["answer"]
        assert row["choice_probs"] == model[row["id"]]["probs"]  # exactly: the mean of one is the judge's own
        assert row["judge_answers"] == [row["answer"]]
    assert found["panel"]["fleiss_kappa"] is None
    assert found["panel"]["panel"] == {key: found["panel"]["judges"][0][key] for key in ("accuracy", "kappa")}


def test_compare_refuses_a_panel_it_cannot_make_before_running_anything(tmp_path, tiny_checkpoint):
    spec, db = corpus_spec(tmp_path / "corpus.jsonl"), tmp_path / "j.db"
    llama = tiny_checkpoint("llama")
    bad = invoke("compare", spec, "-m", llama, "-m", tiny_checkpoint("qwen2"), "--panel", "median", "--db", db)
    assert bad.exit_code == 2 and "--panel" in bad.output and "'median' is not one of 'mean', 'majority'" in bad.output
    alone = invoke("compare", spec, "-m", llama, "--db", db, *CORPUS_OPTIONS)
    assert alone.exit_code == 1
    assert "compare needs at least two models (--model A --model B), or --panel with one" in alone.output
    stray = invoke("compare", spec, "-m", llama, "-o", tmp_path / "p.parquet", "--db", db, *CORPUS_OPTIONS)
    assert stray.exit_code == 1 and "names the panel's answers file: give --panel mean|majority with it" in stray.output
    (tmp_path / "corpus.panel.parquet").write_bytes(b"not mine")
    taken = invoke("compare", spec, "-m", llama, "--panel", "mean", "--db", db, *CORPUS_OPTIONS)
    assert taken.exit_code == 1 and "corpus.panel.parquet exists; pass --force to overwrite" in taken.output
    assert not db.exists()  # refused before any job was recorded


def test_a_panel_of_generation_rows_is_refused_before_any_row_runs(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "said.jsonl", [{"id": f"g{i}", "prompt": f"Say {word}.", "max_new_tokens": 2,
                                                  "label": word} for i, word in enumerate(["hi", "yes", "no"])])
    db = tmp_path / "j.db"
    result = invoke("compare", spec, "-m", tiny_checkpoint("llama"), "--panel", "majority", "--db", db)
    assert result.exit_code == 1
    assert "a panel combines choice rows' probabilities, and the sample has only generation rows" in result.output
    assert not db.exists() and not (tmp_path / "said.panel.parquet").exists()
