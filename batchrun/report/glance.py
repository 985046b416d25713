"""Section 1, the job at a glance: what ran, how far it is, how long it took, and the plan against what was measured,
run by run (a run that died or was interrupted, and the resume after it)."""
from __future__ import annotations

from datetime import datetime
from html import escape

from batchrun.plan import format_bytes, format_duration
from batchrun.report import charts
from batchrun.report.data import ReportData
from batchrun.report.page import Section, facts, figure, note, table

STOPPED_EARLY = ("died", "interrupted", "failed")


def glance_section(data: ReportData) -> Section:
    job = data.job
    elapsed = job["elapsed_seconds"]
    parts = []
    if data.snapshot:
        why = "the job is running" if job["state"] == "running" else f"the job is {job['state']}"
        parts.append(note(f"Snapshot of {data.built_at:%Y-%m-%d %H:%M:%S} UTC while {why}: {job['rows_pending']:,} "
                          "rows are still pending and appear in no chart below; build the report again for later "
                          "rows.", "snapshot"))
    pairs = [
        ("Job", f"<code>{escape(job['id'])}</code> ({escape(job['state'])})"),
        ("Spec", f"<code>{escape(job['spec_path'])}</code>"),
        ("Model", escape(job["model"])),
        ("Mode", escape(_modes(data.runs))),
        ("Rows", f"{job['rows_done']:,} answered, {job['rows_errored']:,} errored, {job['rows_pending']:,} pending "
                 f"of {job['rows_total']:,}"),
        ("Wall time", escape(f"{format_duration(elapsed)} over {len(data.runs)} run(s)")),
        ("Passes", f"{job['passes']:,}"),
        ("Rows finished per hour", escape(_rows_per_hour(data.passes, elapsed))),
        ("Time left (ETA)", escape("none: every row is finished" if not job["rows_pending"]
                                   else format_duration(job.get("eta_seconds")))),
        ("Interruptions", escape(_interruptions(data.runs))),
    ]
    parts.append(facts(pairs))
    states = {"answered": job["rows_done"], "errored": job["rows_errored"], "pending": job["rows_pending"]}
    parts.append(figure("row-states", charts.row_states("row-states", states), "The job's rows by state."))
    parts.append(_runs_table(data))
    return Section("glance", "The job at a glance", "\n".join(parts))


def _rows_per_hour(passes: list[dict], elapsed: float) -> str:
    """What the passes finished over the job's wall time. Rows refused before any pass (invalid, too long) and answers
    taken from earlier jobs cost no compute: counted as finished, they made a job that computed nothing look fast."""
    computed = sum(one["rows_finished"] for one in passes)
    if not computed:
        return "none computed yet (no pass has finished a row)"
    return f"{computed / elapsed * 3600:,.0f}" if elapsed > 0 else "unknown"


def _modes(runs: list[dict]) -> str:
    modes = [run.get("mode") for run in runs if run.get("mode")]
    if not modes:
        return "not recorded (no run of this job has planned a pass yet)"
    distinct = list(dict.fromkeys(modes))
    return distinct[0] if len(distinct) == 1 else ", then ".join(distinct) + " (it changed between runs)"


def _interruptions(runs: list[dict]) -> str:
    if not runs:
        return "no run yet"
    ended = [run["end_state"] for run in runs]
    early = {state: ended.count(state) for state in STOPPED_EARLY if ended.count(state)}
    if not early:
        return f"none ({len(runs)} run{'s' if len(runs) > 1 else ''})"
    said = ", ".join(f"{count} {state}" for state, count in early.items())
    return f"{said}; resumed {len(runs) - 1} time{'s' if len(runs) != 2 else ''}"


def _runs_table(data: ReportData) -> str:
    """One line per run: how it ended, and its plan (pass time, peak memory) against what its passes measured."""
    if not data.runs:
        return note("No run has started yet.")
    peaks: dict[int, int] = {}
    planned: dict[int, float] = {}
    measured: dict[int, float] = {}
    for one in data.passes:
        run_no = one["run_no"]
        if one.get("peak_memory_bytes") is not None:
            peaks[run_no] = max(peaks.get(run_no, 0), one["peak_memory_bytes"])
        if one.get("planned_seconds") is not None:  # the passes the plan priced, against what they took
            planned[run_no] = planned.get(run_no, 0.0) + one["planned_seconds"]
            measured[run_no] = measured.get(run_no, 0.0) + one["seconds"]
    rows = []
    for run in data.runs:
        number = run["run_no"]
        rows.append([number, run["started_at"][:19].replace("T", " "), run["end_state"], run.get("mode") or "",
                     run.get("batch_size"), run.get("passes"), format_duration(planned.get(number)),
                     format_duration(measured.get(number)), format_duration(_run_seconds(run, data.built_at)),
                     format_bytes(run.get("planned_peak_bytes")), format_bytes(peaks.get(number)),
                     run.get("error") or ""])
    headers = ["run", "started (UTC)", "ended", "mode", "batch", "passes", "planned pass time", "measured pass time",
               "wall time", "planned peak memory", "measured peak memory", "error"]
    return (table(headers, rows, numeric=(0, 4, 5), name="runs")
            + note("Planned and measured pass time cover the same passes; wall time also counts loading the model and, "
                   "on a machine's first run, measuring its rates once. Measured peak memory is the process's peak "
                   "resident memory (device memory on CUDA) by its last recorded pass, not counting a model's "
                   "one-time conversion."))


def _run_seconds(run: dict, now: datetime) -> float | None:
    started = datetime.fromisoformat(run["started_at"])
    end = run.get("ended_at") or (None if run["end_state"] == "running" else run.get("last_active_at"))
    ended = datetime.fromisoformat(end) if end else now
    return max(0.0, (ended - started).total_seconds())
