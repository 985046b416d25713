"""Reading and validating a job spec: a JSONL, JSON array, CSV/TSV (each maybe compressed) or Parquet file with one
request per row.

A row is one of three shapes:
  * native:  {"id", "prompt" | "messages", "system"?, "choices"? | "max_new_tokens"?/"stop"?, "label"?, "metadata"?}
  * OpenAI Batch API: {"custom_id", "method", "url", "body": {"messages", "max_tokens", "stop", ...}, "label"?, ...}
  * corpus:  any columns, when the job gives a template that builds the prompt from them; its system, choices,
             max_new_tokens and stop columns are the row's settings, as in a native row, unless the template reads them;
             a label column (label_column) holds the expected answer, and kept columns (keep_columns) go to the output.
Every row is checked before anything runs; all problems are reported together. A null value means
"not set" (Parquet has every column in every row, so optional fields are null where unused).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from batchrun.spec.files import (csv_rows, decompressed, holds_json_array, json_array_rows, jsonl_rows, kind,
                                 parquet_rows, sha256_of, show, spec_format)
from batchrun.spec.template import Field, RowProblem, SpecError, parse_template, render_template, template_columns
from batchrun.spec.values import (checked_choices, checked_label, checked_stop, checked_text, positive_int,
                                  refuse_unknown_keys, whole)

__all__ = ["Field", "InvalidRow", "JobSpec", "Request", "SpecError", "SpecSettings", "parse_template", "read_spec"]

CSV_DELIMITERS = {"csv": ",", "tsv": "\t"}  # the spec formats read as text with a header row (files.SPEC_FORMATS)
NATIVE_KEYS = ("id", "custom_id", "prompt", "messages", "system", "choices", "max_new_tokens", "stop", "label",
               "metadata")
# label and metadata are batchrun's own, beside an OpenAI line's keys: the expected answer and the user's data.
OPENAI_KEYS = ("custom_id", "method", "url", "body", "label", "metadata")
OPENAI_CHAT_URL = "/v1/chat/completions"
# The chat-completions parameters batchrun reads (tools only to refuse them) and those it ignores: sampling, output
# formats, logging, caching and streaming say nothing a greedy, text-only run of one answer a request could honour.
BODY_READ_KEYS = ("messages", "max_tokens", "max_completion_tokens", "stop", "n", "tools", "functions", "tool_choice",
                  "function_call", "web_search_options")
BODY_IGNORED_KEYS = ("model", "temperature", "top_p", "seed", "response_format", "presence_penalty",
                     "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "metadata", "store",
                     "service_tier", "stream", "stream_options", "parallel_tool_calls", "reasoning_effort", "verbosity",
                     "prediction", "modalities", "audio", "prompt_cache_key", "prompt_cache_retention",
                     "safety_identifier")
# A corpus row's own settings, read as a request row's are, unless the template or id column reads them as data.
CORPUS_SETTING_KEYS = ("system", "choices", "max_new_tokens", "stop")
ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")  # an OpenAI message's name is accepted and not sent: templates have no slot
DEFAULT_MAX_NEW_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Request:
    index: int  # 0-based position among all rows of the file (valid and invalid), in input order
    id: str | int
    location: str  # "jobs/x.jsonl:12" or "data.parquet: row 3", for messages
    messages: tuple[tuple[str, str], ...]  # (role, content); a system message, if any, comes first
    prompt: str | None  # raw prompt text of prompt/template rows; None for messages rows
    choices: tuple[str, ...] | None  # set for classification rows
    max_new_tokens: int  # 0 for choice rows
    stop: tuple[str, ...]
    label: str | None = None  # the expected answer: one of the choices, or the text a generation row should give
    carried: dict | None = None  # output column -> value the row carries through (metadata, --keep-columns)


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
        return len(self.requests) + len(self.invalid)


@dataclass(frozen=True)
class _Job:
    """Job-level settings every row falls back on, plus corpus-mode settings."""

    choices: tuple[str, ...] | None
    system: str | None
    max_new_tokens: int
    stop: tuple[str, ...]
    template: list[str | Field] | None
    id_column: str | None
    row_settings: tuple[str, ...]  # the corpus columns that are a row's settings, not data
    label_column: str | None = None  # corpus mode: the column holding each row's expected answer
    keep_columns: tuple[str, ...] | None = None  # corpus mode: input columns copied to the output; ("*",): all


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


def read_spec(path: str | Path, settings: SpecSettings | None = None, **fields) -> JobSpec:
    """Read and check a whole spec, with `settings` (or SpecSettings' fields given by name). Raises SpecError
    listing every bad row (or the file-level problem); with skip_invalid bad rows are returned in JobSpec.invalid
    and the rest are kept."""
    settings = settings if settings is not None else SpecSettings(**fields)
    path = Path(path)
    shown = str(path)
    file_format, compression = spec_format(path)
    job = _with_corpus_columns(_job_settings(settings), settings.label_column, settings.keep_columns)
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


def _job_settings(settings: SpecSettings) -> _Job:
    template, id_column, choices = settings.template, settings.id_column, settings.choices
    system, max_new_tokens, stop = settings.system, settings.max_new_tokens, settings.stop
    parts = parse_template(template) if template is not None else None
    try:
        if id_column is not None and parts is None:
            raise RowProblem("id_column only applies with a template (corpus mode)")
        if id_column is not None and (not isinstance(id_column, str) or not id_column):
            raise RowProblem("id_column must be a non-empty column name")
        return _Job(
            choices=checked_choices(_as_list(choices), "choices") if choices is not None else None,
            system=checked_text(system, "system", allow_empty=True) if system is not None else None,
            max_new_tokens=positive_int(max_new_tokens, "max_new_tokens"),
            stop=checked_stop(_as_list(stop)) if stop is not None else (),
            template=parts,
            id_column=id_column,
            row_settings=tuple(key for key in CORPUS_SETTING_KEYS
                               if parts is not None and key not in template_columns(parts) and key != id_column),
        )
    except RowProblem as problem:
        raise SpecError([f"job setting: {problem}"]) from None


def _with_corpus_columns(job: _Job, label_column: str | None, keep_columns: Sequence[str] | None) -> _Job:
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


def _corpus_columns(job: _Job) -> tuple[str, ...]:
    """The columns a corpus row is read with besides the template's and the id's: its settings, its label and the
    columns it carries to the output ("*": all of them)."""
    extra = ((job.label_column,) if job.label_column else ()) + (job.keep_columns or ())
    return job.row_settings + tuple(name for name in extra if name not in job.row_settings)


def _optional_numbers(job: _Job) -> tuple[str, ...]:
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


def _check_rows(rows: Iterator[tuple[int, object]], numbering: _Numbering, job: _Job):
    """Turn (row number, parsed row or RowProblem) pairs into requests, invalid rows and problem lines."""
    requests: list[Request] = []
    invalid: list[InvalidRow] = []
    problems: list[str] = []
    ids_seen: dict[str, tuple[int, bool]] = {}  # str(id) -> (row number, id was defaulted)
    for index, (number, row) in enumerate(rows):
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
            requests.append(_request(row, index, row_id, location, job))
        except RowProblem as problem:
            invalid.append(InvalidRow(index=index, id=row_id, location=location, reason=str(problem),
                                      carried=_kept_columns_of_failed_row(row, job)))
            problems.append(numbering.problem(number, str(problem)))
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


def _row_id(row: dict, number: int, job: _Job) -> tuple[str | int, bool]:
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


def _request(row: dict, index: int, row_id: str | int, location: str, job: _Job) -> Request:
    """The row as it runs, with the label and the values it carries to the output."""
    request = _request_shape(row, index, row_id, location, job)
    if job.template is not None:
        label = row.get(job.label_column) if job.label_column is not None else None
        carried = _kept_columns(row, job)
    else:
        label, carried = row.get("label"), _metadata(row.get("metadata"))
    if label is None and carried is None:
        return request
    return replace(request, label=checked_label(label, request.choices, job.label_column), carried=carried)


def _metadata(value: object) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RowProblem(f"metadata must be a JSON object, got {kind(value)}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise RowProblem(f"metadata cannot be written as JSON: {error}") from None
    return {"metadata": value}


def _kept_columns(row: dict, job: _Job) -> dict | None:
    if job.keep_columns is None:
        return None
    names = list(row) if job.keep_columns == ("*",) else job.keep_columns
    missing = [name for name in names if name not in row]
    if missing:
        raise RowProblem(f"--keep-columns names {', '.join(map(repr, missing))}, which this row does not have")
    return _cells(row, names)


def _kept_columns_of_failed_row(row: object, job: _Job) -> dict | None:
    """The kept columns a refused corpus row still has (one it lacks stays empty): the output names the row by
    them beside its error."""
    if not isinstance(row, dict) or job.template is None or job.keep_columns is None:
        return None
    return _cells(row, list(row) if job.keep_columns == ("*",) else job.keep_columns)


def _cells(row: dict, names: Sequence[str]) -> dict:
    # JSON text for what a Parquet/JSON cell can hold beyond numbers and text (dates, decimals, bytes)
    return {name: json.loads(json.dumps(row.get(name), default=str)) for name in names}


def _request_shape(row: dict, index: int, row_id: str | int, location: str, job: _Job) -> Request:
    if job.template is not None:
        prompt = checked_text(render_template(job.template, _as_template_values(row, job.template)),
                              "the filled-in template", allow_empty=False)
        own = {key: row.get(key) for key in job.row_settings}
        answer = _answer(own.get("choices"), own.get("max_new_tokens"), own.get("stop"), job)
        return _prompt_request(index, row_id, location, prompt, _row_system(own.get("system"), job), answer)
    if any(row.get(key) is not None for key in ("body", "url", "method")):
        return _openai_request(row, index, row_id, location, job)
    refuse_unknown_keys(row, NATIVE_KEYS, "")
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        raise RowProblem("a row has either prompt or messages, not both")
    if prompt is None and messages is None:
        raise RowProblem("missing prompt (or messages)")
    answer = _answer(row.get("choices"), row.get("max_new_tokens"), row.get("stop"), job)
    system = row.get("system")
    if prompt is not None:
        prompt = checked_text(prompt, "prompt", allow_empty=False)
        return _prompt_request(index, row_id, location, prompt, _row_system(system, job), answer)
    if system is not None:
        raise RowProblem("system applies to prompt rows; put a system message first in messages instead")
    pairs = _messages(messages, "messages", job.system)
    return Request(index, row_id, location, pairs, None, *answer)


def _row_system(system: object, job: _Job) -> str | None:
    """A prompt row's system message: its own, else the job's; an explicit empty string opts out of the job's."""
    return job.system if system is None else checked_text(system, "system", allow_empty=True)


def _as_template_values(row: dict, template: list[str | Field]) -> dict:
    """Nested values and booleans as JSON text (["a", "b"], {"k": 1}, false): str() would write Python's spelling
    (['a', 'b'], False), which a prompt should not show. Text and numbers are left as they are."""
    nested = {name: row[name] for name in template_columns(template) if isinstance(row.get(name), (bool, list, dict))}
    # default=str: Parquet dates and decimals inside a struct are written as their text.
    return {**row, **{name: json.dumps(value, ensure_ascii=False, default=str) for name, value in nested.items()}}


def _prompt_request(index, row_id, location, prompt: str, system: str | None, answer) -> Request:
    pairs = ((("system", system),) if system else ()) + (("user", prompt),)
    return Request(index, row_id, location, pairs, prompt, *answer)


def _openai_request(row: dict, index: int, row_id: str | int, location: str, job: _Job) -> Request:
    """An OpenAI Batch API line; the body's sampling parameters (BODY_IGNORED_KEYS) are ignored, others refused."""
    refuse_unknown_keys(row, OPENAI_KEYS, " in an OpenAI batch line")
    method, url, body = row.get("method"), row.get("url"), row.get("body")
    if method is not None and method != "POST":
        raise RowProblem(f"method {show(method)} is not supported; OpenAI batch lines use POST")
    if url != OPENAI_CHAT_URL:
        raise RowProblem(f"url {show(url)} is not supported; batchrun runs {OPENAI_CHAT_URL} requests only")
    if not isinstance(body, dict):
        raise RowProblem(f"body must be an object, got {kind(body)}")
    refuse_unknown_keys(body, BODY_READ_KEYS + BODY_IGNORED_KEYS, " in body",
                         otherwise=f"not a {OPENAI_CHAT_URL} parameter")
    _refuse_tool_use(body)
    count = body.get("n")
    if count is not None and (isinstance(count, bool) or count != 1):
        raise RowProblem(f"body.n is {show(count)}; batchrun writes exactly one answer per request")
    if body.get("messages") is None:
        raise RowProblem("body.messages is missing")
    limit, completion_limit = body.get("max_tokens"), body.get("max_completion_tokens")
    if limit is not None and completion_limit is not None and limit != completion_limit:
        raise RowProblem("body.max_tokens and body.max_completion_tokens differ; give one of them")
    limit_name = "body.max_tokens" if limit is not None else "body.max_completion_tokens"
    limit = completion_limit if limit is None else limit
    messages = _messages(body["messages"], "body.messages", job.system, developer_is_system=True)
    answer = _answer(None, limit, body.get("stop"), job, limit_name=limit_name, stop_name="body.stop")
    return Request(index, row_id, location, messages, None, *answer)


def _refuse_tool_use(body: dict) -> None:
    """batchrun runs text in, text out: a request that needs a tool call or a web search cannot be answered."""
    for key in ("tools", "functions"):
        if body.get(key):  # an empty list offers no tool
            raise RowProblem(f"body.{key} asks for tools; batchrun cannot call tools (it answers with text only)")
    for key in ("tool_choice", "function_call"):
        if _forces_a_tool(body.get(key)):
            raise RowProblem(f"body.{key} {show(body[key])} forces a tool call; batchrun cannot call tools")
    if body.get("web_search_options") is not None:  # even {}: it turns the search on with its defaults
        raise RowProblem("body.web_search_options asks for a web search; batchrun cannot search the web")


def _forces_a_tool(choice: object) -> bool:
    if choice in (None, "none", "auto"):
        return False
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        allowed = choice.get("allowed_tools")
        return not (isinstance(allowed, dict) and allowed.get("mode") == "auto")
    return True  # "required", a named tool, or a value OpenAI would refuse


def _answer(choices, max_new_tokens, stop, job: _Job, limit_name="max_new_tokens", stop_name="stop") -> tuple:
    """(choices, max_new_tokens, stop). A row's own settings win over the job's; a row giving both
    choices and generation settings is contradictory."""
    generation = max_new_tokens is not None or stop is not None
    if choices is not None:
        if generation:
            raise RowProblem("a row is either a choice row (choices) or a generation row "
                             "(max_new_tokens/stop), not both")
        return checked_choices(choices, "choices"), 0, ()
    if job.choices is not None and not generation:
        return job.choices, 0, ()
    limit = job.max_new_tokens if max_new_tokens is None else positive_int(max_new_tokens, limit_name)
    return None, limit, job.stop if stop is None else checked_stop(stop, stop_name)


def _messages(value: object, what: str, default_system: str | None, developer_is_system: bool = False):
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a list of {{role, content}} objects, got {kind(value)}")
    if not value:
        raise RowProblem(f"{what} is empty")
    pairs = []
    for position, message in enumerate(value):
        where = f"{what}[{position}]"
        if not isinstance(message, dict):
            raise RowProblem(f"{where} must be an object with role and content, got {kind(message)}")
        refuse_unknown_keys(message, MESSAGE_KEYS, f" in {where}")
        role, content = message.get("role"), message.get("content")
        if message.get("name") is not None:
            checked_text(message["name"], f"{where}.name", allow_empty=True)
        if developer_is_system and role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ROLES:
            got = "missing" if role is None else show(role)
            raise RowProblem(f"{where}.role is {got}; use one of {', '.join(ROLES)}")
        if role == "system" and position > 0:
            raise RowProblem(f"{where}: a system message may only come first")
        if content is None:
            raise RowProblem(f"{where}.content is missing")
        if isinstance(content, list):  # OpenAI content parts
            content = _text_parts(content, f"{where}.content")
        pairs.append((role, checked_text(content, f"{where}.content", allow_empty=True)))
    if default_system and pairs[0][0] != "system":
        pairs.insert(0, ("system", default_system))
    return tuple(pairs)


def _text_parts(parts: list, what: str) -> str:
    """OpenAI content parts [{"type": "text", "text": ...}], one line each; the models here read text only."""
    texts = []
    for position, part in enumerate(parts):
        if not isinstance(part, dict):
            raise RowProblem(f"{what}[{position}] must be a content part object, got {kind(part)}")
        if "type" not in part:
            raise RowProblem(f"{what}[{position}] has no type; a text part is {{\"type\": \"text\", \"text\": ...}}")
        if part["type"] != "text":
            raise RowProblem(f"{what}[{position}] is a {show(part['type'])} part; only text parts can be sent "
                             "to a text model")
        texts.append(checked_text(part.get("text"), f"{what}[{position}].text", allow_empty=True))
    return "\n".join(text for text in texts if text)
