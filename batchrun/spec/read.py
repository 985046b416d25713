"""Reading and validating a job spec: a JSONL, JSON array, CSV/TSV (each maybe compressed) or Parquet file with one
request per row.

A row is one of three shapes:
  * native:  {"id", "prompt" | "messages", "system"?, "choices"? | "max_new_tokens"?/"stop"?, "label"?, "metadata"?}
             with "a" and "b" it is a pair row: its prompt holds {a} and {b}, and it runs in both orders (pairs.py)
  * OpenAI Batch API: {"custom_id", "method", "url", "body": {"messages", "max_tokens", "stop", ...}, "label"?, ...}
  * corpus:  any columns, when the job gives a template that builds the prompt from them; its system, choices,
             max_new_tokens and stop columns are the row's settings, as in a native row, unless the template reads them;
             a label column (label_column) holds the expected answer, and kept columns (keep_columns) go to the output;
             with pair_columns every row is a pair row.
Every row is checked before anything runs; all problems are reported together. A null value means
"not set" (Parquet has every column in every row, so optional fields are null where unused).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from batchrun.spec.files import (decompressed, holds_json_array, json_array_rows, jsonl_rows, kind, sha256_of, show,
                                 spec_format)
from batchrun.spec.pairs import checked_pair_columns
from batchrun.spec.rows import (NATIVE_KEYS, OPENAI_KEYS, JobSettings, Request, kept_columns_of_failed_row,
                                row_requests)
from batchrun.spec.structure import json_schema_structure
from batchrun.spec.tables import csv_rows, parquet_rows
from batchrun.spec.template import Field, RowProblem, SpecError, parse_template, template_columns
from batchrun.spec.values import checked_choices, checked_stop, checked_text, positive_int, whole

__all__ = ["Field", "InvalidRow", "JobSpec", "Request", "SpecError", "SpecSettings", "parse_template", "read_spec"]

CSV_DELIMITERS = {"csv": ",", "tsv": "\t"}  # the spec formats read as text with a header row (files.SPEC_FORMATS)
# A corpus row's own settings, read as a request row's are, unless the template or id column reads them as data.
CORPUS_SETTING_KEYS = ("system", "choices", "max_new_tokens", "stop", "then")
DEFAULT_MAX_NEW_TOKENS = 16


@dataclass(frozen=True, slots=True)
class InvalidRow:
    index: int
    id: str | int | None  # None when the row is too broken to have one (or repeats an earlier row's)
    location: str
    reason: str
    name: str | int | None = None  # its id in the output: the id, else its location, made unique among the ids
    carried: dict | None = None  # corpus mode: its kept columns, which is how a user finds the row in the output

    @property
    def output_id(self) -> str | int:
        return self.name if self.name is not None else (self.id if self.id is not None else self.location)


@dataclass
class JobSpec:
    path: Path
    requests: list[Request]
    invalid: list[InvalidRow]
    content_sha256: str  # of the spec file's bytes, for fingerprinting a job

    @property
    def total_rows(self) -> int:
        """The job's requests, a pair row's two orders counted apart: the rows its database records."""
        return len(self.requests) + len(self.invalid)

    @property
    def verdict_rows(self) -> int:
        """The rows that write their reasons before their verdict (each runs a rationale, then its choices)."""
        return sum(request.verdict is not None for request in self.requests)

    @property
    def pair_rows(self) -> int:
        """The pair rows that run (each as two requests, one per order)."""
        return sum(request.pair is not None and request.pair.order == "ab" for request in self.requests)


@dataclass(frozen=True)
class SpecSettings:
    """How a spec's rows are read: the settings rows fall back on, corpus mode, and what to do with bad rows."""

    template: str | None = None
    id_column: str | None = None
    choices: Sequence[str] | None = None
    system: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: Sequence[str] | str | None = None
    skip_invalid: bool = False  # bad rows returned in JobSpec.invalid instead of refusing the spec
    label_column: str | None = None
    keep_columns: Sequence[str] | None = None
    pair_columns: Sequence[str] | str | None = None  # corpus mode: two columns each row's pair judges ("a,b")
    then: str | None = None  # the cue before each choice row's verdict, after a rationale it writes first
    json_schema: str | Path | dict | None = None  # corpus mode: the JSON Schema every answer must match (or its file)


