"""The batchrun command line: thin click commands over the library. `plan`, `submit`, `compare` and `disk` are here;
the commands that read a job's record are in reading.py, `db` in database.py, `quantize` in quantize.py, the options
the job commands share in options.py, and how every command fails in failures.py."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

import batchrun
from batchrun import measure
from batchrun.distributed import submit_job
from batchrun.job import DEFAULT_SAMPLE, JobOptions, compare_models, describe_comparison, plan_report, resolve_model
from batchrun.output import describe_quality
from batchrun.plan import format_comparison, format_plan_table
from batchrun.quality import PANEL_METHODS

from batchrun.cli.database import db
from batchrun.cli.failures import FriendlyErrors
from batchrun.cli.quantize import quantize
from batchrun.cli.options import build_options, job_options, ray_options, ray_settings, spec_file, spec_format_option
from batchrun.cli.reading import jobs, report, results, status

# The command line's own imports done (the runtime loads later, on first use): a command run this soon after is a
# fresh `batchrun` process, not a test runner's or a script's, so its imports are what `submit`'s ETA counted.
IMPORTS_DONE = time.monotonic()
FRESH_COMMAND_SECONDS = 2.0


@click.group(cls=FriendlyErrors)
@click.version_option(package_name="batchrun")
def cli():
    """Run language models over batches of documents, streaming layers from disk when needed."""


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path, allow_dash=True))
@spec_format_option
@job_options
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="Answers file: .parquet, .csv, or .jsonl for OpenAI batch-output lines (default: Parquet "
                   "beside the spec).")
@click.option("--db", type=click.Path(path_type=Path), help="Progress database (default: $BATCHRUN_HOME/batchrun.db).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
@ray_options
def submit(spec, models, output, db, force, quiet, as_json, **kw):
    """Plan SPEC, run it (resuming an interrupted run of the same job), write Parquet."""
    fresh = time.monotonic() - IMPORTS_DONE < FRESH_COMMAND_SECONDS
    began = time.monotonic()
    from batchrun.job import submit as run_submit  # noqa: F401 - the runtime: torch and transformers load here
    if fresh:  # the start its ETA counted: this process's imports, the runtime's included
        measure.record_runtime_import(IMPORTS_DONE - batchrun.IMPORT_STARTED + time.monotonic() - began)
    if len(models) > 1:
        raise click.BadParameter("submit takes one --model", param_hint="--model")
    cluster = ray_settings(kw)
    options = build_options(models[0] if models else None, kw)
    spec = spec_file(spec, kw.pop("spec_format"), output_named=output is not None)

    def show_plan(plan):
        if not quiet and not as_json:
            click.echo(format_plan_table(plan.to_json()), err=True)

    summary = submit_job(spec, cluster, options=options, output=output, db=db, force=force, quiet=quiet or as_json,
                         on_plan=show_plan)
    if as_json:
        click.echo(json.dumps(summary.to_json(), indent=2))
    else:
        click.echo(f"job {summary.job_id}: {summary.rows_done} answered, {summary.rows_errored} errored "
                   f"of {summary.rows_total}; {summary.rows_computed_now} computed now in {summary.passes_now} "
                   f"pass{'' if summary.passes_now == 1 else 'es'}, {summary.seconds:.1f} s -> {summary.output}")
        for line in describe_quality(summary.quality) if summary.quality else []:
            click.echo(line)


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path, allow_dash=True))
@spec_format_option
@job_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(spec, models, as_json, **kw):
    """Validate SPEC and print what running it will cost. Reads no weights."""
    options = build_options(None, kw)
    report = plan_report(spec_file(spec, kw.pop("spec_format")), list(models) or [None], options)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    elif len(report["candidates"]) == 1:
        click.echo(format_plan_table(report))
    else:
        click.echo(format_comparison(report))
    if not any(candidate.get("fits") for candidate in report["candidates"]):
        sys.exit(1)  # scripts can tell "no model can run this job as asked" from the exit code


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path, allow_dash=True))
@spec_format_option
@job_options
@click.option("--sample", type=click.IntRange(min=1), default=DEFAULT_SAMPLE, show_default=True,
              help="Labelled rows to run on each model, stratified by label.")
@click.option("--db", type=click.Path(path_type=Path), help="Progress database (default: $BATCHRUN_HOME/batchrun.db).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option("--report", "report_path", type=click.Path(path_type=Path),
              help="Page to write: accuracy against the wait per model (default: <spec stem>.compare.html beside "
                   "the spec; an existing file is replaced only when batchrun wrote it).")
@click.option("--panel", type=click.Choice(PANEL_METHODS),
              help="Also combine the models' answers row by row: the mean of their probabilities, or a majority "
                   "vote; one --model is then enough.")
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="The panel's answers file (Parquet; default: <spec stem>.panel.parquet beside the spec).")
@click.option("--force", is_flag=True, help="Overwrite an existing panel answers file.")
def compare(spec, models, sample, db, quiet, as_json, report_path, panel, output, force, **kw):
    """Is the bigger model worth the wait? Run SPEC's labelled rows on each --model, judge them against their
    labels, and price the whole job on each by its plan. The work is stored: a later submit reuses it. With
    --panel, the models also judge as one panel, written as a file of answers."""
    options = build_options(None, kw)
    # a panel read from stdin has no directory for its answers to go beside
    spec = spec_file(spec, kw.pop("spec_format"), output_named=panel is None or output is not None)
    found = compare_models(spec, [None if name == "default" else name for name in models], options, sample=sample,
                           db=db, quiet=quiet or as_json, panel=panel, output=output, force=force).to_json()
    page = _write_comparison_page(found, report_path or spec.with_name(f"{spec.stem}.compare.html"))
    if as_json:
        click.echo(json.dumps({**found, "report": page and str(page)}, indent=2))
        return
    click.echo("\n".join(describe_comparison(found)))
    if page:
        click.echo(f"page: {page}")


def _write_comparison_page(found: dict, path: Path) -> Path | None:
    """The comparison's page, unless a file that batchrun did not write is in its place (said, not replaced)."""
    from batchrun.report import is_report, write_comparison  # matplotlib loads only here
    if path.exists() and not is_report(path):
        click.echo(f"note: {path} exists and is not a batchrun page; not replaced (--report FILE names another)",
                   err=True)
        return None
    return write_comparison(found, path, force=True)


@cli.command()
@click.option("--model", "-m", help="Checkpoint whose storage to measure (default: the default model).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurement as JSON.")
def disk(model, as_json):
    """Measure the cold read bandwidth of a checkpoint's storage; cached per filesystem."""
    checkpoint = resolve_model(model, JobOptions(model=model))
    result = measure.measure_read_bandwidth(checkpoint)
    if as_json:
        click.echo(json.dumps(result.__dict__, indent=2))
    else:
        click.echo(f"{result.bytes_per_s / 1e9:.2f} GB/s ({result.basis}): {result.how}")


for command in (status, jobs, results, report, db, quantize):  # defined beside this module
    cli.add_command(command)
