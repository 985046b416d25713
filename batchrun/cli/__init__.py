"""The batchrun command line: thin click commands over the library."""
from __future__ import annotations

import json
import math
import re
import signal
import sys
from pathlib import Path

import click

from batchrun import measure
from batchrun.distributed import RayRefusals, RaySettings, cluster_settings, job_shards, shards_line, submit_job
from batchrun.errors import user_errors
from batchrun.host import (Stopped, default_db_path, one_line, redacted, save_traceback, secrets_in,
                           stop_signals_unwind, stored_spec)
from batchrun.job import (CALIBRATION_METHODS, DEFAULT_CALIBRATION, DEFAULT_PASS_MINUTES, DEFAULT_SAMPLE, JobOptions,
                          compare_models, describe_comparison, plan_report, resolve_model)
from batchrun.output import (check_output_writable, describe_calibration, describe_quality, encode_results,
                             job_answers, job_provenance, job_quality, output_format, write_results)
from batchrun.plan import TOKEN_MATRIX_CHOICES, format_comparison, format_duration, format_plan_table, parse_streaming
from batchrun.spec import TRUNCATE_SIDES, SpecError, kind
from batchrun.store import JobNotFound, Store, check_database, describe_check, salvage_database


def _choices_option(value: str | None) -> tuple[str, ...] | None:
    """--choices: comma-separated labels, stripped ("yes, no"), or a JSON array of exact strings, for what the comma
    form cannot say: a leading space (" positive", as raw prompts need) or a comma ("1,000")."""
    if value is None:
        return None
    if value.lstrip().startswith("["):
        return _choices_array(value)
    items = tuple(v.strip() for v in value.split(","))
    if not all(items):
        raise click.BadParameter(f"{value!r} has an empty item", param_hint="--choices")
    return items


def _choices_array(value: str) -> tuple[str, ...]:
    def refuse(reason: str):
        return click.BadParameter(f"{value!r}: {reason}", param_hint="--choices")

    try:
        items = json.loads(value)
    except (ValueError, RecursionError) as error:
        raise refuse(f"not a valid JSON array ({getattr(error, 'msg', error)}); write it as "
                     '\'[" positive", " negative"]\'') from None
    if not isinstance(items, list):
        raise refuse("not a JSON array of strings")
    if not items:
        raise refuse("the array is empty; give at least one choice")
    for number, item in enumerate(items, start=1):
        if not isinstance(item, str):
            raise refuse(f"item {number} is {kind(item)}, not a string")
        if not item:
            raise refuse(f"item {number} is empty")
    return tuple(items)


_STOP_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _stop_string(value: str) -> str:
    """A stop string typed in a shell: \\n, \\t, \\r mean newline, tab, carriage return and \\\\ one backslash, as in
    a JSON spec; `--stop "\\n"` would otherwise wait for a backslash followed by n, and never stop. Other backslashes
    stay as typed. Only stop strings: a template or system message keeps its backslashes (LaTeX, Windows paths)."""
    return re.sub(r"\\(.)", lambda m: _STOP_ESCAPES.get(m.group(1), m.group(0)), value)


def _warn_typed_newline(option: str, value: str | None) -> None:
    if value is not None and "\\n" in value:
        click.echo(f"Warning: {option} holds a backslash followed by n, kept as typed; for a line break type a real "
                   "newline (in bash: $'...\\n...')", err=True)


class PositiveNumber(click.FloatRange):
    """A number above 0 that is finite: `inf` GB or minutes is no budget at all, and the plan counts in integers."""

    def __init__(self):
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number; give a number above 0", param, ctx)
        return number


POSITIVE_NUMBER = PositiveNumber()


