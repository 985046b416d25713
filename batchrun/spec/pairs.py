"""Pair rows: a prompt that judges two answers, `a` and `b`, run in both orders so that a judge's taste for one slot
of the prompt (position bias) cancels out of the pair's verdict (docs/judging.md).

A pair row is two ordinary choice requests: order "ab" puts a in the prompt's first slot ({a} in a native row's
prompt, the first of the pair columns in a corpus template) and b in the second; order "ba" swaps them. The first
choice names the first slot, the second choice the second. The output folds the two back into one row
(batchrun.output). No torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchrun.spec.files import kind, show
from batchrun.spec.template import Field, RowProblem
from batchrun.spec.values import checked_text, whole

PAIR_KEYS = ("a", "b")  # a native row's two answers
PAIR_LABELS = ("a", "b", "tie")  # a pair row's expected verdict
SLOTS = ("{a}", "{b}")  # where a native pair row's prompt puts the first and the second answer
ORDERS = ("ab", "ba")


@dataclass(frozen=True, slots=True)
class PairOrder:
    """What a request of a pair row carries: its order, the lengths of the row's two answers (in characters) and
    the row's expected verdict."""

    order: str  # "ab": a in the first slot; "ba": b in the first slot
    a_chars: int
    b_chars: int
    label: str | None = None  # "a", "b" or "tie"

    def to_json(self) -> dict:
        return {"order": self.order, "a_chars": self.a_chars, "b_chars": self.b_chars, "label": self.label}


def native_pair(row: dict) -> tuple[str, str] | None:
    """A native row's two answers, or None when it is no pair row; refuses a half pair and what a pair row cannot
    be (a messages row, a generation row)."""
    if all(row.get(key) is None for key in PAIR_KEYS):
        return None
    for key in PAIR_KEYS:
        if row.get(key) is None:
            raise RowProblem(f"a pair row has both a and b; this row has no {key}")
    if row.get("messages") is not None or row.get("prompt") is None:
        raise RowProblem("a pair row is a prompt row: its prompt holds {a} and {b} (a messages row cannot be one)")
    for key in ("max_new_tokens", "stop", "continue_final_message"):
        if row.get(key) is not None:
            raise RowProblem(f"a pair row is judged by its two choices; {key} does not apply to it")
    prompt = checked_text(row["prompt"], "prompt", allow_empty=False)
    for slot in SLOTS:
        count = prompt.count(slot)
        if count != 1:
            raise RowProblem(f"a pair row's prompt holds {slot} exactly once; this one holds it {count} times")
    return tuple(checked_text(row[key], key, allow_empty=True) for key in PAIR_KEYS)


def native_orders(row: dict, answers: tuple[str, str]) -> list[dict]:
    """The native row of each order, its prompt filled and its label left to pair_label (the label of a pair row
    names an answer, an order's names a choice)."""
    plain = {key: value for key, value in row.items() if key not in (*PAIR_KEYS, "label")}
    a, b = answers
    return [{**plain, "prompt": _filled(row["prompt"], a, b)}, {**plain, "prompt": _filled(row["prompt"], b, a)}]


def _filled(prompt: str, first: str, second: str) -> str:
    # Cut at both slots at once, so an answer that itself holds "{a}" or "{b}" stays as written.
    (start, one), (end, other) = sorted([(prompt.index(SLOTS[0]), first), (prompt.index(SLOTS[1]), second)])
    return prompt[:start] + one + prompt[start + 3:end] + other + prompt[end + 3:]


def corpus_pair(row: dict, columns: tuple[str, str]) -> tuple[str, str]:
    """A corpus row's two answers, from the pair columns; each must be text."""
    values = []
    for name in columns:
        value = row.get(name)
        if value is None:
            raise RowProblem(f"pair column {name!r} is {'null' if name in row else 'missing'}")
        values.append(checked_text(value, f"pair column {name!r}", allow_empty=True))
    return values[0], values[1]


def corpus_orders(row: dict, columns: tuple[str, str], label_column: str | None) -> list[dict]:
    """The corpus row of each order: the pair columns swapped for "ba", the label left to pair_label."""
    plain = {key: value for key, value in row.items() if key != label_column}
    first, second = columns
    return [plain, {**plain, first: row[second], second: row[first]}]


def pair_label(value: object, what: str = "label") -> str | None:
    """A pair row's expected verdict: a, b or tie (trimmed, any case); None: unlabelled."""
    value = whole(value)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in PAIR_LABELS:
        return value.strip().lower()
    shown = show(value) if isinstance(value, str) else kind(value)
    raise RowProblem(f"{what} of a pair row names the better answer: a, b or tie; got {shown}")


def order_label(label: str | None, order: str, choices: Sequence[str]) -> str | None:
    """The choice an order's request should give for the pair's label: a tie names neither slot."""
    if label not in PAIR_KEYS:
        return None
    return choices[0] if (label == "a") == (order == "ab") else choices[1]


def checked_pair_choices(choices: Sequence[str] | None, max_new_tokens: int) -> tuple[str, str]:
    if choices is None or max_new_tokens:
        raise RowProblem("a pair row is a choice row: give two choices, the first naming the first slot, the second "
                         "the second")
    if len(choices) != 2:
        raise RowProblem(f"a pair row has exactly two choices (the first slot's and the second's); this one has "
                         f"{len(choices)}")
    return choices[0], choices[1]


def checked_pair_columns(columns: object, template: list[str | Field] | None,
                         reserved: Sequence[str | None]) -> tuple[str, str]:
    """Corpus mode's two answer columns; the template names each exactly once, and neither is the id or the label."""
    if template is None:
        raise RowProblem("pair_columns only applies with a template (corpus mode); a request row gives a and b")
    if isinstance(columns, str):
        columns = [name.strip() for name in columns.split(",")]
    if (not isinstance(columns, Sequence) or len(columns) != 2
            or not all(isinstance(name, str) and name for name in columns) or columns[0] == columns[1]):
        raise RowProblem(f"pair_columns names two different columns (a,b), got {columns!r}")
    for name in columns:
        count = sum(isinstance(part, Field) and part.name == name for part in template)
        if count != 1:
            raise RowProblem(f"the template names pair column {{{name}}} exactly once; it names it {count} times")
        if name in reserved:
            raise RowProblem(f"pair column {name!r} is also the id or label column")
    return columns[0], columns[1]
