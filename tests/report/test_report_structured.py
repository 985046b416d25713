"""The report's structured answers section, drawn from the output's own figures for a handful of structured rows:
valid, invalid and cut counts, each field's accuracy with its interval and enum confusion counts, the rows the
grammar forced hardest with their prompts; a job without structured rows has no such section."""
from __future__ import annotations

import re
from dataclasses import replace
from datetime import datetime, timezone

from batchrun.output import JobAnswers, output_rows, quality, results_table
from batchrun.quality import Calibration
from batchrun.report import ReportData, Rows, render_report
from tests.report.test_report_data import job_status, table_rows
from tests.support import answer, write_jsonl

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["refund", "delay"]}, "n": {"type": "integer"}},
          "required": ["kind", "n"]}


def structured(idx: int, text: str, label: str, overrides: int = 0, lowest: float = -0.5, **changes):
    return replace(answer(idx, f"r{idx}", text), structure={"json_schema": SCHEMA}, label=label,
                   grammar={"overrides": overrides, "forced": 4, "lowest_logprob": lowest}, **changes)


def report_of(results, tmp_path) -> dict[str, str]:
    """Each section's HTML of the report of `results`, with a spec giving each row the prompt "Ticket <idx>"."""
    spec = write_jsonl(tmp_path / "tickets.jsonl", [{"id": r.id, "prompt": f"Ticket {r.idx}"} for r in results])
    rows = output_rows(results)
    data = ReportData(job=job_status(rows_total=len(results), rows_done=len(results), spec_path=str(spec),
                                     created_at=datetime.now(timezone.utc).isoformat()), runs=[], passes=[],
                      rows=Rows.from_table(results_table(rows)),
                      quality=quality(JobAnswers(rows, Calibration("none"), len(rows))))
    return dict(re.findall(r'<section id="([a-z]+)">(.*?)</section>', render_report(data), re.S))


def test_structured_rows_show_their_counts_field_accuracy_confusion_and_the_rows_forced_hardest(tmp_path):
    results = [structured(0, '{"kind": "refund", "n": 1}', '{"kind": "refund", "n": 1}'),
               structured(1, '{"kind": "delay", "n": 1}', '{"kind": "refund", "n": 1}', overrides=3, lowest=-6.5),
               structured(2, '{"kind": "refund", "n": "x"}', '{"kind": "refund", "n": 2}', overrides=1,
                          lowest=-2.25),
               structured(3, '{"kind": "del', '{"kind": "delay", "n": 4}', overrides=5, lowest=-9.0,
                          finish_reason="length"),
               answer(4, "r4", "plain text")]
    sections = report_of(results, tmp_path)
    assert list(sections) == ["glance", "answers", "labels", "structured", "run", "errors"]
    assert "scored field by field under Structured answers" in sections["labels"]
    html = sections["structured"]
    assert [line[:3] for line in table_rows(html, "structured-counts")] == [
        ["Valid", "2", "50.0%"], ["Invalid", "1", "25.0%"], ["Cut", "1", "25.0%"]]
    fields = {line[0]: line[1:] for line in table_rows(html, "field-accuracy")}
    # the whole value: r0 only; /kind: r0 and r2; /n: r0 and r1 (r2's "x" and the cut r3 wrong)
    assert [fields[name][0::2] for name in ("(whole value)", "/kind", "/n")] == [
        ["25.0%", "1 of 4"], ["50.0%", "2 of 4"], ["50.0%", "2 of 4"]]
    assert fields["/kind"][1] == "15.0% to 85.0%"  # Wilson's 95% interval of 2 of 4
    assert table_rows(html, "field-confusion") == [
        ["/kind", "delay", "(missing)", "1"], ["/kind", "refund", "refund", "2"], ["/kind", "refund", "delay", "1"]]
    assert table_rows(html, "forced-hardest") == [
        ["r3", "Ticket 3", "5", "-9.00"], ["r1", "Ticket 1", "3", "-6.50"], ["r2", "Ticket 2", "1", "-2.25"]]


def test_a_job_without_structured_rows_has_no_structured_section(tmp_path):
    sections = report_of([answer(0, "r0", "yes"), answer(1, "r1", "no")], tmp_path)
    assert "structured" not in sections
    assert "structured-counts" not in "".join(sections.values())
