"""Structured answers judged field by field against a JSON label: for every leaf the label names (a JSON pointer:
/order, /customer/name; an array is one value), how often the answer holds the same value, with its interval, and
for fields whose values come from an enum the confusion counts, so a user sees which field the model gets wrong.
"""
from __future__ import annotations

import json
from typing import Sequence

from batchrun.quality.metrics import wilson_interval

MISSING = "(missing)"  # how a confusion table shows a field the answer does not hold (or a row with no JSON)


def label_leaves(value: object, path: str = "") -> dict[str, object]:
    """JSON pointer -> value of every leaf of a label: an object's members recursively; anything else (arrays
    included: their order and length are the value) is a leaf. A bare value is the leaf "/"."""
    if not isinstance(value, dict) or not value:
        return {path or "/": value}
    leaves = {}
    for key, member in value.items():
        leaves.update(label_leaves(member, f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"))
    return leaves


def value_at(value: object, pointer: str) -> tuple[bool, object]:
    """(found, the value) at a JSON pointer of `value`."""
    if pointer == "/":
        return True, value
    for part in pointer.split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value


def field_accuracy(rows: Sequence[tuple[object | None, object]], enum_fields: set[str]) -> dict[str, dict]:
    """Per field over labelled structured rows: `rows` holds (the parsed answer, or None where the row gave no JSON,
    the label's value). A field is right where the answer holds the label's value (JSON equality: 1 and 1.0 are the
    same number, "1" is not). `enum_fields`: the pointers whose confusion counts are kept."""
    found: dict[str, dict] = {}
    for answer, label in rows:
        for pointer, expected in label_leaves(label).items():
            held, got = value_at(answer, pointer) if answer is not None else (False, None)
            right = held and _same(got, expected)
            field = found.setdefault(pointer, {"labelled": 0, "correct": 0})
            field["labelled"] += 1
            field["correct"] += right
            if pointer in enum_fields:
                confusion = field.setdefault("confusion", {})
                shown = _shown(got) if held else MISSING
                confusion.setdefault(_shown(expected), {}).setdefault(shown, 0)
                confusion[_shown(expected)][shown] += 1
    for field in found.values():
        field["rate"] = field["correct"] / field["labelled"]
        field["interval"] = wilson_interval(field["correct"], field["labelled"])
    return found


def _same(got: object, expected: object) -> bool:
    # bool is an int in Python: true must not equal 1
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    return got == expected


def _shown(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def enum_pointers(schema: object, path: str = "", depth: int = 0) -> set[str]:
    """The JSON pointers of an object schema's fields whose values an enum lists (nested objects included)."""
    if not isinstance(schema, dict) or depth > 16:
        return set()
    found = {path or "/"} if isinstance(schema.get("enum"), list) else set()
    for key, member in (schema.get("properties") or {}).items():
        found |= enum_pointers(member, f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}", depth + 1)
    return found
