"""The report without a browser: pass timings in the store, each section from the rows it is given (labels by the
output's quality contract), the caps of a 100,000-row job, the `batchrun report` command, and matplotlib kept out of
`import batchrun`."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
import warnings
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from batchrun.output import CHOICE_PROBS_TYPE, OutputExists
from batchrun.quality import JudgedRow, agreement_figures, label_metrics
from batchrun.report import ReportData, Rows, render_report, write_report
from batchrun.report.errors import reason_group
from batchrun.store import RowResult, Store
from tests.support import REPO_ROOT, invoke, write_jsonl

FINGERPRINT = "abcdef0123456789" * 4


def charts_in(html: str) -> dict[str, int]:
    """Each chart's name -> the data marks its SVG draws."""
    figures = re.findall(r'<figure class="chart" data-chart="([^"]+)">(.*?)</figure>', html, re.S)
    return {name: len(re.findall(r'\sid="mark-', body)) for name, body in figures}


def choice(idx: int, probs: dict[str, float], row_id=None) -> RowResult:
    return RowResult(idx, row_id or f"doc-{idx}", max(probs, key=probs.get), probs, None, -0.5, 20, 1, "choice", None)


def job_status(**counts) -> dict:
    """What Store.status says of a finished job, as the report reads it."""
    return {"id": "abcdef0123456789", "state": "done", "model": "tiny", "spec_path": "/nowhere/spec.jsonl",
            "created_at": "2026-01-01T00:00:00+00:00", "passes": 1, "elapsed_seconds": 60.0, "eta_seconds": None,
            "rows_errored": 0, "rows_pending": 0, **counts}


# ---- pass timings in the store ----------------------------------------------------------------------------------


def test_passes_are_numbered_within_their_run_and_read_back_run_by_run(tmp_path):
    with Store(tmp_path / "p.db") as store:
        job_id = store.ensure_job(FINGERPRINT, spec_path="s.jsonl", model="m", settings={}, rows=[(0, "a"), (1, "b")])
        store.acquire(job_id)
        store.record_run_estimate(job_id, mode="streamed", planned_seconds=90.0)
        assert store.record_pass(job_id, seconds=1.5, rows_finished=1, bytes_read=10 << 20, read_seconds=0.5) == 1
        assert store.record_pass(job_id, seconds=2.0, rows_finished=0, peak_memory_bytes=1 << 30) == 2
        store.release(job_id, "interrupted")
        store.acquire(job_id)
        assert store.record_pass(job_id, seconds=1.0, rows_finished=1, planned_seconds=1.2) == 1
        passes = store.passes(job_id)
        runs = store.runs(job_id)
    assert [(p["run_no"], p["pass_no"], p["rows_finished"]) for p in passes] == [(1, 1, 1), (1, 2, 0), (2, 1, 1)]
    assert passes[0]["bytes_read"] == 10 << 20 and passes[0]["read_seconds"] == 0.5
    assert passes[1]["peak_memory_bytes"] == 1 << 30 and passes[2]["planned_seconds"] == 1.2
    assert all(datetime.fromisoformat(p["finished_at"]).tzinfo is not None for p in passes)
    assert [(r["run_no"], r["end_state"], r["mode"], r["planned_seconds"]) for r in runs] == [
        (1, "interrupted", "streamed", 90.0), (2, "running", None, None)]


def test_a_pass_is_recorded_only_for_a_run_this_store_opened_and_with_sane_values(tmp_path):
    with Store(tmp_path / "p.db") as store:
        job_id = store.ensure_job(FINGERPRINT, spec_path="s.jsonl", model="m", settings={}, rows=[(0, "a")])
        with pytest.raises(RuntimeError, match="not acquired"):
            store.record_pass(job_id, seconds=1.0, rows_finished=1)
        store.acquire(job_id)
        with pytest.raises(ValueError, match="seconds >= 0"):
            store.record_pass(job_id, seconds=-1.0, rows_finished=1)
        assert store.passes(job_id) == []


# ---- sections ---------------------------------------------------------------------------------------------------


