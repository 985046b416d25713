"""The Python API (batchrun.submit, batchrun.plan_job, the exported names): its examples, in the docstrings and in
docs/python-api.md, run on a tiny random-weight model standing in for the default one."""
from __future__ import annotations

import doctest
import functools
import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchrun
from batchrun.job import JobOptions, plan_report
from batchrun.store import Store
from tests.support import REPO_ROOT, write_jsonl

PUBLIC = {"submit", "plan_job", "JobOptions", "StreamedModel", "default_model", "BatchrunError", "user_errors",
          "SpecError", "CheckpointError", "DefaultModelError", "PlanRefused", "SettingRefused", "OutputRefused",
          "OutputExists", "OutputError", "OutputFormatUnknown", "JobLocked", "JobNotFound", "StoreError"}
WITH_EXAMPLES = ("submit", "plan_job", "JobOptions", "StreamedModel", "default_model", "BatchrunError")
ROWS = [
    {"id": "r1", "prompt": "Review: Lovely hotel, friendly staff.\nSentiment?", "choices": ["positive", "negative"]},
    {"id": "r2", "prompt": "Review: The soup was cold.\nSentiment?", "choices": ["positive", "negative"]},
    {"id": "r3", "prompt": "Summarise: the battery died after two days.", "max_new_tokens": 5},
]


@pytest.fixture
def tiny_default(tiny_checkpoint, monkeypatch, tmp_path):
    """The tiny llama checkpoint as the default model, and a working directory holding the ready jobs, as the
    examples expect (they run from the repository root)."""
    path = tiny_checkpoint("llama")
    tiny = functools.wraps(batchrun.default_model)(lambda: path)  # keeps the docstring whose example runs
    monkeypatch.setattr("batchrun.job.prepare.default_model", tiny)
    monkeypatch.setattr(batchrun, "default_model", tiny)
    shutil.copytree(REPO_ROOT / "jobs", tmp_path / "jobs", ignore=shutil.ignore_patterns("*.parquet"))
    monkeypatch.chdir(tmp_path)
    return path


def run_examples(text: str, name: str) -> None:
    test = doctest.DocTestParser().get_doctest(text, {}, name, name, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=lambda report: sys.stdout.write(report))
    assert runner.failures == 0 and test.examples, f"{name}: {runner.failures} failed example(s), printed above"


def test_the_public_names_are_few_and_each_is_documented():
    assert set(batchrun.__all__) == PUBLIC
    for name in PUBLIC:
        assert getattr(batchrun, name).__doc__, name
    for internal in ("make_plan", "Store", "read_spec", "plan_report", "ResidentModel", "resolve_checkpoint"):
        assert not hasattr(batchrun, internal)
    assert PUBLIC <= set(dir(batchrun))


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(tiny_default, name):
    docstring = getattr(batchrun, name).__doc__
    assert ">>>" in docstring
    run_examples(docstring, f"batchrun.{name}")


def test_package_docstring_example_runs(tiny_default):
    run_examples(batchrun.__doc__, "batchrun")


