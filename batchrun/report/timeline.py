"""Section 4, the run over time: seconds per pass (reads against compute where the passes recorded their reads, the
plan's estimate beside them, each resume marked) and rows finished over wall-clock time."""
from __future__ import annotations

import math
import statistics
from datetime import datetime

from batchrun.plan import format_duration
from batchrun.report import charts
from batchrun.report.data import ReportData
from batchrun.report.page import Section, figure, note

MOST_BARS = 200  # more passes than this are drawn in groups of consecutive passes, one bar per group
MOST_POINTS_PER_RUN = 1000  # points of a run's rows-over-time line; the rest are skipped, the last always kept
STOPPED_EARLY = ("died", "interrupted", "failed")


def timeline_section(data: ReportData) -> Section:
    if not data.passes:
        body = note("No pass timings are recorded for this job yet: no pass has finished, or the job ran with a "
                    "batchrun that did not record them.")
        return Section("run", "The run", body)
    parts = [_pass_chart(data), _progress_chart(data)]
    return Section("run", "The run", "\n".join(parts))


def _pass_chart(data: ReportData) -> str:
    passes = data.passes
    group = max(1, math.ceil(len(passes) / MOST_BARS))
    starts = list(range(0, len(passes), group))
    members = [passes[start:start + group] for start in starts]
    with_reads = any(p.get("read_seconds") is not None for p in passes)
    if with_reads:
        parts = {"reads": [_mean(m, lambda p: p.get("read_seconds") or 0.0) for m in members],
                 "compute": [_mean(m, lambda p: p["seconds"] - (p.get("read_seconds") or 0.0)) for m in members]}
    else:
        parts = {"seconds": [_mean(m, lambda p: p["seconds"]) for m in members]}
    planned = [_mean(m, lambda p: p["planned_seconds"]) if all(p.get("planned_seconds") is not None for p in m)
               else None for m in members]
    first_of_run: dict[int, int] = {}
    for ordinal, one in enumerate(passes, start=1):
        first_of_run.setdefault(one["run_no"], ordinal)
    resumes = [(ordinal, f"run {run_no}") for run_no, ordinal in first_of_run.items() if ordinal > 1]
    centres = [start + 1 + (len(m) - 1) / 2 for start, m in zip(starts, members)]  # passes numbered from 1
    svg = charts.pass_seconds("pass-seconds", centres, parts, planned=planned,
                              resumes=resumes, width=group,
                              xlabel="pass (in the order they ran)" + (f", bars of {group}" if group > 1 else ""))
    seconds = [p["seconds"] for p in passes]
    slowest = max(passes, key=lambda p: p["seconds"])
    caption = (f"{len(passes):,} passes: median {format_duration(statistics.median(seconds))}, slowest "
               f"{format_duration(slowest['seconds'])} (pass {slowest['pass_no']} of run {slowest['run_no']}).")
    if group > 1:
        caption += f" Each bar is the mean of {group} consecutive passes."
    if not with_reads:
        caption += " Reads and compute are not told apart: these passes recorded no read time."
    if resumes:
        caption += " Dashed lines: where a run resumed the job."
    return figure("pass-seconds", svg, caption)


def _progress_chart(data: ReportData) -> str:
    finished_total = data.job["rows_done"] + data.job["rows_errored"]
    # Rows finished outside any pass (answers reused from other jobs, rows refused before the first pass) count
    # from the start.
    count = finished_total - sum(p["rows_finished"] for p in data.passes)
    runs = {run["run_no"]: run for run in data.runs}
    lines = []
    for run_no in dict.fromkeys(p["run_no"] for p in data.passes):
        own = [p for p in data.passes if p["run_no"] == run_no]
        start = runs.get(run_no, {}).get("started_at") or own[0]["finished_at"]
        times, finished = [datetime.fromisoformat(start)], [count]
        step = max(1, math.ceil(len(own) / MOST_POINTS_PER_RUN))
        for number, one in enumerate(own):
            count += one["rows_finished"]
            if number % step == 0 or number == len(own) - 1:
                times.append(datetime.fromisoformat(one["finished_at"]))
                finished.append(count)
        lines.append((f"run {run_no}", times, finished))
    stops = [(datetime.fromisoformat(run.get("ended_at") or run.get("last_active_at") or run["started_at"]),
              f"run {run['run_no']} {run['end_state']}") for run in data.runs if run["end_state"] in STOPPED_EARLY]
    svg = charts.progress("progress", lines, stops=stops, total=data.job["rows_total"])
    caption = f"{finished_total:,} of {data.job['rows_total']:,} rows finished (dotted line: all rows)."
    if stops:
        caption += " Dashed lines: where a run stopped before the job was done."
    return figure("progress", svg, caption)


def _mean(members: list[dict], value) -> float:
    return sum(value(member) for member in members) / len(members)
