"""Reading and validating a job spec: a JSONL or Parquet file with one request per row.

A row is one of three shapes:
  * native:  {"id", "prompt" | "messages", "system"?, "choices"? | "max_new_tokens"?/"stop"?}
  * OpenAI Batch API: {"custom_id", "method", "url", "body": {"messages", "max_tokens", "stop", ...}}
  * corpus:  any columns, when the job gives a template that builds the prompt from them.
Every row is checked before anything runs; all problems are reported together. A null value means
"not set" (Parquet has every column in every row, so optional fields are null where unused).
"""
from __future__ import annotations

import difflib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from batchrun.spec_files import jsonl_rows, parquet_rows, sha256_of, show
from batchrun.template import Field, RowProblem, SpecError, parse_template, render_template

__all__ = ["Field", "InvalidRow", "JobSpec", "Request", "SpecError", "parse_template", "read_spec"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
NATIVE_KEYS = ("id", "custom_id", "prompt", "messages", "system", "choices", "max_new_tokens", "stop")
OPENAI_KEYS = ("custom_id", "method", "url", "body")
OPENAI_CHAT_URL = "/v1/chat/completions"
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


@dataclass(frozen=True, slots=True)
class InvalidRow:
    index: int
    id: str | int | None  # None when the row is too broken to have one (or repeats an earlier row's)
    location: str
    reason: str
    name: str | int | None = None  # its id in the output: the id, else its location, made unique among the ids

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


def read_spec(
    path: str | Path,
    *,
    template: str | None = None,
    id_column: str | None = None,
    choices: Sequence[str] | None = None,
    system: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    stop: Sequence[str] | str | None = None,
    skip_invalid: bool = False,
) -> JobSpec:
    """Read and check a whole spec. Raises SpecError listing every bad row (or the file-level problem);
    with skip_invalid=True bad rows are returned in JobSpec.invalid and the rest are kept."""
    path = Path(path)
    shown = str(path)
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        raise SpecError([f"{shown}: unsupported spec file type {suffix or '(no extension)'!r}; use "
                         f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"])
    job = _job_settings(template, id_column, choices, system, max_new_tokens, stop)
    is_parquet = suffix in PARQUET_SUFFIXES
    try:
        if not path.is_file():
            raise SpecError([f"{shown}: not a regular file" if path.exists() else f"{shown}: no such file"])
        data = b"" if is_parquet else path.read_bytes()
        digest = sha256_of(path) if is_parquet else hashlib.sha256(data).hexdigest()
    except OSError as error:
        raise SpecError([f"{shown}: cannot read the file ({error.strerror or error})"]) from None
    if is_parquet:
        rows = parquet_rows(path, shown, job.template, job.id_column, NATIVE_KEYS + OPENAI_KEYS)
        numbering = _Numbering(shown, "row")
    else:
        rows, numbering = jsonl_rows(data, shown), _Numbering(shown, "line")
    requests, invalid, problems = _check_rows(rows, numbering, job)
    if not requests and not invalid:
        raise SpecError([f"{shown}: the file is empty (no requests)"])
    if invalid and not skip_invalid:
        raise SpecError(problems)
    return JobSpec(path=path, requests=requests, invalid=invalid, content_sha256=digest)


def _job_settings(template, id_column, choices, system, max_new_tokens, stop) -> _Job:
    parts = parse_template(template) if template is not None else None
    try:
        if id_column is not None and parts is None:
            raise RowProblem("id_column only applies with a template (corpus mode)")
        if id_column is not None and (not isinstance(id_column, str) or not id_column):
            raise RowProblem("id_column must be a non-empty column name")
        return _Job(
            choices=_choices(_as_list(choices), "choices") if choices is not None else None,
            system=_text(system, "system", allow_empty=True) if system is not None else None,
            max_new_tokens=_positive_int(max_new_tokens, "max_new_tokens"),
            stop=_stop(_as_list(stop)) if stop is not None else (),
            template=parts,
            id_column=id_column,
        )
    except RowProblem as problem:
        raise SpecError([f"job setting: {problem}"]) from None


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
                raise RowProblem(f"expected a JSON object, got {_kind(row)}")
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
            invalid.append(InvalidRow(index=index, id=row_id, location=location, reason=str(problem)))
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
    plain, custom = _whole(row.get("id")), _whole(row.get("custom_id"))
    if plain is not None and custom is not None and (type(plain) is not type(custom) or plain != custom):
        raise RowProblem(f"id {show(plain)} and custom_id {show(custom)} differ; give one of them")
    given = plain if plain is not None else custom
    if given is None:
        return number, True
    return _checked_id(given, "id" if plain is not None else "custom_id"), False


def _whole(value: object) -> object:
    """A whole float (5.0, 1e2) is the integer it spells: Parquet integer columns with nulls arrive as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _checked_id(value: object, what: str) -> str | int:
    value = _whole(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowProblem(f"{what} must be a string or an integer, got {_kind(value)}")
    if isinstance(value, str):
        _text(value, what, allow_empty=False)
    elif not -(2**63) <= value < 2**63:  # ids are stored in SQLite and Parquet integer columns
        raise RowProblem(f"{what} {show(value)} does not fit in a 64-bit integer")
    return value


def _request(row: dict, index: int, row_id: str | int, location: str, job: _Job) -> Request:
    if job.template is not None:
        prompt = _text(render_template(job.template, row), "the filled-in template", allow_empty=False)
        return _prompt_request(index, row_id, location, prompt, job.system, _answer(None, None, None, job))
    if any(row.get(key) is not None for key in ("body", "url", "method")):
        return _openai_request(row, index, row_id, location, job)
    _refuse_unknown_keys(row, NATIVE_KEYS, "")
    prompt, messages = row.get("prompt"), row.get("messages")
    if prompt is not None and messages is not None:
        raise RowProblem("a row has either prompt or messages, not both")
    if prompt is None and messages is None:
        raise RowProblem("missing prompt (or messages)")
    answer = _answer(row.get("choices"), row.get("max_new_tokens"), row.get("stop"), job)
    system = row.get("system")
    if prompt is not None:
        # An explicit empty system string opts a row out of the job's system message.
        system = job.system if system is None else _text(system, "system", allow_empty=True)
        return _prompt_request(index, row_id, location, _text(prompt, "prompt", allow_empty=False), system, answer)
    if system is not None:
        raise RowProblem("system applies to prompt rows; put a system message first in messages instead")
    pairs = _messages(messages, "messages", job.system)
    return Request(index, row_id, location, pairs, None, *answer)


def _prompt_request(index, row_id, location, prompt: str, system: str | None, answer) -> Request:
    pairs = ((("system", system),) if system else ()) + (("user", prompt),)
    return Request(index, row_id, location, pairs, prompt, *answer)


def _openai_request(row: dict, index: int, row_id: str | int, location: str, job: _Job) -> Request:
    """An OpenAI Batch API line; body keys batchrun has no use for (model, temperature, ...) are ignored."""
    _refuse_unknown_keys(row, OPENAI_KEYS, " in an OpenAI batch line")
    method, url, body = row.get("method"), row.get("url"), row.get("body")
    if method is not None and method != "POST":
        raise RowProblem(f"method {show(method)} is not supported; OpenAI batch lines use POST")
    if url != OPENAI_CHAT_URL:
        raise RowProblem(f"url {show(url)} is not supported; batchrun runs {OPENAI_CHAT_URL} requests only")
    if not isinstance(body, dict):
        raise RowProblem(f"body must be an object, got {_kind(body)}")
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


def _answer(choices, max_new_tokens, stop, job: _Job, limit_name="max_new_tokens", stop_name="stop") -> tuple:
    """(choices, max_new_tokens, stop). A row's own settings win over the job's; a row giving both
    choices and generation settings is contradictory."""
    generation = max_new_tokens is not None or stop is not None
    if choices is not None:
        if generation:
            raise RowProblem("a row is either a choice row (choices) or a generation row "
                             "(max_new_tokens/stop), not both")
        return _choices(choices, "choices"), 0, ()
    if job.choices is not None and not generation:
        return job.choices, 0, ()
    limit = job.max_new_tokens if max_new_tokens is None else _positive_int(max_new_tokens, limit_name)
    return None, limit, job.stop if stop is None else _stop(stop, stop_name)


def _messages(value: object, what: str, default_system: str | None, developer_is_system: bool = False):
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a list of {{role, content}} objects, got {_kind(value)}")
    if not value:
        raise RowProblem(f"{what} is empty")
    pairs = []
    for position, message in enumerate(value):
        where = f"{what}[{position}]"
        if not isinstance(message, dict):
            raise RowProblem(f"{where} must be an object with role and content, got {_kind(message)}")
        _refuse_unknown_keys(message, MESSAGE_KEYS, f" in {where}")
        role, content = message.get("role"), message.get("content")
        if message.get("name") is not None:
            _text(message["name"], f"{where}.name", allow_empty=True)
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
        pairs.append((role, _text(content, f"{where}.content", allow_empty=True)))
    if default_system and pairs[0][0] != "system":
        pairs.insert(0, ("system", default_system))
    return tuple(pairs)


def _text_parts(parts: list, what: str) -> str:
    """OpenAI content parts [{"type": "text", "text": ...}], one line each; the models here read text only."""
    texts = []
    for position, part in enumerate(parts):
        if not isinstance(part, dict):
            raise RowProblem(f"{what}[{position}] must be a content part object, got {_kind(part)}")
        if "type" not in part:
            raise RowProblem(f"{what}[{position}] has no type; a text part is {{\"type\": \"text\", \"text\": ...}}")
        if part["type"] != "text":
            raise RowProblem(f"{what}[{position}] is a {show(part['type'])} part; only text parts can be sent "
                             "to a text model")
        texts.append(_text(part.get("text"), f"{what}[{position}].text", allow_empty=True))
    return "\n".join(text for text in texts if text)


def _choices(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a list of strings, got {_kind(value)}")
    if not value:
        raise RowProblem(f"{what} is empty; give at least one choice")
    seen: set[str] = set()
    for choice in value:
        _text(choice, f"each of {what}", allow_empty=False)
        if choice in seen:
            raise RowProblem(f"{what} has {show(choice)} twice")
        seen.add(choice)
    return tuple(value)


def _stop(value: object, what: str = "stop") -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a string or a list of strings, got {_kind(value)}")
    for text in value:
        _text(text, f"each of {what}", allow_empty=False)
    return tuple(value)


def _positive_int(value: object, what: str) -> int:
    value = _whole(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowProblem(f"{what} must be a positive integer, got {_kind(value)}")
    if value <= 0:
        raise RowProblem(f"{what} must be a positive integer, got {value}")
    return value


def _text(value: object, what: str, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise RowProblem(f"{what} must be a string, got {_kind(value)}")
    if not value and not allow_empty:
        raise RowProblem(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape: no tokenizer or writer accepts it
        raise RowProblem(f"{what} contains an unpaired surrogate escape (not valid Unicode)") from None
    return value


def _refuse_unknown_keys(mapping: Mapping, known: Sequence[str], context: str) -> None:
    for key, value in mapping.items():
        if key not in known and value is not None:
            guess = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"known keys: {', '.join(known)}"
            raise RowProblem(f"unknown key {show(key)}{context} ({hint})")


def _kind(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    kind = names.get(type(value), f"a {type(value).__name__} value")
    return f"{kind} ({show(value)})" if isinstance(value, (int, float)) else kind


# ----------------------------------------------------------------------------------------------- files
