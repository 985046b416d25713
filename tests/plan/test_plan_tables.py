"""The plan as people read it: durations and sizes, the JSON report, the table and the comparison of modes."""
from __future__ import annotations

import json
from dataclasses import asdict, fields

import pytest

from batchrun.plan import format_bytes, format_comparison, format_duration, format_plan_table
from batchrun.plan.planner import compare_modes
from tests.support import LLAMA_70B, MIXED, GiB, plan, records


@pytest.mark.parametrize("seconds, text", [
    (2.46, "2.5 s"), (42, "42 s"), (180, "3 min"), (3.4 * 3600, "3.4 h"), (2.3 * 86400, "2.3 days"),
    (None, "unknown"), (0, "0 s"), (0.0012, "1.2 ms"), (0.035, "35 ms"), (0.5, "500 ms"),
])
def test_durations_read_the_way_people_say_them(seconds, text):
    assert format_duration(seconds) == text


def test_bytes_read_in_binary_units():
    assert [format_bytes(n) for n in (512, 1.25 * GiB, 131 * GiB)] == ["512 B", "1.25 GiB", "131 GiB"]


def test_plan_json_is_serialisable_and_omits_row_indices():
    report = plan(rows=MIXED, streaming="always").to_json()
    assert json.loads(json.dumps(report))["batch_count"] == 2
    assert "batches" not in report and report["fits"] is True and report["eta_human"].endswith(("min", "h", "s"))


def test_plan_json_flattens_the_candidates_groups_into_one_record():
    candidate = plan(rows=MIXED, streaming="always", pass_seconds=600)
    groups = ("checkpoint", "memory", "batching", "time", "bound")
    grouped = [f.name for group in groups for f in fields(getattr(candidate, group))]
    top = [f.name for f in fields(candidate) if f.name not in groups]
    assert len(set(grouped + top)) == len(grouped + top)  # no figure hides another once flattened
    report = candidate.to_json()
    assert set(report) == set(grouped + top) - {"batches", "pass_seconds"} | {"batch_count", "fits", "eta_human"}
    for group in groups:
        for name, value in asdict(getattr(candidate, group)).items():
            assert name in ("batches", "pass_seconds") or report[name] == value, name


def test_plan_table_and_comparison_show_mode_memory_eta_and_blockers():
    request, rates, job = records(runtime_overhead_bytes=0)
    candidates = compare_modes(LLAMA_70B, MIXED, request, rates, **job)
    assert [(c.mode, c.prefetch) for c in candidates] == [("resident", True), ("streamed", True),
                                                           ("streamed", False)]
    table = format_plan_table(candidates[1].to_json())
    assert "streaming forced" in table and format_bytes(candidates[1].memory.peak_memory_bytes) in table
    assert candidates[1].eta_human in table
    comparison = format_comparison(candidates)
    assert "streamed (no prefetch)" in comparison and "resident blockers:" in comparison
    assert "resident run does not fit" in comparison