def read_spec(path: str | Path, settings: SpecSettings | None = None, **fields) -> JobSpec:
    """Read and check a whole spec, with `settings` (or SpecSettings' fields given by name). Raises SpecError
    listing every bad row (or the file-level problem); with skip_invalid bad rows are returned in JobSpec.invalid
    and the rest are kept."""
    settings = settings if settings is not None else SpecSettings(**fields)
    path = Path(path)
    shown = str(path)
    file_format, compression = spec_format(path)
    job = _with_pair_columns(_with_corpus_columns(_job_settings(settings), settings.label_column,
                                                  settings.keep_columns), settings.pair_columns)
    job = _with_structure(replace(job, base_dir=path.parent), settings.json_schema)
    skip_invalid = settings.skip_invalid
    is_parquet = file_format == "parquet"
    try:
        if not path.is_file():
            raise SpecError([f"{shown}: not a regular file" if path.exists() else f"{shown}: no such file"])
        data = b"" if is_parquet else path.read_bytes()
        digest = sha256_of(path) if is_parquet else hashlib.sha256(data).hexdigest()  # of the bytes as given
    except OSError as error:
        raise SpecError([f"{shown}: cannot read the file ({error.strerror or error})"]) from None
    if is_parquet:
        rows = parquet_rows(path, shown, job.template, job.id_column, NATIVE_KEYS + OPENAI_KEYS,
                            corpus_settings=_corpus_columns(job), nan_is_null=_optional_numbers(job))
        numbering = _Numbering(shown, "row")
    elif file_format in CSV_DELIMITERS:
        rows = csv_rows(decompressed(data, compression, shown), shown, CSV_DELIMITERS[file_format], job.template,
                        job.id_column, NATIVE_KEYS + OPENAI_KEYS, corpus_settings=_corpus_columns(job))
        numbering = _Numbering(shown, "line")
    else:  # JSON: one object a line, or one array of objects whose items are numbered as rows
        text = decompressed(data, compression, shown)
        numbering = _Numbering(shown, "row" if holds_json_array(text) else "line")
        rows = json_array_rows(text, shown) if numbering.unit == "row" else jsonl_rows(text, shown)
    requests, invalid, problems = _check_rows(rows, numbering, job)
    if not requests and not invalid:
        raise SpecError([f"{shown}: the file is empty (no requests)"])
    if job.label_column is not None and requests and all(request.label is None for request in requests):
        raise SpecError([f"{shown}: no row has a label in column {job.label_column!r} (label_column); check the "
                         "column's name"])
    if invalid and not skip_invalid:
        raise SpecError(problems)
    return JobSpec(path=path, requests=requests, invalid=invalid, content_sha256=digest)


def _job_settings(settings: SpecSettings) -> JobSettings:
    template, id_column, choices = settings.template, settings.id_column, settings.choices
    system, max_new_tokens, stop = settings.system, settings.max_new_tokens, settings.stop
    parts = parse_template(template) if template is not None else None
    try:
        if id_column is not None and parts is None:
            raise RowProblem("id_column only applies with a template (corpus mode)")
        if id_column is not None and (not isinstance(id_column, str) or not id_column):
            raise RowProblem("id_column must be a non-empty column name")
        return JobSettings(
            choices=checked_choices(_as_list(choices), "choices") if choices is not None else None,
            system=checked_text(system, "system", allow_empty=True) if system is not None else None,
            max_new_tokens=positive_int(max_new_tokens, "max_new_tokens"),
            stop=checked_stop(_as_list(stop)) if stop is not None else (),
            then=checked_text(settings.then, "then", allow_empty=False) if settings.then is not None else None,
            template=parts,
            id_column=id_column,
            row_settings=tuple(key for key in CORPUS_SETTING_KEYS
                               if parts is not None and key not in template_columns(parts) and key != id_column),
        )
    except RowProblem as problem:
        raise SpecError([f"job setting: {problem}"]) from None


