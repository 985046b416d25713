"""Checks of one field's value, shared by every row shape (native, OpenAI batch line, corpus) and the job's settings.

Each raises RowProblem with the reason; the spec reader adds where.
"""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

from batchrun.spec.files import kind, show
from batchrun.spec.template import RowProblem


def whole(value: object) -> object:
    """A whole float (5.0, 1e2) is the integer it spells: Parquet integer columns with nulls arrive as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def checked_choices(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a list of strings, got {kind(value)}")
    if not value:
        raise RowProblem(f"{what} is empty; give at least one choice")
    seen: set[str] = set()
    for position, choice in enumerate(value):
        checked_text(choice, f"{what}[{position}]", allow_empty=False)  # by position: "" has no name to show
        if choice in seen:
            raise RowProblem(f"{what} has {show(choice)} twice")
        seen.add(choice)
    return tuple(value)


def checked_stop(value: object, what: str = "stop") -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise RowProblem(f"{what} must be a string or a list of strings, got {kind(value)}")
    for text in value:
        checked_text(text, f"each of {what}", allow_empty=False)
    return tuple(value)


def positive_int(value: object, what: str) -> int:
    value = whole(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowProblem(f"{what} must be a positive integer, got {kind(value)}")
    if value <= 0:
        raise RowProblem(f"{what} must be a positive integer, got {value}")
    return value


def checked_text(value: object, what: str, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise RowProblem(f"{what} must be a string, got {kind(value)}")
    if not value and not allow_empty:
        raise RowProblem(f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape: no tokenizer or writer accepts it
        raise RowProblem(f"{what} contains an unpaired surrogate escape (not valid Unicode)") from None
    return value


def refuse_unknown_keys(mapping: Mapping, known: Sequence[str], context: str, otherwise: str | None = None) -> None:
    """`otherwise` is the hint when no known key is close (default: the known keys)."""
    for key, value in mapping.items():
        if key not in known and value is not None:
            guess = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else otherwise or f"known keys: {', '.join(known)}"
            raise RowProblem(f"unknown key {show(key)}{context} ({hint})")


def checked_label(value: object, choices: Sequence[str] | None, column: str | None = None) -> str | None:
    """A row's expected answer. A choice row's must be one of its choices: the exact spelling, else the one choice it
    matches after trimming and case-folding (stored as the choice's spelling). A whole number is its digits (a 1-5
    rating's label 4 is the choice "4"). None: the row is unlabelled."""
    what = f"label (column {column!r})" if column else "label"
    value = whole(value)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):  # said here: checked_text would ask for a string though whole numbers are fine
        raise RowProblem(f"{what} must be a string or a whole number, got {kind(value)}")
    text = checked_text(value, what, allow_empty=False)
    if choices is None or text in choices:
        return text
    loose = [choice for choice in choices if choice.strip().casefold() == text.strip().casefold()]
    if len(loose) == 1:
        return loose[0]
    raise RowProblem(f"{what} {show(text)} is not one of the row's choices ({', '.join(map(show, choices))})")
