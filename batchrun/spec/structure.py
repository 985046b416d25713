"""What shape a row's answer must take: a JSON Schema (an OpenAI line's response_format, a native row's json_schema,
corpus mode's --json-schema) or a regular expression (a native row's regex), checked when the spec is read.

Every distinct structure is compiled once by the grammar engine (llguidance) without a tokenizer, before any weight is
read: a keyword the engine cannot enforce is refused with the keyword's name, never dropped. Its compile options are
fixed here, whatever the schema's own "x-guidance" says: never lenient (lenient ignores what it cannot enforce), oneOf
never approximated by anyOf, and whitespace fixed to one space after ':' and ',' so a model cannot run a row to its
limit in blank space. No torch.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from batchrun.quality import schema_problem
from batchrun.spec.files import kind, show
from batchrun.spec.template import RowProblem

COMPILE_OPTIONS = {"lenient": False, "coerce_one_of": False, "whitespace_flexible": False,
                   "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}  # OpenAI's json_object: any JSON object
RESPONSE_FORMAT_KEYS = ("type", "json_schema")
OPENAI_SCHEMA_KEYS = ("name", "description", "schema", "strict")


@dataclass(frozen=True, slots=True)
class Structure:
    """A row's required answer shape: kind "json_schema" (source: the schema as compact JSON, key order kept: the
    engine writes properties in that order) or "regex" (source: the pattern)."""

    kind: str
    source: str

    @property
    def key(self) -> str:
        """The canonical hash one compiled grammar serves every row of."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()[:16]

    @property
    def is_json(self) -> bool:
        return self.kind == "json_schema"

    def grammar(self) -> str:
        """The engine's grammar text for this structure."""
        return _grammar(self.kind, self.source)

    def to_json(self) -> dict:
        return {self.kind: json.loads(self.source) if self.is_json else self.source}

    @classmethod
    def from_json(cls, value: dict) -> Structure:
        (structure_kind, source), = value.items()
        return cls(structure_kind, json.dumps(source, separators=(",", ":"), ensure_ascii=False)
                   if structure_kind == "json_schema" else source)


def json_schema_structure(value: object, what: str, base_dir: Path | None) -> Structure:
    """A native row's json_schema (an object, or a path to a JSON file, relative to the spec's folder)."""
    if isinstance(value, str):
        value = _schema_file(value, what, base_dir)
    if not isinstance(value, dict):
        raise RowProblem(f"{what} must be a JSON Schema object or the path of a file holding one, got {kind(value)}")
    return checked(Structure("json_schema", _compact(value, what)), what)


def regex_structure(value: object, what: str = "regex") -> Structure:
    if not isinstance(value, str) or not value:
        got = "an empty string" if value == "" else kind(value)
        raise RowProblem(f"{what} must be a non-empty regular expression, got {got}")
    return checked(Structure("regex", value), what)


def response_format_structure(value: object, what: str = "body.response_format") -> Structure | None:
    """An OpenAI body's response_format: text (no structure), json_object (any object) or json_schema (strict or not:
    batchrun enforces both alike)."""
    if not isinstance(value, dict):
        raise RowProblem(f"{what} must be an object, got {kind(value)}")
    _refuse_unknown(value, RESPONSE_FORMAT_KEYS, what)
    form = value.get("type")
    if form == "text":
        return None
    if form == "json_object":
        return checked(Structure("json_schema", _compact(ANY_OBJECT, what)), what)
    if form != "json_schema":
        raise RowProblem(f"{what}.type is {show(form)}; use text, json_object or json_schema")
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise RowProblem(f"{what}.json_schema must be an object with a schema, got {kind(inner)}")
    _refuse_unknown(inner, OPENAI_SCHEMA_KEYS, f"{what}.json_schema")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RowProblem(f"{what}.json_schema.strict must be true or false, got {kind(strict)}")
    schema = inner.get("schema", ANY_OBJECT)  # OpenAI's default: any object
    if not isinstance(schema, dict):
        raise RowProblem(f"{what}.json_schema.schema must be an object, got {kind(schema)}")
    return checked(Structure("json_schema", _compact(schema, f"{what}.json_schema.schema")),
                   f"{what}.json_schema.schema")