def labelled_table(labels: list[str], answers: list[str], calibrated: bool) -> pa.Table:
    """The output's columns for choice rows judged against labels (as answers_table gives them)."""
    rng = random.Random(1)
    probs = []
    for answer in answers:
        sure = rng.uniform(0.5, 0.99)
        others = [c for c in sorted(set(labels) | set(answers)) if c != answer]
        probs.append([(answer, sure)] + [(c, (1 - sure) / len(others)) for c in others])
    count = len(labels)
    return pa.table({
        "id": pa.array([f"row-{i}" for i in range(count)]),
        "answer": pa.array(answers),
        "choice_probs": pa.array(probs, CHOICE_PROBS_TYPE),
        "calibrated_probs": pa.array(probs if calibrated else [None] * count, CHOICE_PROBS_TYPE),
        "score": pa.array([None] * count, pa.float64()),
        "output_tokens": pa.array([1] * count, pa.int64()),
        "finish_reason": pa.array(["choice"] * count),
        "error": pa.array([None] * count, pa.string()),
        "label": pa.array(labels),
        "correct": pa.array([a == label for a, label in zip(answers, labels)]),
    })


def confusion_of(labels: list[str], answers: list[str]) -> dict:
    found: dict[str, dict[str, int]] = {}
    for label, answer in zip(labels, answers):
        found.setdefault(label, {})
        found[label][answer] = found[label].get(answer, 0) + 1
    return found


def test_labelled_rows_show_accuracy_confusion_reliability_and_per_class_figures():
    labels = ["cat", "dog", "cat", "bird", "dog", "cat", "bird", "dog"]
    answers = ["cat", "dog", "dog", "bird", "dog", "cat", "cat", "dog"]
    metrics = {"labelled": 8, "correct": 6, "rate": 0.75, "interval": [0.409, 0.929],
               "per_class": {"cat": {"precision": 2 / 3, "recall": 2 / 3, "support": 3},
                             "dog": {"precision": 0.75, "recall": 1.0, "support": 3},
                             "bird": {"precision": 1.0, "recall": 0.5, "support": 2}},
               "confusion": confusion_of(labels, answers)}
    data = ReportData(job=job_status(rows_total=8, rows_done=8), runs=[], passes=[],
                      rows=Rows.from_table(labelled_table(labels, answers, calibrated=True)),
                      quality={"choice": metrics, "generation": None, "calibration": {"method": "batch"}})
    html = render_report(data)
    labels_html = html[html.index('<section id="labels">'):html.index('<section id="run">')]
    assert "75.0% correct (95% interval 40.9% to 92.9%): 6 of 8 labelled rows answered" in labels_html
    charts = charts_in(labels_html)
    assert charts["confusion"] == 1  # one heat map of every cell
    assert charts["reliability"] == 2 * 2  # raw and calibrated: a line and its binned points each
    per_class = re.search(r'<table data-table="per-class">(.*?)</table>', labels_html, re.S).group(1)
    assert [re.sub(r"<[^>]+>", " ", row).split() for row in re.findall(r"<tr>(.*?)</tr>", per_class)][1:] == [
        ["cat", "0.667", "0.667", "3"], ["dog", "0.75", "1", "3"], ["bird", "1", "0.5", "2"]]


def table_rows(html: str, name: str) -> list[list[str]]:
    """The cells of each row under the header of the table marked `name`."""
    body = re.search(rf'<table data-table="{name}">(.*?)</table>', html, re.S).group(1)
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)][1:]