def job_options(fn):
    """Options shared by `plan` and `submit` (spec shaping, model, resources)."""
    decorators = [
        click.option("--model", "-m", "models", multiple=True,
                     help="Checkpoint directory or Hugging Face repo id (default: SmolLM2-135M-Instruct, also "
                          "named `default`). `plan` accepts several to compare."),
        click.option("--template", help='Corpus mode: build prompts from columns, e.g. "Review: {text}".'),
        click.option("--id-column", help="Column holding row ids in corpus mode."),
        click.option("--label-column", help="Column holding each row's expected answer in corpus mode (accuracy, "
                                            "calibration fitted on labels)."),
        click.option("--keep-columns", help="Corpus mode: input columns to copy into the output, comma-separated, "
                                            "or '*' for all."),
        click.option("--calibrate", type=click.Choice(CALIBRATION_METHODS), default=DEFAULT_CALIBRATION,
                     show_default=True, help="Calibrate choice probabilities: batch (the job's own rows), "
                                             "content-free (corpus mode), labels (fitted on labelled rows); "
                                             "docs/calibration.md."),
        click.option("--choices", help='Choices for rows that set none: comma-separated (yes,no), or a JSON array for '
                                        'exact strings (\'[" positive", "1,000"]\').'),
        click.option("--system", help="System message for rows that set none."),
        click.option("--max-new-tokens", type=int, default=16, show_default=True,
                     help="Token limit for generation rows that set none."),
        click.option("--stop", multiple=True,
                     help='Stop string for generation rows (repeatable; "\\n", "\\t", "\\\\" as in JSON).'),
        click.option("--raw", is_flag=True, help="Send prompts as plain text, without the chat template."),
        click.option("--skip-invalid", is_flag=True, help="Record bad rows as errors and run the rest."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                     show_default=True, help="Compute dtype (auto: half on accelerators; on a CPU a bfloat16 "
                                             "checkpoint's own bfloat16 where the CPU has bfloat16 units, else "
                                             "float32)."),
        click.option("--device", help="cuda, mps or cpu (default: the best available)."),
        click.option("--batch-size", type=click.IntRange(min=1), help="Override the planned sequences per pass."),
        click.option("--memory", "memory_gb", type=POSITIVE_NUMBER,
                     help="Memory budget in GB (default: what the device has available)."),
        click.option("--streaming", help="auto|always|never (also yes/no/on/off/1/0); env BATCHRUN_STREAMING."),
        click.option("--no-prefetch", is_flag=True, help="Do not read the next layer while one computes."),
        click.option("--prefetch-depth", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Layers read ahead of the one computing (each holds a layer in memory)."),
        click.option("--token-matrices", type=click.Choice(TOKEN_MATRIX_CHOICES), default="auto", show_default=True,
                     help="Where a streamed run keeps the embedding and LM head: held in memory, gathered (a "
                          "pass's embedding rows read by token id), or streamed (the head read each pass too); auto "
                          "weighs them against the sequences a pass can carry."),
        click.option("--micro-batch", type=click.IntRange(min=1),
                     help="Sequences per prefill or choice-scoring forward call within a pass (default: planned from "
                          "memory); decode calls keep the plan's size."),
        click.option("--pass-minutes", type=POSITIVE_NUMBER, default=DEFAULT_PASS_MINUTES,
                     show_default=True, help="Plan passes to last at most this long: a crash or kill loses at most "
                                             "the pass in flight."),
        click.option("--truncate", type=click.Choice(TRUNCATE_SIDES),
                     help="Cut an over-long row's document (a prompt row's text, a template's fields) from its head "
                          "or tail to fit the context, counted in the truncated_tokens column (default: the row "
                          "fails)."),
        click.option("--bandwidth", "bandwidth_gbps", type=POSITIVE_NUMBER,
                     help="Declare the disk read bandwidth in GB/s instead of measuring it."),
        click.option("--trust-remote-code", is_flag=True, help="Allow a checkpoint's own Python code."),
        click.option("--hf-token", envvar="HF_TOKEN", help="Hugging Face token (or HF_TOKEN).", show_envvar=True),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def build_options(model: str | None, kw: dict):
    try:
        parse_streaming(kw["streaming"])
    except ValueError as exc:
        raise click.BadParameter(str(exc))  # the message already names --streaming (or the env variable)
    _warn_typed_newline("--template", kw["template"])
    _warn_typed_newline("--system", kw["system"])
    keep = kw["keep_columns"]
    return JobOptions(model=model, template=kw["template"], id_column=kw["id_column"],
                      label_column=kw["label_column"], calibrate=kw["calibrate"],
                      keep_columns=tuple(name.strip() for name in keep.split(",") if name.strip()) if keep else None,
                      choices=_choices_option(kw["choices"]), system=kw["system"],
                      max_new_tokens=kw["max_new_tokens"], stop=tuple(_stop_string(s) for s in kw["stop"]) or None,
                      raw=kw["raw"], dtype=kw["dtype"],
                      skip_invalid=kw["skip_invalid"], device=kw["device"], batch_size=kw["batch_size"],
                      memory_gb=kw["memory_gb"], streaming=kw["streaming"], prefetch=not kw["no_prefetch"],
                      prefetch_depth=kw["prefetch_depth"], micro_batch=kw["micro_batch"],
                      bandwidth_gbps=kw["bandwidth_gbps"], hf_token=kw["hf_token"],
                      trust_remote_code=kw["trust_remote_code"], pass_minutes=kw["pass_minutes"],
                      truncate=kw["truncate"], token_matrices=kw["token_matrices"])


STDIN_SPEC = "-"
# A spec read from stdin is kept under $BATCHRUN_HOME/specs, named by its bytes' hash, so the same input piped again
# is the same file and resumes the same job. Compressed input is kept compressed and named for it (read as such).
_STDIN_SUFFIXES = {"jsonl": ".jsonl", "csv": ".csv", "tsv": ".tsv", "parquet": ".parquet"}
_COMPRESSED_INPUT = ((rb"\x1f\x8b", ".gz"), (rb"\x28\xb5\x2f\xfd", ".zst"), (rb"BZh[1-9]1AY&SY", ".bz2"),
                     (rb"\xfd7zXZ\x00", ".xz"))
spec_format_option = click.option(
    "--spec-format", type=click.Choice(list(_STDIN_SUFFIXES)),
    help="Format of a spec read from stdin (SPEC `-`): jsonl (default), csv, tsv or parquet; gzip, zstd, bzip2 "
         "and xz input is recognised. A file's name says its own.")


def spec_file(spec: Path, spec_format: str | None, *, output_named: bool = True) -> Path:
    """SPEC as a file: itself, or for `-` stdin's bytes stored as a spec file. Such a spec has no directory for its
    answers to go beside, so `output_named=False` (submit without -o) refuses it before stdin is read."""
    if str(spec) != STDIN_SPEC:
        if spec_format is not None:
            raise click.BadParameter("applies to a spec read from stdin (SPEC -); a file's name says its format",
                                     param_hint="--spec-format")
        return spec
    if not output_named:
        raise click.UsageError("a spec read from stdin (-) has no directory to write its answers beside; name the "
                               "answers file with -o (answers.parquet, or answers.jsonl)")
    stream = sys.stdin.buffer
    if stream.isatty():
        raise click.UsageError("SPEC is - but stdin is a terminal; pipe the spec in (batchrun plan - < jobs.jsonl)")
    data = stream.read()
    if not data:
        raise SpecError(["stdin: empty (no requests)"])
    suffix = _STDIN_SUFFIXES[spec_format or "jsonl"]
    if suffix != ".parquet":  # Parquet compresses its own columns
        suffix += next((name for magic, name in _COMPRESSED_INPUT if re.match(magic, data)), "")
    return stored_spec(data, "stdin", suffix)


_COMMAND_KEY = "batchrun.command"  # ctx.meta: the subcommand named and the arguments it was given


def ray_options(fn):
    """`submit`'s options for running the job on a Ray cluster (docs/distributed.md)."""
    decorators = [
        click.option("--ray", "ray_address", metavar="ADDRESS",
                     help="Run the job on a Ray cluster: auto, HOST:PORT, or local (one machine); needs --shared "
                          "(pip install 'batchrun[ray]')."),
        click.option("--shared", type=click.Path(path_type=Path, file_okay=False),
                     help="With --ray: a directory every node sees at the same path; shards publish answers there."),
        click.option("--shard-rows", type=click.IntRange(min=1),
                     help="With --ray: rows per shard (default: from the job's size, its batches and the nodes)."),
        click.option("--snapshot-every", type=click.FloatRange(min=0, min_open=True), default=300.0,
                     show_default=True,
                     help="With --ray: seconds between copies of a running shard's progress to --shared."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


_RAY_REFUSALS = RayRefusals(click.UsageError,
                            "--shared and --shard-rows apply to a run on a Ray cluster: add --ray ADDRESS",
                            "--ray needs --shared DIR: a directory every node sees at the same path")


def ray_settings(kw: dict) -> RaySettings | None:
    """The --ray options (taken out of kw) as RaySettings, or None for a run on this machine."""
    return cluster_settings(kw.pop("ray_address"), kw.pop("shared"), _RAY_REFUSALS, shard_rows=kw.pop("shard_rows"),
                            snapshot_every_s=kw.pop("snapshot_every"))


class FriendlyErrors(click.Group):
    """Every failure ends in one `Error:` line, never a traceback: a foreseen one (a BatchrunError) says what to do;
    any other is a fault in batchrun, said as such, its traceback kept in a log file the line names. A command given
    --json also prints one JSON object on stdout when it fails ({"error", "kind", "exit_code"}, and "log" for an
    unforeseen failure), so a script always has something to parse."""

    def resolve_command(self, ctx, args):
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[_COMMAND_KEY] = (name, command, list(rest))  # a copy: parsing consumes the list it is given
        return name, command, rest

    def invoke(self, ctx):
        try:
            with stop_signals_unwind():
                return super().invoke(ctx)
        except user_errors() as exc:
            _json_failure(ctx, str(exc), type(exc).__name__, 1)
            click.echo(f"Error: {exc}", err=True)
            sys.exit(1)
        except (click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise  # click's own ways out: --help, an aborted prompt, a reader that closed the pipe
        except click.ClickException as exc:  # a usage error: click prints it and exits 2
            _json_failure(ctx, exc.format_message(), "usage", exc.exit_code)
            raise
        except KeyboardInterrupt as exc:
            resume = ("; committed passes are kept: run the same command again to resume"
                      if ctx.invoked_subcommand == "submit" else "")
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            how = "Interrupted" if signum == signal.SIGINT else f"Stopped by {signal.Signals(signum).name}"
            _json_failure(ctx, f"{how}{resume}", "interrupted", 128 + signum)
            click.echo(f"\n{how}{resume}.", err=True)
            sys.exit(128 + signum)  # the shell's code for a command ended by that signal (130 for Ctrl-C)
        except Exception as exc:  # noqa: BLE001 - unforeseen: said in one line, its traceback kept in a file
            secrets = secrets_in(ctx.meta.get(_COMMAND_KEY, (None, None, []))[2])
            log = save_traceback(exc, secrets)
            message = redacted(_unforeseen_message(exc, log, ctx.invoked_subcommand), secrets)
            _json_failure(ctx, message, "internal", 1, log=log and str(log))
            click.echo(f"Error: {message}", err=True)
            sys.exit(1)


def _unforeseen_message(error: Exception, log: Path | None, command: str | None) -> str:
    said = one_line(str(error))
    where = f"its traceback is in {log}, which a bug report should include" if log else \
        "its traceback could not be written: no writable directory"
    message = f"unexpected {type(error).__name__}{f': {said}' if said else ''} (a fault in batchrun; {where})"
    if command in ("submit", "compare"):
        message += ". Answers committed before the failure are kept"
    return message


def _json_failure(ctx: click.Context, message: str, kind: str, exit_code: int, **extra) -> None:
    if _wants_json(ctx):
        click.echo(json.dumps({"error": message, "kind": kind, "exit_code": exit_code, **extra}))


def _wants_json(ctx: click.Context) -> bool:
    """Whether the command that failed was given --json, read again from its arguments: a failure may come before
    or while click parses them, and an unknown option before --json must not hide it."""
    name, command, args = ctx.meta.get(_COMMAND_KEY, (None, None, []))
    while isinstance(command, click.Group) and args:  # `db check --json`
        name, command, args = args[0], command.get_command(ctx, args[0]), args[1:]
    if command is None or not any(param.name == "as_json" for param in command.params):
        return False
    try:
        parsed = command.make_context(name, list(args), parent=ctx, resilient_parsing=True,
                                      ignore_unknown_options=True)
    except click.ClickException:
        return "--json" in args
    return bool(parsed.params.get("as_json"))


@click.group(cls=FriendlyErrors)
@click.version_option(package_name="batchrun")
def cli():
    """Run language models over batches of documents, streaming layers from disk when needed."""


@cli.command()
@click.argument("spec", type=click.Path(path_type=Path, allow_dash=True))
@spec_format_option
@job_options
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="Answers file: .parquet, or .jsonl for OpenAI batch-output lines (default: Parquet beside "
                   "the spec).")
@click.option("--db", type=click.Path(path_type=Path), help="Progress database (default: $BATCHRUN_HOME/batchrun.db).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary at the end.")
@ray_options
def submit(spec, models, output, db, force, quiet, as_json, **kw):
    """Plan SPEC, run it (resuming an interrupted run of the same job), write Parquet."""
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
def compare(spec, models, sample, db, quiet, as_json, report_path, **kw):
    """Is the bigger model worth the wait? Run SPEC's labelled rows on each --model, judge them against their
    labels, and price the whole job on each by its plan. The work is stored: a later submit reuses it."""
    options = build_options(None, kw)
    spec = spec_file(spec, kw.pop("spec_format"))
    found = compare_models(spec, [None if name == "default" else name for name in models], options, sample=sample,
                           db=db, quiet=quiet or as_json).to_json()
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


def _existing_store(db: Path | None):
    """The progress database to read from; a missing one is an error, not a new empty file."""
    path = db or default_db_path(create=False)  # reading makes no state directory either
    if not Path(path).exists():
        raise JobNotFound(f"no jobs recorded in {path} yet (no database there)")
    return Store(path)


@cli.command()
@click.argument("job", required=False)
@click.option("--db", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
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
    """Accuracy so far and the calibration, for a job with labelled rows or a calibration."""
    found = job_quality(store, job_id)
    has_labels = found["choice"] or found["generation"] or found["labelled_errored"]
    return found if has_labels or found["calibration"]["method"] != "none" else None


@cli.command()
@click.option("--db", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
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


@cli.command()
@click.argument("job", required=False)
@click.option("--output", "-o", type=click.Path(path_type=Path, allow_dash=True), required=True,
              help="File to write, or - for stdout.")
@click.option("--format", "fmt", type=click.Choice(["parquet", "csv", "jsonl"]),
              help="Default: from the extension (.parquet, .pq; .csv; .jsonl, .ndjson, .json); jsonl for -o -.")
@click.option("--db", type=click.Path(path_type=Path))
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


@cli.command()
@click.argument("job", required=False)
@click.option("--db", type=click.Path(path_type=Path))
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="HTML file to write (default: SPEC-STEM.report.html beside the spec).")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
@click.option("--json", "as_json", is_flag=True, help="Print the job and the page written as JSON.")
def report(job, db, output, force, as_json):
    """Write JOB's report (default: the one run last): one offline HTML file of its progress, answers, accuracy
    against labels, passes and errors; a snapshot while it runs."""
    from batchrun.report import default_report_path, write_report  # matplotlib loads only for this command
    store = _existing_store(db)
    try:
        job_id = store.find_job(job)
        spec_path = Path(store.status(job_id)["spec_path"])
        if output is None and not spec_path.is_absolute():
            raise click.UsageError(f"job {job_id} names its spec by a relative path ({spec_path}), so where it lies "
                                   "is unknown; name the report file with -o")
        output = output or default_report_path(spec_path)
        check_output_writable(output, spec_path if spec_path.is_absolute() else None, store.path)
        path = write_report(store, job_id, output, force=force)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"job_id": job_id, "report": str(path)}, indent=2))
    else:
        click.echo(f"report of job {job_id} -> {path}")


@cli.command()
@click.option("--model", "-m", help="Checkpoint whose storage to measure (default: the default model).")
@click.option("--json", "as_json", is_flag=True)
def disk(model, as_json):
    """Measure the cold read bandwidth of a checkpoint's storage; cached per filesystem."""
    checkpoint = resolve_model(model, JobOptions(model=model))
    result = measure.measure_read_bandwidth(checkpoint)
    if as_json:
        click.echo(json.dumps(result.__dict__, indent=2))
    else:
        click.echo(f"{result.bytes_per_s / 1e9:.2f} GB/s ({result.basis}): {result.how}")


@cli.group()
def db():
    """Check the progress database, or copy what is readable of a damaged one into a new one."""


def _database_path(db_path: Path | None) -> Path:
    return Path(db_path or default_db_path(create=False))


@db.command("check")
@click.option("--db", "db_path", type=click.Path(path_type=Path),
              help="Progress database (default: $BATCHRUN_HOME/batchrun.db).")
@click.option("--quick", is_flag=True, help="SQLite's quick_check instead of the full integrity_check.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def db_check(db_path, quick, as_json):
    """SQLite's integrity check, and how many rows of each job are readable. Reads only; exit code 1 when damaged."""
    path = _database_path(db_path)
    found = check_database(path, quick=quick)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
    else:
        click.echo(f"{path}: {'sound' if found.ok else 'DAMAGED'}")
        for line in describe_check(found):
            click.echo(f"  {line}")
        if not found.ok:
            salvaged = path.with_name(f"{path.stem}.salvaged{path.suffix or '.db'}")
            click.echo(f"copy what is readable into a new database: batchrun db salvage --db {path} -o {salvaged}")
    if not found.ok:
        sys.exit(1)  # scripts tell a damaged database from a sound one by the exit code


@db.command("salvage")
@click.option("--db", "db_path", type=click.Path(path_type=Path),
              help="The damaged database (default: $BATCHRUN_HOME/batchrun.db); only read.")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True,
              help="The new database to write; must not exist.")
@click.option("--json", "as_json", is_flag=True, help="Print what was kept and lost as JSON.")
def db_salvage(db_path, output, as_json):
    """Copy every readable job, row, run, pass and partial-token record into a new database, saying what each job
    lost. The damaged file is left as it is."""
    path = _database_path(db_path)
    found = salvage_database(path, output)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
        return
    kept = sum(job.rows_readable for job in found.jobs)
    lost = sum(job.rows_lost for job in found.jobs)
    click.echo(f"{len(found.jobs)} job(s), {kept} rows salvaged into {output}; {lost} rows lost")
    for line in describe_check(found):
        click.echo(f"  {line}")
    moves = [f"mv {path} {path}.damaged"] + [f"mv {path}{suffix} {path}.damaged{suffix}" for suffix in ("-wal", "-shm")
                                              if Path(f"{path}{suffix}").exists()]
    click.echo(f"{path} is unchanged. To use the salvaged copy in its place: {' && '.join(moves)} && mv {output} "
               f"{path}  (or pass --db {output}). A job that lost rows computes them when its spec is submitted "
               "again.")
