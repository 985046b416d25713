"""The commands that read a job's record: `status`, `jobs`, `results` and `report`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from batchrun.distributed import job_shards, shards_line
from batchrun.host import default_db_path
from batchrun.output import (check_output_writable, describe_calibration, describe_quality, encode_results,
                             job_answers, job_provenance, job_quality, output_format, write_results)
from batchrun.plan import format_duration
from batchrun.store import JobNotFound, Store

DB_HELP = "Progress database (default: $BATCHRUN_HOME/batchrun.db)."


def _existing_store(db: Path | None):
    """The progress database to read from; a missing one is an error, not a new empty file."""
    path = db or default_db_path(create=False)  # reading makes no state directory either
    if not Path(path).exists():
        raise JobNotFound(f"no jobs recorded in {path} yet (no database there)")
    return Store(path)


@click.command()
@click.argument("job", required=False)
@click.option("--db", type=click.Path(path_type=Path), help=DB_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the job's progress and quality as JSON.")
def status(job, db, as_json):
    """Progress of JOB (default: the one run last), also while it runs elsewhere."""
    store = _existing_store(db)
    try:
        info = store.status(store.find_job(job))
        info["quality"] = _quality_if_any(store, info["id"])
        info["shards"] = job_shards(store.path, info["id"])  # a job run on a Ray cluster
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    lost = (f", {info['rows_lost']} lost (computed when its spec is submitted again)" if info.get("rows_lost")
            else "")
    if info["rows_pending"] == 0 and not lost:
        eta = "none, every row is finished"
    else:
        eta = format_duration(info["eta_seconds"]) if info.get("eta_seconds") else "unknown"
    running = f" (running as pid {info['running_pid']})" if info.get("running_pid") else ""
    click.echo(f"job {info['id']}: {info['state']}{running}\n"
               f"  model    {info['model']}\n  spec     {info['spec_path']}\n"
               f"  rows     {info['rows_done']} done, {info['rows_errored']} errored, {info['rows_pending']} pending"
               f"{lost} of {info['rows_total']}\n"
               f"  partial  {info['partial_tokens']} tokens generated in {info['partial_rows']} unfinished rows "
               f"(kept on resume)\n"
               f"  passes   {info['passes']}\n  elapsed  {format_duration(info['elapsed_seconds'])}\n  eta      {eta}"
               + (f"\n  shards   {shards_line(info['shards'])}" if info.get("shards") else "")
               + (f"\n  failed   {info['last_error']}" if info.get("last_error") else ""))
    if info.get("in_pass"):  # a pass commits nothing until it ends: how far the one in flight is
        now = info["in_pass"]
        click.echo(f"  in pass  {now['pass']} of {now['passes_planned']}: {now['turns_done'] / now['turns_total']:.0%} "
                   f"of its layer turns, {now['rows_in_flight']:,} rows in flight, running "
                   f"{format_duration(now['seconds_in_pass'])}")
    for line in describe_quality(info["quality"]) if info["quality"] else []:
        click.echo("  " + line)


def _quality_if_any(store: Store, job_id: str) -> dict | None:
    """Accuracy so far, the structured answers' validity and the calibration, for a job with labelled or
    structured rows or a calibration."""
    found = job_quality(store, job_id)
    has_labels = (found["choice"] or found["generation"] or found["labelled_errored"] or found.get("pairs")
                  or found.get("structured"))
    return found if has_labels or found["calibration"]["method"] != "none" else None


@click.command()
@click.option("--db", type=click.Path(path_type=Path), help=DB_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as a JSON list.")
def jobs(db, as_json):
    """List jobs, newest first."""
    if db is not None and not Path(db).exists():  # a mistyped --db is said so, not listed as empty
        raise JobNotFound(f"no database at {db}")
    path = db or default_db_path(create=False)
    if not Path(path).exists():  # a look at the jobs creates no database
        click.echo("[]" if as_json else "no jobs yet")
        return
    store = Store(path)
    try:
        listing = store.jobs()
    finally:
        store.close()
    damaged = [job for job in listing if job["state"] == "damaged"]
    if damaged:  # the others are listed; these say why not, once
        click.echo(f"Warning: {len(damaged)} job(s) cannot be read: {damaged[0]['last_error']}", err=True)
    if as_json:
        click.echo(json.dumps(listing, indent=2, default=str))
        return
    if not listing:
        click.echo("no jobs yet")
        return
    created_width = max(len(str(job["created_at"])) for job in listing)
    click.echo(f"{'JOB':<16}  {'STATE':<11} {'DONE':>6}/{'ROWS':<6} {'CREATED':<{created_width}}  MODEL  SPEC")
    for job in listing:
        done = "?" if job["rows_done"] is None else job["rows_done"]
        click.echo(f"{job['id']}  {job['state']:<11} {done:>6}/{job['rows_total']:<6} "
                   f"{job['created_at']:<{created_width}}  {job['model']}  {job['spec_path']}")


@click.command()
@click.argument("job", required=False)
@click.option("--output", "-o", type=click.Path(path_type=Path, allow_dash=True), required=True,
              help="File to write, or - for stdout.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "csv", "jsonl"]),
              help="Default: from the extension (.parquet, .pq; .csv; .jsonl, .ndjson, .json); jsonl for -o -.")
@click.option("--db", type=click.Path(path_type=Path), help=DB_HELP)
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary of what was written.")
def results(job, output, fmt, db, force, as_json):
    """Export JOB's answers so far (partial while it runs): Parquet (with the job's provenance in its metadata), CSV,
    or OpenAI batch-output JSONL; to a file or to stdout."""
    to_stdout = str(output) == "-"
    if to_stdout and as_json:
        raise click.UsageError("--json prints its summary on stdout, where -o - writes the answers; write them to a "
                               "file, or leave out --json")
    store = _existing_store(db)
    try:
        job_id = store.find_job(job)
        answers = job_answers(store, job_id)
        provenance = job_provenance(store, job_id)
    finally:
        store.close()
    if to_stdout:
        fmt = fmt or "jsonl"
        if fmt == "parquet" and sys.stdout.isatty():
            raise click.UsageError("Parquet is binary and stdout is a terminal: redirect it (> answers.parquet, or a "
                                   "pipe), or give --format csv or jsonl")
        data = encode_results(answers.rows, fmt, model=provenance.model, provenance=provenance)
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        where, size = "-", data.nbytes
    else:
        spec_path = Path(provenance.spec_path)  # stored absolute now; an older job's relative one names no directory
        check_output_writable(output, spec_path if spec_path.is_absolute() else None, store.path)
        fmt = output_format(output, fmt, format_option=True)
        path = write_results(output, answers.rows, fmt, model=provenance.model, force=force, provenance=provenance)
        where, size = str(path), path.stat().st_size
    notes = describe_calibration(answers.calibration) + answers.notes
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "output": where, "format": fmt, "rows": len(answers.rows),
                               "rows_total": answers.rows_total, "bytes": size, "notes": notes}, indent=2))
    else:
        click.echo(f"{len(answers.rows)} rows -> {'stdout' if to_stdout else where}", err=to_stdout)
    for line in notes:
        click.echo(f"note: {line}", err=True)


@click.command()
@click.argument("job", required=False)
@click.option("--db", type=click.Path(path_type=Path), help=DB_HELP)
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="HTML file to write (default: <spec stem>.report.html beside the spec).")
@click.option("--force", is_flag=True,
              help="Overwrite an existing file that is not a batchrun report (a report is replaced anyway).")
@click.option("--json", "as_json", is_flag=True, help="Print the job and the page written as JSON.")
def report(job, db, output, force, as_json):
    """Write JOB's report (default: the one run last): one offline HTML file of its progress, answers, accuracy
    against labels, passes and errors; a snapshot while it runs."""
    from batchrun.report import default_report_path, is_report, write_report  # matplotlib loads only here
    store = _existing_store(db)
    try:
        job_id = store.find_job(job)
        spec_path = Path(store.status(job_id)["spec_path"])
        if output is None and not spec_path.is_absolute():
            raise click.UsageError(f"job {job_id} names its spec by a relative path ({spec_path}), so where it lies "
                                   "is unknown; name the report file with -o")
        output = output or default_report_path(spec_path)
        check_output_writable(output, spec_path if spec_path.is_absolute() else None, store.path)
        # A report batchrun wrote (every submit writes one there) is replaced, as submit replaces it; a file
        # batchrun did not write is the user's, replaced only with --force.
        path = write_report(store, job_id, output, force=force or is_report(output))
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "report": str(path)}, indent=2))
    else:
        click.echo(f"report of job {job_id} -> {path}")
