"""Corpus-mode prompt templates ("Review: {text}\\nIs it positive?") filled from each row's columns,
and the error types shared by the whole spec reader.

Templates are parsed by hand, never with str.format: format strings can reach attributes ({a.__class__}),
index into values ({a[0]}) and run conversions, so a user's template could read object internals. Here a
placeholder is a plain column name and anything else is refused when the template is parsed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchrun.errors import BatchrunError

# Characters that would make a placeholder more than a column name in str.format's grammar.
_REFUSED_IN_PLACEHOLDER = {
    ".": "attribute access",
    "[": "indexing",
    "]": "indexing",
    "!": "a conversion",
    ":": "a format spec",
    "{": "a nested brace",
}
MAX_LISTED_PROBLEMS = 50


class SpecError(BatchrunError, ValueError):
    """A job spec that cannot be run. `problems` lists every reason, each naming the file and line/row
    (or the template / job setting) it is about. Defined here, in the lowest spec module, so template
    parsing can raise it without a circular import; batchrun.spec.read re-exports it."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(_summarise(self.problems))


def _summarise(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    listed = [f"  {problem}" for problem in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        listed.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    return f"{len(problems)} problems:\n" + "\n".join(listed)


class RowProblem(Exception):
    """One row cannot be used; the message is the reason, without the location (the reader adds it)."""


@dataclass(frozen=True, slots=True)
class Field:
    """A {column} placeholder."""

    name: str


def parse_template(template: str) -> list[str | Field]:
    """Split a template into literal text and Field placeholders; `{{` and `}}` are literal braces.

    Raises SpecError for unbalanced braces, empty placeholders, anything beyond a plain column name, or a
    template without placeholders (every row would get the same prompt).
    """
    if not isinstance(template, str):
        raise SpecError([f"template: must be text, got {type(template).__name__}"])
    parts: list[str | Field] = []
    literal: list[str] = []
    position, length = 0, len(template)
    while position < length:
        brace = _next_brace(template, position)
        if brace > position:
            literal.append(template[position:brace])
        if brace == length:
            break
        if template.startswith(("{{", "}}"), brace):
            literal.append(template[brace])
            position = brace + 2
            continue
        if template[brace] == "}":
            raise _template_error(f"single '}}' at character {brace + 1}; write '}}}}' for a literal brace")
        close = template.find("}", brace + 1)
        if close < 0:
            raise _template_error(f"'{{' at character {brace + 1} is never closed; "
                                  "write '{{' for a literal brace")
        name = template[brace + 1 : close]
        _check_placeholder(name, brace)
        if literal:
            parts.append("".join(literal))
            literal = []
        parts.append(Field(name))
        position = close + 1
    if literal:
        parts.append("".join(literal))
    if not any(isinstance(part, Field) for part in parts):
        raise _template_error("no {column} placeholders, so every row would get the same prompt")
    return parts


def template_columns(parts: Sequence[str | Field]) -> list[str]:
    """The column names a parsed template reads, each once, in order of first use."""
    return list(dict.fromkeys(part.name for part in parts if isinstance(part, Field)))


def render_template(parts: Sequence[str | Field], row: Mapping[str, object]) -> str:
    """Fill the placeholders from `row`; numbers go through str() (spec.py hands lists, objects and booleans over
    already written as JSON). Raises RowProblem for a missing or null column."""
    pieces = []
    for part in parts:
        if isinstance(part, str):
            pieces.append(part)
            continue
        if part.name not in row:
            raise RowProblem(f"column {part.name!r} (named in the template) is missing")
        value = row[part.name]
        if value is None:
            raise RowProblem(f"column {part.name!r} is null")
        if isinstance(value, str):
            pieces.append(value)
            continue
        try:
            pieces.append(str(value))
        except ValueError as error:  # e.g. an integer beyond Python's str() digit limit
            raise RowProblem(f"column {part.name!r} cannot be written as text: {error}") from None
    return "".join(pieces)


def _next_brace(template: str, start: int) -> int:
    opening, closing = template.find("{", start), template.find("}", start)
    candidates = [index for index in (opening, closing) if index >= 0]
    return min(candidates) if candidates else len(template)


def _check_placeholder(name: str, brace: int) -> None:
    where = f"placeholder {{{name}}} at character {brace + 1}"
    if not name:
        raise _template_error(f"empty placeholder {{}} at character {brace + 1}; name a column, or write "
                              "'{{}}' for literal braces")
    for character, feature in _REFUSED_IN_PLACEHOLDER.items():
        if character in name:
            raise _template_error(f"{where} uses {feature} ({character!r}); placeholders are plain column "
                                  "names like {text}")
    if name != name.strip():
        raise _template_error(f"{where} has spaces around the column name")


def _template_error(reason: str) -> SpecError:
    return SpecError([f"template: {reason}"])