def checked(structure: Structure, what: str) -> Structure:
    """The structure, if the grammar engine can enforce all of it; else RowProblem naming what it cannot."""
    problem = structure_problem(structure.kind, structure.source)
    if problem:
        raise RowProblem(f"{what}: {problem}")
    return structure


@functools.lru_cache(maxsize=1024)  # per distinct structure: a corpus repeats one schema on every row
def structure_problem(structure_kind: str, source: str) -> str | None:
    """Why the grammar engine refuses this structure (a keyword it cannot enforce, a bad pattern), or None."""
    from llguidance import LLMatcher  # here: reading a spec without structured rows never loads the engine

    if structure_kind == "json_schema":
        invalid = schema_problem(json.loads(source))
        if invalid:
            return f"not a valid JSON Schema: {invalid}"
    failed, messages = LLMatcher.validate_grammar_with_warnings(_grammar(structure_kind, source))
    if not failed and not messages:
        return None
    message = messages[0] if messages else "refused by the grammar engine"
    keys = re.match(r'Unimplemented keys: \[(.*)\]', message)
    if keys:
        names = ", ".join(name.strip().strip('"') for name in keys.group(1).split(","))
        return (f"the grammar engine cannot enforce the keyword(s) {names}; batchrun refuses a schema rather than "
                "loosen it (drop or rewrite them)")
    if not failed:  # a warning: something the engine would not enforce exactly
        return (f"the grammar engine would not enforce this exactly ({message}); batchrun refuses it rather than "
                "loosen it")
    return f"the grammar engine refuses it: {message.strip().splitlines()[0] if message.strip() else message}"


@functools.lru_cache(maxsize=1024)
def _grammar(structure_kind: str, source: str) -> str:
    from llguidance import LLMatcher

    if structure_kind == "regex":
        return LLMatcher.grammar_from_regex(source)
    return LLMatcher.grammar_from_json_schema(source, overrides=COMPILE_OPTIONS)


def _compact(schema: dict, what: str) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError as error:
        raise RowProblem(f"{what} cannot be written as JSON: {error}") from None


def _schema_file(path: str, what: str, base_dir: Path | None) -> object:
    file = Path(path)
    if not file.is_absolute() and base_dir is not None:
        file = base_dir / file
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise RowProblem(f"{what}: cannot read {file} ({error.strerror or error})") from None
    except ValueError as error:
        raise RowProblem(f"{what}: {file} is not JSON ({error})") from None


def _refuse_unknown(mapping: dict, known: tuple[str, ...], what: str) -> None:
    unknown = [key for key, value in mapping.items() if key not in known and value is not None]
    if unknown:
        raise RowProblem(f"unknown key {show(unknown[0])} in {what} (known keys: {', '.join(known)})")


def sample_instance(schema: object, defs: dict | None = None, depth: int = 0) -> object:
    """A typical value of `schema`, every property present, a string a few words long: what a token-limit estimate
    counts (an estimate, not a bound: real strings are as long as the document makes them)."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    defs = defs if defs is not None else {**schema.get("definitions", {}), **schema.get("$defs", {})}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs:
        return sample_instance(defs[ref.rsplit("/", 1)[-1]], defs, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return max(schema["enum"], key=lambda value: len(json.dumps(value)))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return sample_instance(schema[key][0], defs, depth + 1)
    kind_ = schema.get("type", "object" if "properties" in schema else "string")
    kind_ = kind_[0] if isinstance(kind_, list) and kind_ else kind_
    if kind_ == "object":
        properties = schema.get("properties", {})
        return {name: sample_instance(sub, defs, depth + 1) for name, sub in properties.items()}
    if kind_ == "array":
        return [sample_instance(schema.get("items", {}), defs, depth + 1)] * max(1, schema.get("minItems", 1))
    if kind_ in ("integer", "number"):
        return 12345
    if kind_ == "boolean":
        return False
    if kind_ == "null":
        return None
    return "a few words of text"[:schema.get("maxLength", 19)]


def structured_label(value: object, column: str | None) -> str | None:
    """A JSON row's expected answer as JSON text: any JSON value, judged field by field. In corpus mode a label
    column's text that holds JSON is that JSON (a CSV cell cannot hold an object)."""
    if value is None:
        return None
    if column is not None and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # plain text: the expected string
    what = f"label (column {column!r})" if column else "label"
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise RowProblem(f"{what} cannot be written as JSON: {error}") from None
