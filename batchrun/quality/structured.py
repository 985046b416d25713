"""Structured answers checked against their JSON Schema by a validator of its own (jsonschema), independent of the
grammar engine that constrained the decoding: a disagreement between the two shows, instead of being trusted away.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

# A row cut by its token limit before its JSON closed: its text is not a document to validate.
INCOMPLETE = "json_incomplete"


@dataclass(frozen=True)
class SchemaCheck:
    """One answer against its schema: the parsed value as JSON text (None where the text does not parse), whether
    it validates, and where it does not (JSON-pointer paths, each with the validator's reason)."""

    json: str | None
    valid: bool
    errors: tuple[str, ...]


def schema_problem(schema: dict) -> str | None:
    """Why `schema` is not a JSON Schema its validator can use (draft 2020-12 unless it names another), or None."""
    import jsonschema  # here: importing batchrun.quality should not load the validator for jobs that never use it

    try:
        _validator_class(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        return f"{error.message} (at {_pointer(error.absolute_path) or '/'})"
    return None


def check_answer(text: str, schema_text: str) -> SchemaCheck:
    """`text` parsed as JSON and validated against the schema (its canonical JSON text), string formats included."""
    try:
        value = json.loads(text)
    except ValueError as error:
        return SchemaCheck(None, False, (f"/: not JSON ({error.msg} at character {error.pos})",))
    validator = _validator(schema_text)
    errors = sorted(validator.iter_errors(value), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    shown = tuple(f"{_pointer(error.absolute_path) or '/'}: {error.message}" for error in errors)
    return SchemaCheck(json.dumps(value, ensure_ascii=False), not shown, shown)


def check_regex_answer(text: str, pattern: str) -> SchemaCheck:
    """A regex row's answer: valid where the whole text matches the pattern (no JSON value)."""
    try:
        matched = re.fullmatch(pattern, text) is not None
    except re.error as error:  # a pattern the grammar engine reads and Python's re does not: said, not hidden
        return SchemaCheck(None, False, (f"/: the pattern cannot be checked by Python's re ({error})",))
    return SchemaCheck(None, matched, () if matched else ("/: the text does not match the pattern",))


@functools.lru_cache(maxsize=256)  # per distinct schema: a job has a few, checked against every row's answer
def _validator(schema_text: str):
    schema = json.loads(schema_text)
    cls = _validator_class(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _validator_class(schema: dict):
    import jsonschema

    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def _pointer(path) -> str:
    """A JSON pointer (RFC 6901) to the failing value: /items/0/name."""
    return "".join("/" + str(part).replace("~", "~0").replace("/", "~1") for part in path)
