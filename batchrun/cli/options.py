"""The options `plan`, `submit` and `compare` share: the job's options as click parses them into JobOptions, a spec
read from stdin, and `submit`'s options for a run on a Ray cluster."""
from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import click

from batchrun.distributed import RayRefusals, RaySettings, cluster_settings
from batchrun.host import stored_spec
from batchrun.job import CALIBRATION_METHODS, DEFAULT_CALIBRATION, DEFAULT_PASS_MINUTES, JobOptions
from batchrun.plan import TOKEN_MATRIX_CHOICES, parse_streaming
from batchrun.spec import TRUNCATE_SIDES, SpecError, kind


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
                     help="Checkpoint directory, GGUF file, registry model (smollm2-135m, the default, also "
                          "named `default`; gemma3-270m; NAME:converted) or Hugging Face repo id. `plan` and "
                          "`compare` take several; `submit` one."),
        click.option("--template", help='Corpus mode: build prompts from columns, e.g. "Review: {text}".'),
        click.option("--id-column", help="Column holding row ids in corpus mode."),
        click.option("--label-column", help="Column holding each row's expected answer in corpus mode (accuracy, "
                                            "calibration fitted on labels)."),
        click.option("--keep-columns", help="Corpus mode: input columns to copy into the output, comma-separated, "
                                            "or '*' for all."),
        click.option("--pair-columns", metavar="A,B",
                     help="Corpus mode: two columns holding answers to judge against each other; the template names "
                          "both, and each row runs in both orders (docs/judging.md)."),
        click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False),
                     help="Corpus mode: a JSON Schema file every answer must match; decoding follows it and every "
                          "answer is validated (docs/spec.md)."),
        click.option("--calibrate", type=click.Choice(CALIBRATION_METHODS), default=DEFAULT_CALIBRATION,
                     show_default=True, help="Calibrate choice probabilities: batch (the job's own rows), "
                                             "content-free (corpus mode), labels (fitted on labelled rows); "
                                             "docs/calibration.md."),
        click.option("--choices", help='Choices for rows that set none: comma-separated (yes,no), or a JSON array for '
                                        'exact strings (\'[" positive", "1,000"]\').'),
        click.option("--then", metavar="CUE",
                     help="Choice rows first write their reasons (up to --max-new-tokens, ending at --stop or at the "
                          "cue), then their choices are scored after this cue, e.g. 'Verdict:' (docs/judging.md)."),
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
        click.option("--streaming", help="auto|always|never (also yes/no, on/off, true/false, 1/0); env "
                                          "BATCHRUN_STREAMING."),
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
                      label_column=kw["label_column"], calibrate=kw["calibrate"], pair_columns=kw["pair_columns"],
                      then=kw["then"],
                      json_schema=kw["json_schema"],
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