def test_rated_rows_show_agreement_the_surest_disagreements_with_their_prompts_and_corrected_shares(tmp_path):
    rng = random.Random(4)
    judged = []
    for i in range(120):  # the first 60 labelled: a sample of the job
        truth = rng.choice("123")
        weights = {c: rng.random() + (0.5 if c == truth else 0.0) for c in "123"}
        probs = {c: w / sum(weights.values()) for c, w in weights.items()}
        judged.append(JudgedRow(f"row-{i}", max(probs, key=probs.get), probs,
                                sum(int(c) * p for c, p in probs.items()), truth if i < 60 else None))
    labelled = judged[:60]
    spec = write_jsonl(tmp_path / "rated.jsonl", [{"id": row.id, "prompt": f"Rate review number {i}",
                                                   "choices": ["1", "2", "3"]} for i, row in enumerate(judged)])
    found = agreement_figures(judged)
    metrics = label_metrics([row.label for row in labelled], [row.answer for row in labelled]).to_json()
    data = ReportData(job=job_status(rows_total=120, rows_done=120, spec_path=str(spec),
                                     created_at=datetime.now(timezone.utc).isoformat()), runs=[], passes=[],
                      rows=Rows.from_table(labelled_table([row.label for row in labelled],
                                                          [row.answer for row in labelled], calibrated=False)),
                      quality={"choice": metrics, "generation": None, "agreement": found})
    html = render_report(data)
    labels_html = html[html.index('<section id="labels">'):html.index('<section id="run">')]
    figures = table_rows(labels_html, "agreement")
    assert [line[0].split(" (")[0] for line in figures] == [
        "Cohen&#x27;s kappa", "quadratic-weighted kappa", "Spearman&#x27;s rho", "Kendall&#x27;s tau-b",
        "mean absolute error"]
    kappa = found["kappa"]
    assert figures[0][1:] == [f"{kappa['value']:.3g}", f"{kappa['interval'][0]:.3f} to {kappa['interval'][1]:.3f}",
                              "60"]
    wrong = sorted((row for row in labelled if row.answer != row.label), key=lambda row: -row.probs[row.answer])
    shown = table_rows(labels_html, "disagreements")
    assert [line[0] for line in shown] == [row.id for row in wrong[:10]]
    assert shown[0][1] == f"Rate review number {wrong[0].id.split('-')[1]}"
    assert shown[0][2:4] == [wrong[0].label, wrong[0].answer]
    assert f"… and {len(wrong) - 10:,} more disagreeing rows not shown" in labels_html
    shares = table_rows(labels_html, "corrected-shares")
    assert [line[0] for line in shares] == ["1", "2", "3"]
    for line, share in zip(shares, found["shares"]):
        assert line[1] == f"{share['raw']:.1%}"
        assert line[2] == (f"{share['corrected']:.1%}" if share["corrected"] is not None else "n/a")


def test_a_confusion_matrix_of_many_classes_keeps_the_largest_and_folds_the_rest():
    labels = [f"class-{i % 30}" for i in range(300)]
    metrics = {"labelled": 300, "correct": 300, "rate": 1.0, "interval": [0.98, 1.0], "per_class": {},
               "confusion": confusion_of(labels, labels)}
    data = ReportData(job=job_status(rows_total=300, rows_done=300), runs=[], passes=[],
                      rows=Rows.from_table(labelled_table(labels, labels, calibrated=False)),
                      quality={"choice": metrics, "generation": None})
    html = render_report(data)
    confusion = re.search(r'data-chart="confusion">(.*?)</figure>', html, re.S).group(1)
    assert confusion.count("(other)") == 2  # the 21st row and the 21st column
    assert len(html) < 400_000


def test_rows_without_labels_get_one_line_saying_so():
    table = labelled_table(["a", "b"], ["a", "b"], calibrated=False).drop_columns(["label", "correct"])
    data = ReportData(job=job_status(rows_total=2, rows_done=2), runs=[], passes=[], rows=Rows.from_table(table))
    labels_html = re.search(r'<section id="labels">(.*?)</section>', render_report(data), re.S).group(1)
    assert "No answered row has a label" in labels_html and "<figure" not in labels_html


def test_errors_group_by_their_reason_whatever_the_row_location_and_numbers():
    assert reason_group("docs.jsonl:12: prompt has 9031 tokens; the context is 8192 tokens") == \
        reason_group("docs.jsonl:900: prompt has 10000 tokens; the context is 8192 tokens") == \
        "prompt has N tokens; the context is N tokens"
    assert reason_group("data.parquet: row 3: max_new_tokens must be a positive integer, got 0") == \
        "max_new_tokens must be a positive integer, got N"
    assert reason_group("expected a JSON object") == "expected a JSON object"


def test_prompts_of_a_spec_edited_after_the_job_are_not_shown(tmp_path):
    spec = write_jsonl(tmp_path / "s.jsonl", [{"id": "a", "prompt": "first words", "choices": ["x", "y"]}])
    with Store(tmp_path / "s.db") as store:
        job_id = store.ensure_job(FINGERPRINT, spec_path=str(spec), model="m", settings={}, rows=[(0, "a")])
        store.commit_batch(job_id, [choice(0, {"x": 0.6, "y": 0.4}, "a")], passes=1)
        shown = render_report_of(store, job_id, tmp_path / "before.html")
        write_jsonl(spec, [{"id": "a", "prompt": "other words", "choices": ["x", "y"]}])
        later = time.time() + 5
        os.utime(spec, (later, later))
        edited = render_report_of(store, job_id, tmp_path / "after.html")
    assert "first words" in shown
    assert "other words" not in edited and "changed after the job was recorded" in edited