def _with_corpus_columns(job: JobSettings, label_column: str | None, keep_columns: Sequence[str] | None) -> JobSettings:
    """Corpus mode's label column and the columns carried to the output; neither exists without a template."""
    if label_column is None and keep_columns is None:
        return job
    problem = None
    if job.template is None:
        problem = ("label_column" if label_column is not None else "keep_columns") + \
            " only applies with a template (corpus mode); a request row carries its own label and metadata"
    elif label_column is not None and (not isinstance(label_column, str) or not label_column):
        problem = "label_column must be a non-empty column name"
    elif label_column is not None and label_column in template_columns(job.template):
        problem = f"the template reads the label column {label_column!r}: the model would see its answer"
    elif keep_columns is not None and not all(isinstance(name, str) and name for name in keep_columns):
        problem = "keep_columns must be column names (or '*' for all)"
    if problem:
        raise SpecError([f"job setting: {problem}"])
    settings = tuple(key for key in job.row_settings if key != label_column)
    kept = tuple(keep_columns) if keep_columns is not None else None
    return replace(job, label_column=label_column, keep_columns=kept, row_settings=settings)


def _with_pair_columns(job: JobSettings, pair_columns: Sequence[str] | str | None) -> JobSettings:
    """Corpus mode's pair columns: every row then is a pair row, judged in both orders."""
    if pair_columns is None:
        return job
    try:
        columns = checked_pair_columns(pair_columns, job.template, (job.id_column, job.label_column))
    except RowProblem as problem:
        raise SpecError([f"job setting: {problem}"]) from None
    return replace(job, pair_columns=columns)


def _with_structure(job: JobSettings, json_schema: str | Path | dict | None) -> JobSettings:
    """Corpus mode's JSON Schema, which every row's answer must match; a request row gives its own."""
    if json_schema is None:
        return job
    try:
        if job.template is None:
            raise RowProblem("json_schema (--json-schema) only applies with a template (corpus mode); a request row "
                             "gives its own json_schema, or an OpenAI line its body.response_format")
        if job.choices is not None:
            raise RowProblem("choices and json_schema exclude each other: a choice row answers with one of its "
                             "choices")
        schema = str(json_schema) if isinstance(json_schema, Path) else json_schema
        return replace(job, structure=json_schema_structure(schema, "json_schema", None))
    except RowProblem as problem:
        raise SpecError([f"job setting: {problem}"]) from None


def _corpus_columns(job: JobSettings) -> tuple[str, ...]:
    """The columns a corpus row is read with besides the template's and the id's: its settings, its label and the
    columns it carries to the output ("*": all of them)."""
    extra = ((job.label_column,) if job.label_column else ()) + (job.keep_columns or ())
    return job.row_settings + tuple(name for name in extra if name not in job.row_settings)


def _optional_numbers(job: JobSettings) -> tuple[str, ...]:
    """The Parquet columns where NaN means "not set": Polars and pandas write a missing number as NaN."""
    if job.template is None:
        return ("id", "custom_id", "max_new_tokens")
    own_limit = ("max_new_tokens",) if "max_new_tokens" in job.row_settings else ()
    return ((job.id_column,) if job.id_column else ()) + own_limit


