"""The page `batchrun compare` writes, opened in headless Chromium: one point per model with its interval, the
figures as a table and the verdict, offline."""
from __future__ import annotations

import re

import pytest

from batchrun.report import write_comparison
from batchrun.report.page import GENERATOR_META
from tests.report.chromium import chromium_binary, view_page
from tests.support import invoke, write_jsonl

BINARY = chromium_binary()


def metrics(correct: int, total: int, low: float, high: float) -> dict:
    return {"kind": "accuracy", "labelled": total, "correct": correct, "rate": correct / total,
            "interval": [low, high], "per_class": {}, "confusion": {}}


COMPARISON = {
    "spec": "/data/reviews.jsonl", "sample_rows": 60, "labelled_rows": 60,
    "verdict": "small is 20 points more accurate (93% vs 73% on 60 labelled rows) for about the same wait.",
    "models": [
        {"model": "small", "job_id": "a" * 16, "metric": "accuracy", "raw": metrics(47, 60, 0.66, 0.87),
         "calibrated": metrics(56, 60, 0.84, 0.97), "calibration": "auto (labels)", "passes": 1,
         "eta_seconds": 3600.0, "eta_human": "1.0 h"},
        {"model": "large", "job_id": "b" * 16, "metric": "accuracy", "raw": metrics(36, 60, 0.47, 0.71),
         "calibrated": None, "calibration": "none", "passes": 4, "eta_seconds": 36000.0, "eta_human": "10 h"},
    ],
}


def test_the_comparison_page_draws_one_point_per_model_offline(tmp_path):
    page = write_comparison(COMPARISON, tmp_path / "reviews.compare.html")
    html = page.read_text()
    assert GENERATOR_META in html and "<script" not in html and not re.search(r"\ssrc\s*=", html)
    assert COMPARISON["verdict"] in html and "93.3% (84%-97%)" in html and "10 h" in html
    if BINARY is None:
        pytest.skip("no chromium binary (apt-get install chromium): the page was not opened")
    view = view_page(BINARY, page, tmp_path / "profile")
    assert view.requested == [page.resolve().as_uri()] and view.failed == [] and view.console == []
    chart = view.chart("compare")
    assert chart["marks"] == 2 and chart["drawn"] == 2
    assert view.tables["compare"] == 2


def test_a_model_right_on_no_row_and_one_right_on_every_row_are_drawn(tmp_path):
    """0/12 and 10/10: the rates where an interval's bound once fell a rounding step past the rate, which made the
    error bar negative and compare fail after its compute."""
    from batchrun.quality import wilson_interval

    extremes = {**COMPARISON, "models": [
        {**COMPARISON["models"][0], "raw": metrics(0, 12, *wilson_interval(0, 12)), "calibrated": None},
        {**COMPARISON["models"][1], "raw": metrics(10, 10, *wilson_interval(10, 10))}]}
    html = write_comparison(extremes, tmp_path / "extremes.compare.html").read_text()
    assert "0.0% (0%-24%)" in html and "100.0% (72%-100%)" in html


def test_compare_writes_its_page_beside_the_spec_and_keeps_a_users_file(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "reviews.jsonl", [
        {"id": i, "prompt": f"Review {i}: fine. Positive or negative?", "choices": ["positive", "negative"],
         "label": "positive" if i % 2 else "negative"} for i in range(4)])
    args = ["compare", spec, "--model", tiny_checkpoint("llama"), "--model", tiny_checkpoint("qwen2"), "-q",
            "--db", tmp_path / "j.db"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "reviews.compare.html").read_text().count("<svg") == 1
    mine = tmp_path / "mine.html"
    mine.write_text("my notes")
    result = invoke(*args, "--report", mine)
    assert result.exit_code == 0 and mine.read_text() == "my notes" and "not replaced" in result.stderr


def test_a_panel_shows_its_judges_and_its_own_figures(tmp_path):
    def kappa(value: float) -> dict:
        return {"value": value, "interval": [value - 0.1, value + 0.1], "rows": 60}

    panel = {"method": "mean", "rows": 60, "labelled": 60, "fleiss_kappa": kappa(0.4), "output": "/data/p.parquet",
             "judges": [{"model": "small", "job_id": "a" * 16, "accuracy": metrics(56, 60, 0.84, 0.97),
                         "kappa": kappa(0.87)},
                        {"model": "large", "job_id": "b" * 16, "accuracy": metrics(44, 60, 0.61, 0.83),
                         "kappa": None}],
             "panel": {"accuracy": metrics(51, 60, 0.74, 0.92), "kappa": kappa(0.7)}}
    html = write_comparison({**COMPARISON, "panel": panel}, tmp_path / "panel.compare.html").read_text()
    assert '<section id="panel">' in html
    for cell in ("93.3% (84%-97%)", "0.87 (0.77 to 0.97)", "73.3% (61%-83%)", "undefined", "85.0% (74%-92%)",
                 "0.70 (0.60 to 0.80)", "Fleiss&#x27; kappa between the judges 0.40 (0.30 to 0.50)", "/data/p.parquet"):
        assert cell in html, cell
    assert '<section id="panel">' not in write_comparison(COMPARISON, tmp_path / "plain.compare.html").read_text()