def render_report_of(store: Store, job_id: str, path) -> str:
    return write_report(store, job_id, path).read_text(encoding="utf-8")


# ---- a large job ------------------------------------------------------------------------------------------------


def test_a_report_of_100000_rows_is_built_with_its_tables_capped_and_its_charts_aggregated(tmp_path):
    rows, batch, choices = 100_000, 256, ("positive", "negative", "neutral")
    rng = random.Random(0)
    with Store(tmp_path / "big.db") as store:
        store.db.execute("PRAGMA synchronous=OFF")  # this test's database needs no durability: build it fast
        job_id = store.ensure_job(FINGERPRINT, spec_path=str(tmp_path / "gone.jsonl"), model="m", settings={},
                                  rows=[(i, f"doc-{i}", None, choices[i % 3]) for i in range(rows)])
        store.acquire(job_id)
        done = int(rows * 0.95)  # the rest still pending: a snapshot
        for first in range(0, done, batch):
            results = []
            for i in range(first, min(first + batch, done)):
                if i % 50 == 0:  # 1,900 errors of 25 kinds
                    results.append(RowResult(i, f"doc-{i}", None, None, None, None, 9000 + i, None, "error",
                                             f"gone.jsonl:{i + 1}: reason {i // 50 % 25 * 'x'} of {i} tokens"))
                    continue
                weights = [rng.random() for _ in choices]
                results.append(choice(i, {c: w / sum(weights) for c, w in zip(choices, weights)}))
            store.commit_batch(job_id, results, passes=1)
            store.record_pass(job_id, seconds=rng.uniform(0.5, 2.0), rows_finished=len(results))
        started = time.monotonic()
        path = write_report(store, job_id, tmp_path / "big.report.html")
        seconds = time.monotonic() - started
    html = path.read_text(encoding="utf-8")
    print(f"report of {rows:,} rows ({len(range(0, done, batch))} passes): {seconds:.1f} s, {len(html):,} bytes")
    assert len(html) < 1_000_000
    assert "95,000 of 100,000 rows finished" in html and "5,000 rows are still pending" in html
    assert len(re.findall(r"<tr>", re.search(r'data-table="least-confident">(.*?)</table>', html, re.S)[1])) == 21
    assert "… and 93,080 more choice rows not shown" in html
    assert html.count('data-table="errors"') == 20 and "… and 5 more reasons, covering 380 rows, not shown" in html
    assert "… and 66 more rows with this reason not shown" in html  # 76 rows per reason, 10 shown
    charts = charts_in(html)
    assert charts["confidence"] == 20 and charts["pass-seconds"] <= 200 and charts["progress"] == 1
    assert "Each bar is the mean of 2 consecutive passes" in html


# ---- the command ------------------------------------------------------------------------------------------------