def _as_list(value: object) -> object:
    """Callers may pass any sequence (a tuple from click); a lone string stays a string."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


@dataclass(frozen=True)
class _Numbering:
    """How rows are named in messages: JSONL by line ("x.jsonl:12"), Parquet by row ("x.parquet: row 3")."""

    shown: str
    unit: str  # "line" or "row"

    def location(self, number: int) -> str:
        return f"{self.shown}:{number}" if self.unit == "line" else f"{self.shown}: row {number}"

    def problem(self, number: int, reason: str) -> str:
        where = f"{self.shown}:line {number}" if self.unit == "line" else self.location(number)
        return f"{where}: {reason}"


def _check_rows(rows: Iterator[tuple[int, object]], numbering: _Numbering, job: JobSettings):
    """Turn (row number, parsed row or RowProblem) pairs into requests, invalid rows and problem lines."""
    requests: list[Request] = []
    invalid: list[InvalidRow] = []
    problems: list[str] = []
    ids_seen: dict[str, tuple[int, bool]] = {}  # str(id) -> (row number, id was defaulted)
    index = 0  # the next request's; a pair row takes two
    for number, row in rows:
        location = numbering.location(number)
        row_id = None
        try:
            if isinstance(row, RowProblem):
                raise row
            if not isinstance(row, dict):
                raise RowProblem(f"expected a JSON object, got {kind(row)}")
            row_id, defaulted = _row_id(row, number, job)
            # Compared as text: ids 7 and "7" would be indistinguishable in the outputs.
            earlier = ids_seen.setdefault(str(row_id), (number, defaulted))
            if earlier[0] != number:
                unit = numbering.unit
                hint = f" (a row without an id gets its {unit} number)" if defaulted or earlier[1] else ""
                shown, row_id = show(row_id), None  # the id is the earlier row's: name this one by its location
                raise RowProblem(f"duplicate id {shown}: {unit} {earlier[0]} has the same id{hint}")
            made = row_requests(row, index, row_id, location, job)
            requests += made
            index += len(made)
        except RowProblem as problem:
            invalid.append(InvalidRow(index=index, id=row_id, location=location, reason=str(problem),
                                      carried=kept_columns_of_failed_row(row, job)))
            problems.append(numbering.problem(number, str(problem)))
            index += 1
    return requests, _named(invalid, set(ids_seen)), problems


def _named(invalid: list[InvalidRow], ids: set[str]) -> list[InvalidRow]:
    """Rows without an id of their own are named by their location; a real id spelled the same way keeps it."""
    named = []
    for bad in invalid:
        name = bad.id
        if name is None:
            name = bad.location
            while name in ids:
                name += " (invalid row)"
            ids.add(name)
        named.append(replace(bad, name=name))
    return named


def _row_id(row: dict, number: int, job: JobSettings) -> tuple[str | int, bool]:
    """The row's id and whether it was defaulted to the row/line number."""
    if job.template is not None:
        if job.id_column is None:
            return number, True
        if job.id_column not in row:
            raise RowProblem(f"id column {job.id_column!r} is missing")
        if row[job.id_column] is None:
            raise RowProblem(f"id column {job.id_column!r} is null")
        return _checked_id(row[job.id_column], f"id column {job.id_column!r}"), False
    plain, custom = whole(row.get("id")), whole(row.get("custom_id"))
    if plain is not None and custom is not None and (type(plain) is not type(custom) or plain != custom):
        raise RowProblem(f"id {show(plain)} and custom_id {show(custom)} differ; give one of them")
    given = plain if plain is not None else custom
    if given is None:
        return number, True
    return _checked_id(given, "id" if plain is not None else "custom_id"), False


def _checked_id(value: object, what: str) -> str | int:
    value = whole(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowProblem(f"{what} must be a string or an integer, got {kind(value)}")
    if isinstance(value, str):
        checked_text(value, what, allow_empty=False)
    elif not -(2**63) <= value < 2**63:  # ids are stored in SQLite and Parquet integer columns
        raise RowProblem(f"{what} {show(value)} does not fit in a 64-bit integer")
    return value