def test_python_api_doc_examples_run(tiny_default):
    """Every ```python block of docs/python-api.md, in order, in one namespace, as a notebook runs them."""
    text = (REPO_ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 6
    run_examples("\n".join(blocks), "docs/python-api.md")


def test_importing_batchrun_and_the_api_loads_no_torch():
    names = sorted(PUBLIC - {"StreamedModel"})
    code = ("import sys, batchrun\n"
            f"for name in {names!r}: getattr(batchrun, name)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


def submit(spec, tmp_path, model, **settings):
    return batchrun.submit(spec, model=model, db=tmp_path / "jobs.db", **settings)


def test_a_path_a_list_and_a_table_give_the_cli_files_answers(tmp_path, tiny_checkpoint):
    from batchrun.job import submit as cli_submit

    model = str(tiny_checkpoint("llama"))
    spec = write_jsonl(tmp_path / "spec.jsonl", ROWS)
    cli_submit(spec, options=JobOptions(model=model), db=tmp_path / "cli.db")
    cli_file = tmp_path / "spec.answers.parquet"
    written, written_at = pq.read_table(cli_file), cli_file.stat().st_mtime_ns
    from_path = submit(spec, tmp_path, model)
    from_list = submit(ROWS, tmp_path, Path(model))
    table = pa.Table.from_pylist([{key: row.get(key) for key in ("id", "prompt", "choices", "max_new_tokens")}
                                  for row in ROWS])  # from_pylist takes its columns from the first row only
    parquet_spec = tmp_path / "spec.parquet"
    pq.write_table(table, parquet_spec)
    from_table = submit(table, tmp_path, model)
    from_batches = submit(pa.RecordBatchReader.from_batches(table.schema, table.to_batches(max_chunksize=2)),
                          tmp_path, model)  # any object exporting the Arrow stream interface
    for answers in (from_path, from_list, from_table, from_batches):
        assert answers.schema == written.schema and answers.equals(written)
    assert submit(parquet_spec, tmp_path, model).equals(written)
    assert cli_file.stat().st_mtime_ns == written_at  # the API writes no answers file unless asked


def test_the_same_rows_resume_the_same_job_and_compute_nothing_again(tmp_path, tiny_checkpoint, isolated_state):
    model = str(tiny_checkpoint("llama"))
    first = submit(ROWS, tmp_path, model)
    store = Store(tmp_path / "jobs.db")
    try:
        (job,) = store.jobs()
        passes = store.status(job["id"])["passes"]
        again = submit([dict(row) for row in ROWS], tmp_path, model)
        assert again.equals(first)
        (same,) = store.jobs()
        assert same["id"] == job["id"] and store.status(job["id"])["passes"] == passes > 0
        spec_file = Path(store.status(job["id"])["spec_path"])
    finally:
        store.close()
    # The job's spec is the state directory's file for these rows, named by the hash of its bytes.
    assert spec_file.parent == isolated_state / "specs" and spec_file.suffix == ".jsonl"
    assert spec_file.name == f"rows-{hashlib.sha256(spec_file.read_bytes()).hexdigest()[:16]}.jsonl"
    assert [json.loads(line) for line in spec_file.read_text().splitlines()] == ROWS


def test_an_interrupted_job_of_rows_in_memory_resumes(tmp_path, tiny_checkpoint, monkeypatch):
    model = str(tiny_checkpoint("llama"))
    rows = [{"id": i, "prompt": f"Summarise: review {i}.", "max_new_tokens": 6} for i in range(4)]
    real_commit = Store.commit_pass

    def stop_after_the_first_pass(self, *args, **kwargs):
        real_commit(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Store, "commit_pass", stop_after_the_first_pass)
    with pytest.raises(KeyboardInterrupt):
        submit(rows, tmp_path, model)
    monkeypatch.setattr(Store, "commit_pass", real_commit)
    store = Store(tmp_path / "jobs.db")
    try:
        (job,) = store.jobs()
        stopped = store.status(job["id"])
        assert stopped["state"] == "interrupted" and stopped["passes"] == 1 and stopped["partial_tokens"] > 0
        resumed = submit(rows, tmp_path, model)
        (same,) = store.jobs()
        assert same["id"] == job["id"] and store.status(job["id"])["state"] == "done"
    finally:
        store.close()
    fresh = batchrun.submit(rows, model=model, db=tmp_path / "fresh.db")
    assert resumed["id"].to_pylist() == [0, 1, 2, 3] and resumed["error"].null_count == 4
    for column in ("answer", "output_tokens", "finish_reason"):
        assert resumed[column].equals(fresh[column])
    assert resumed["logprob"].to_pylist() == pytest.approx(fresh["logprob"].to_pylist(), abs=1e-4)


def test_a_bad_row_is_named_before_anything_runs(tmp_path, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    bad = [ROWS[0], {"id": "b", "prompt": 5}]
    with pytest.raises(batchrun.SpecError) as listed:
        submit(bad, tmp_path, model)
    assert re.fullmatch(r".*/specs/rows-[0-9a-f]{16}\.jsonl:line 2: prompt must be a string, got an integer \(5\)",
                        str(listed.value))
    table = pa.table({"id": ["a", "b"], "prompt": ["Fine.", None]})
    with pytest.raises(batchrun.SpecError, match=r"rows-[0-9a-f]{16}\.parquet: row 2: missing prompt"):
        submit(table, tmp_path, model)
    with pytest.raises(batchrun.SpecError, match=r"rows\[1\]: not a JSON value"):
        submit([ROWS[0], {"id": "c", "prompt": object()}], tmp_path, model)
    with pytest.raises(batchrun.SpecError, match="got one dict"):
        submit(ROWS[0], tmp_path, model)
    with pytest.raises(batchrun.SpecError, match="empty"):
        submit([], tmp_path, model)
    assert not (tmp_path / "jobs.db").exists()  # refused before the database is opened


def test_settings_are_job_options_and_unknown_ones_are_refused(tmp_path, tiny_checkpoint):
    import numpy

    model = str(tiny_checkpoint("llama"))
    rows = [{"id": numpy.int64(1), "prompt": "Review: Great value.\nSentiment?"}]
    answers = submit(rows, tmp_path, model, choices=["positive", "negative"], batch_size=1)
    assert answers["id"].to_pylist() == [1] and answers["finish_reason"].to_pylist() == ["choice"]
    options = JobOptions(model=model, choices=("positive", "negative"))
    assert batchrun.submit(rows, options=options, db=tmp_path / "jobs.db").equals(answers)
    with pytest.raises(TypeError, match="unknown setting.*max_tokens"):
        submit(rows, tmp_path, model, max_tokens=3)
    with pytest.raises(batchrun.SettingRefused):
        submit(rows, tmp_path, model, batch_size=0)


def test_output_is_written_only_when_named_and_never_over_a_file_without_force(tmp_path, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    spec = write_jsonl(tmp_path / "spec.jsonl", ROWS)
    answers = submit(spec, tmp_path, model)
    assert {path.name for path in tmp_path.iterdir() if not path.name.startswith("jobs.db")} == {"spec.jsonl"}
    out = tmp_path / "answers.parquet"
    assert submit(spec, tmp_path, model, output=out).equals(answers)
    assert pq.read_table(out).equals(answers)
    with pytest.raises(batchrun.OutputRefused):
        submit(spec, tmp_path, model, output=out)
    assert submit(ROWS, tmp_path, model, output=out, force=True).equals(answers)
    lines = submit(ROWS, tmp_path, model, output=tmp_path / "answers.jsonl").num_rows
    assert lines == len((tmp_path / "answers.jsonl").read_text().splitlines()) == len(ROWS)


def test_plan_job_is_the_plan_commands_report(tmp_path, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    spec = write_jsonl(tmp_path / "spec.jsonl", ROWS)
    expected = plan_report(spec, [model], JobOptions(model=model))
    for report in (batchrun.plan_job(spec, model=model), batchrun.plan_job(ROWS, models=[Path(model)])):
        assert report.keys() == expected.keys() and report["rows"] == len(ROWS)
        (candidate,) = report["candidates"]
        assert candidate["model"] == model and candidate["fits"]
        assert {k: candidate[k] for k in ("mode", "batch_size", "passes")} == \
            {k: expected["candidates"][0][k] for k in ("mode", "batch_size", "passes")}
    compared = batchrun.plan_job(ROWS, models=[model, model], streaming="always")
    assert [c["mode"] for c in compared["candidates"]] == ["streamed", "streamed"]
    assert not (Path(os.environ["BATCHRUN_HOME"]) / "batchrun.db").exists()  # planning records no job


@pytest.mark.parametrize("example", ["classify_reviews", "triage_tickets", "stream_a_model"])
def test_the_examples_run(tiny_default, capsys, example):
    runpy.run_path(str(REPO_ROOT / "examples" / f"{example}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert {"classify_reviews": "answers over all rows:", "triage_tickets": "t-24 ",
            "stream_a_model": "layers were in memory at once"}[example] in out


def test_the_classify_example_shows_the_probability_each_answer_follows(tiny_default, capsys):
    """`answer` follows the calibrated probabilities where the job calibrates: the example prints those beside the
    model's own, so a row answered `positive` never shows only a P(positive) under one half."""
    runpy.run_path(str(REPO_ROOT / "examples" / "classify_reviews.py"), run_name="__main__")
    printed = re.findall(r"^(rev-\d+)\s+(\w+)\s+(\S+)\s+(\S+)\s+(positive|negative) (?:ok|MISS)$",
                         capsys.readouterr().out, re.M)
    assert len(printed) == 10
    rows = {row["id"]: row for row in batchrun.submit(REPO_ROOT / "jobs" / "review-sentiment.jsonl").to_pylist()}
    for row_id, answer, own, calibrated, _ in printed:
        row = rows[row_id]
        assert float(own) == pytest.approx(dict(row["choice_probs"])["positive"], abs=5e-4)
        follows = dict(row["calibrated_probs"] or row["choice_probs"])["positive"]
        assert calibrated == "-" if row["calibrated_probs"] is None else float(calibrated) == pytest.approx(follows,
                                                                                                           abs=5e-4)
        assert answer == ("positive" if follows > 0.5 else "negative")