def test_the_report_command_writes_beside_the_spec_replaces_its_own_page_and_no_other_file_without_force(tmp_path):
    spec = write_jsonl(tmp_path / "reviews.jsonl", [{"id": "a", "prompt": "p", "choices": ["x", "y"]}])
    db = tmp_path / "jobs.db"
    with Store(db) as store:
        job_id = store.ensure_job(FINGERPRINT, spec_path=str(spec), model="m", settings={}, rows=[(0, "a")])
        store.commit_batch(job_id, [choice(0, {"x": 0.9, "y": 0.1}, "a")], passes=1)
    result = invoke("report", "--db", db)
    assert result.exit_code == 0, result.output
    written = tmp_path / "reviews.report.html"
    assert result.output.strip() == f"report of job {job_id} -> {written}" and "<svg" in written.read_text()
    # the page every submit leaves is rebuilt as it stands, as `batchrun report` after a submit is asked to do
    first_inode = written.stat().st_ino
    again = invoke("report", job_id[:6], "--db", db)
    assert again.exit_code == 0, again.output
    assert "<svg" in written.read_text() and written.stat().st_ino != first_inode  # written anew, renamed over it
    written.write_text("my notes")
    mine = invoke("report", job_id[:6], "--db", db)
    assert mine.exit_code == 1 and mine.output.strip() == f"Error: {written} exists; pass --force to overwrite"
    assert written.read_text() == "my notes"
    other = tmp_path / "elsewhere" / "r.html"
    assert invoke("report", "--db", db, "-o", other).exit_code == 0 and other.exists()
    notes = tmp_path / "notes.html"
    notes.write_text("<p>mine</p>")
    refused = invoke("report", "--db", db, "-o", notes)
    assert refused.exit_code == 1 and refused.output.strip() == f"Error: {notes} exists; pass --force to overwrite"
    assert notes.read_text() == "<p>mine</p>"
    assert invoke("report", "--db", db, "-o", notes, "--force").exit_code == 0 and "<svg" in notes.read_text()
    missing = invoke("report", "nope", "--db", db)
    assert missing.exit_code == 1 and 'no job matches "nope"' in missing.output
    own_spec = invoke("report", "--db", db, "-o", spec, "--force")
    assert own_spec.exit_code == 1 and "it is the job spec itself" in own_spec.output


def test_the_report_command_asks_for_a_file_name_when_the_spec_path_names_no_directory(tmp_path):
    db = tmp_path / "jobs.db"
    with Store(db) as store:
        store.ensure_job(FINGERPRINT, spec_path="jobs/old.jsonl", model="m", settings={}, rows=[(0, "a")])
    result = invoke("report", "--db", db)
    assert result.exit_code == 2 and "name the report file with -o" in result.output
    no_database = invoke("report", "--db", tmp_path / "none.db", "-o", tmp_path / "r.html")
    assert no_database.exit_code == 1 and "no database there" in no_database.output


def test_write_report_refuses_an_existing_file_unless_forced_and_leaves_no_temp(tmp_path):
    with Store(tmp_path / "w.db") as store:
        job_id = store.ensure_job(FINGERPRINT, spec_path="s.jsonl", model="m", settings={}, rows=[(0, "a")])
        target = tmp_path / "out.html"
        target.write_text("mine")
        with pytest.raises(OutputExists):
            write_report(store, job_id, target)
        assert target.read_text() == "mine"
        write_report(store, job_id, target, force=True)
    assert target.read_text().startswith("<!DOCTYPE html>")
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_matplotlib_loads_with_the_report_not_with_batchrun():
    code = ("import sys, batchrun, batchrun.cli, batchrun.job, batchrun.report\n"
            "print('matplotlib' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert loaded.stdout.strip() == "False"


def test_a_job_that_has_not_run_yet_gets_every_section_each_saying_so():
    data = ReportData(job=job_status(state="pending", rows_total=3, rows_done=0, rows_pending=3, elapsed_seconds=0.0),
                      runs=[], passes=[], rows=Rows.from_table(pa.table({"id": pa.array([], pa.string())})),
                      built_at=datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc))
    html = render_report(data)
    sections = dict(re.findall(r'<section id="([a-z]+)">(.*?)</section>', html, re.S))
    assert list(sections) == ["glance", "answers", "labels", "run", "errors"]
    glance = sections["glance"]
    assert "Snapshot of 2026-03-01 12:00:00 UTC while the job is pending: 3 rows are still pending" in glance
    assert "No run has started yet." in glance
    assert "No row is answered yet." in sections["answers"]
    assert "No pass timings are recorded for this job yet" in sections["run"]
    assert "No row errored." in sections["errors"]


@pytest.mark.parametrize("span", [timedelta(seconds=2), timedelta(seconds=270), timedelta(hours=4, minutes=30),
                                  timedelta(days=40)])
def test_the_progress_chart_picks_its_time_ticks_without_a_warning_on_the_users_terminal(span):
    # the chart is drawn after every run, stopped ones too: any span finds its ticks, or matplotlib warns on the terminal
    from batchrun.report.charts import progress
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        svg = progress("progress", [("run 1", [start, start + span / 2, start + span], [0, 5, 10])], stops=[],
                       total=10)
    assert 'id="mark-progress-run-0"' in svg
