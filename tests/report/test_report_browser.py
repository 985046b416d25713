"""Reports of real jobs on the default model, opened in headless Chromium with the network blocked: every section is
there, every chart is drawn (an SVG with its data marks on screen), and the page loads nothing but itself."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from batchrun.report import write_report
from batchrun.store import RowResult, Store
from tests.report.chromium import chromium_binary, view_page
from tests.support import REVIEWS, run_job, write_jsonl

SECTIONS = ("glance", "answers", "labels", "run", "errors")
BINARY = chromium_binary()
needs_chromium = pytest.mark.skipif(BINARY is None, reason="no chromium binary (apt-get install chromium)")
SENTIMENTS = ["positive", "negative", "positive", "negative", "positive", "negative"]


def opened(report: Path, tmp_path: Path):
    """The report as Chromium shows it, checked to be offline, with its screenshot saved beside it."""
    html = report.read_text(encoding="utf-8")
    assert not re.search(r"\ssrc\s*=", html), "the page loads an external resource"
    assert set(re.findall(r'href\s*=\s*"([^"]*)"', html)) <= {f"#{s}" for s in SECTIONS} | _svg_refs(html)
    assert not re.search(r"url\(\s*['\"]?(?!#)", html), "a style fetches something"
    assert "<script" not in html
    view = view_page(BINARY, report, tmp_path / "chromium-profile")
    assert view.requested == [report.resolve().as_uri()], view.requested
    assert view.failed == [] and view.console == []
    assert list(view.sections) == list(SECTIONS)
    for chart in view.charts:
        assert chart["width"] > 300 and chart["height"] > 50, chart
        assert chart["marks"] > 0 and chart["drawn"] == chart["marks"] and chart["paths"] >= chart["marks"], chart
    shot = tmp_path / f"{report.stem}.png"
    shot.write_bytes(view.screenshot)
    width, height = struct.unpack(">II", view.screenshot[16:24])  # the PNG's IHDR
    assert view.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and width >= 1000 and height > 1500
    print(f"{report.name}: {len(html):,} bytes, screenshot {shot} ({width}x{height})")
    return view


def _svg_refs(html: str) -> set[str]:
    """The SVGs' own references to their markers and clip paths (#m..., #p...), defined in the page itself."""
    defined = set(re.findall(r'\sid="([^"]+)"', html))
    refs = set(re.findall(r'xlink:href="(#[^"]*)"', html))
    assert {ref[1:] for ref in refs} <= defined
    return refs


def test_a_job_of_labelled_choices_generations_and_errors_is_reported_in_full(tmp_path, default_checkpoint):
    rows = [{"id": f"r{i}", "prompt": f"Review: {text}\nIs it positive or negative?",
             "choices": ["positive", "negative"], "label": SENTIMENTS[i]} for i, text in enumerate(REVIEWS)]
    rows += [{"id": f"stars{i}", "prompt": f"Review: {text}\nStars from 1 to 5?", "choices": ["1", "2", "3", "4", "5"]}
             for i, text in enumerate(REVIEWS[:3])]
    rows += [{"id": f"sum{i}", "prompt": f"Summarise: {text}", "max_new_tokens": 4} for i, text in enumerate(REVIEWS)]
    rows.append({"id": "long", "prompt": "word " * 9000, "max_new_tokens": 4})  # over the model's context
    rows.append({"id": "bad", "prompt": "Summarise: nothing", "max_new_tokens": 0})  # refused by skip_invalid
    spec = write_jsonl(tmp_path / "mixed.jsonl", rows)
    summary, _ = run_job(spec, tmp_path, default_checkpoint, "mixed", calibrate="batch", skip_invalid=True)
    with Store(tmp_path / "mixed.db") as store:
        passes, runs = store.passes(summary.job_id), store.runs(summary.job_id)
        report = write_report(store, summary.job_id, tmp_path / "mixed.report.html", force=True)  # submit wrote one
    # every pass of the run is recorded with its rows, time and the plan's estimate; the run with its mode and ETA
    assert [p["pass_no"] for p in passes] == list(range(1, summary.passes_now + 1))
    assert sum(p["rows_finished"] for p in passes) == summary.rows_computed_now == 15
    assert all(p["seconds"] > 0 and p["peak_memory_bytes"] > 0 and p["planned_seconds"] for p in passes)
    assert runs[0]["mode"] == summary.mode and runs[0]["planned_seconds"] > 0
    if BINARY is None:
        pytest.skip("no chromium binary (apt-get install chromium): the report was not opened")
    view = opened(report, tmp_path)
    glance = view.sections["glance"]
    assert "15 answered, 2 errored, 0 pending of 17" in glance and summary.mode in glance
    for name in ("row-states", "answer-distribution", "confidence", "scores", "finish-reasons", "answer-length",
                 "confusion", "reliability", "pass-seconds", "progress", "error-reasons"):
        view.chart(name)
    assert view.chart("confidence")["marks"] == 20  # one bar per bin of the histogram
    assert view.chart("answer-distribution")["marks"] >= 2 * 2  # raw and calibrated bars of each answer
    answers = view.sections["answers"]
    assert "Choice rows (9)" in answers and "Generation rows (6)" in answers and "Review: " in answers
    assert view.tables["least-confident"] == 9
    assert re.search(r"\d+\.\d% correct \(95% interval \d+\.\d% to \d+\.\d%\): \d of 6 labelled rows",
                     view.sections["labels"])
    assert view.tables["per-class"] == 2
    errors = view.sections["errors"]
    assert "2 rows errored, for 2 distinct reasons" in errors
    assert "long" in errors and "bad" in errors and "max_new_tokens" in errors and "context" in errors


@needs_chromium
def test_a_running_job_is_reported_as_a_snapshot(tmp_path):
    with Store(tmp_path / "live.db") as store:
        job_id = store.ensure_job("5" * 64, spec_path=str(tmp_path / "live.jsonl"), model="tiny", settings={},
                                  rows=[(i, f"doc-{i}") for i in range(8)])
        store.acquire(job_id)  # this process holds the job: it is running
        store.record_run_estimate(job_id, mode="streamed", planned_seconds=120.0)
        for first in (0, 2):
            store.commit_batch(job_id, [RowResult(i, f"doc-{i}", "yes", {"yes": 0.7, "no": 0.3}, None, -0.4, 30, 1,
                                                  "choice", None) for i in (first, first + 1)], passes=1)
            store.record_pass(job_id, seconds=2.0, rows_finished=2, peak_memory_bytes=3 << 30, planned_seconds=2.5)
        report = write_report(store, job_id, tmp_path / "live.report.html")
    view = opened(report, tmp_path)
    glance = view.sections["glance"]
    assert "Snapshot of" in glance and "while the job is running: 4 rows are still pending" in glance
    assert "4 answered, 0 errored, 4 pending of 8" in glance and "streamed" in glance
    assert view.chart("pass-seconds")["marks"] == 2 + 1  # two passes and the plan's line
    assert view.tables["least-confident"] == 4


@needs_chromium
def test_the_offline_check_sees_a_page_that_reaches_out(tmp_path):
    page = tmp_path / "reaching.html"
    page.write_text('<!DOCTYPE html><html><body><img src="https://example.com/logo.png"></body></html>')
    view = view_page(BINARY, page, tmp_path / "chromium-profile")
    assert "https://example.com/logo.png" in view.requested
    assert view.failed, "a blocked network must fail the image's load"
