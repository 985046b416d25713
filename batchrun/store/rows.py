"""One finished row (RowResult) and how it maps to and from the `rows` table."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

FINISH_REASONS = ("stop", "length", "choice", "error")

# Column order of ROW_UPDATE_SQL's parameters, as produced by row_update_params.
ROW_UPDATE_SQL = (
    "update rows set state = ?, answer = ?, choice_probs_json = ?, score = ?, logprob = ?, "
    "prompt_tokens = ?, output_tokens = ?, finish_reason = ?, error = ?, output_token_ids_json = ?, "
    "choice_tokens_json = ?, rationale_json = ?, grammar_json = ? where job_id = ? and idx = ?"
)


class JobRow(NamedTuple):
    """A row as a job records it before any answer: its place, id, key (what its answer depends on), and what it
    brings besides its request: the expected answer and the values it carries to the output."""
    idx: int
    id: str | int
    key: str | None = None
    label: str | None = None
    carried: dict | None = None
    pair: dict | None = None  # a pair row's order: {"order", "a_chars", "b_chars", "label"} (spec.PairOrder)
    structure: dict | None = None  # a structured row's {"json_schema": ...} or {"regex": ...} (spec.Structure)


@dataclass
class RowResult:
    idx: int
    id: str | int
    answer: str | None
    choice_probs: dict[str, float] | None
    score: float | None
    logprob: float | None
    prompt_tokens: int | None
    output_tokens: int | None
    finish_reason: str  # stop | length | choice | error
    error: str | None
    token_ids: list[int] | None = None
    choice_tokens: dict[str, int] | None = None  # a choice row's tokens per choice
    grammar: dict | None = None  # a structured row's grammar counts: overrides, forced, lowest_logprob
    label: str | None = None  # the row's expected answer, where the spec gives one (read back, never written here)
    carried: dict | None = None  # output column -> value the row carries (read back, never written here)
    pair: dict | None = None  # the pair row order it answers (read back, never written here)
    rationale: Rationale | None = None  # the reasons a verdict row wrote before its choices were scored
    structure: dict | None = None  # the structure its answer must match (read back, never written here)

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error" or self.error is not None


@dataclass(frozen=True)
class Rationale:
    """The reasons a row wrote before its verdict: their text (stop strings cut, as an answer's), tokens, summed
    log-probability and why they ended (stop or length)."""
    text: str
    token_ids: tuple[int, ...]
    logprob: float
    finish_reason: str

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": [int(token) for token in self.token_ids], "logprob": self.logprob,
                "finish_reason": self.finish_reason}

    @classmethod
    def from_json(cls, value: dict) -> Rationale:
        return cls(value["text"], tuple(value["token_ids"]), value["logprob"], value["finish_reason"])


def row_update_params(job_id: str, result: RowResult) -> tuple:
    """Parameters for ROW_UPDATE_SQL; refuses a finish_reason the outputs would not understand."""
    if result.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"row {result.idx} finish_reason must be one of {', '.join(FINISH_REASONS)}; got {result.finish_reason!r}"
        )
    if result.finish_reason == "error" and not result.error:
        raise ValueError(f"row {result.idx} has finish_reason 'error' but no error message")
    failed = result.failed
    return (
        "error" if failed else "done",
        result.answer,
        None if result.choice_probs is None else json.dumps(result.choice_probs),
        result.score,
        result.logprob,
        result.prompt_tokens,
        result.output_tokens,
        "error" if failed else result.finish_reason,
        result.error,
        None if result.token_ids is None else json.dumps([int(token) for token in result.token_ids]),
        None if result.choice_tokens is None else json.dumps(result.choice_tokens),
        None if result.rationale is None else json.dumps(result.rationale.to_json()),
        None if result.grammar is None else json.dumps(result.grammar),
        job_id,
        result.idx,
    )


def row_result_from_db(row: dict) -> RowResult:
    return RowResult(
        idx=row["idx"],
        id=json.loads(row["id_json"]),  # JSON keeps 7 and "7" apart
        answer=row["answer"],
        choice_probs=None if row["choice_probs_json"] is None else json.loads(row["choice_probs_json"]),
        score=row["score"],
        logprob=row["logprob"],
        prompt_tokens=row["prompt_tokens"],
        output_tokens=row["output_tokens"],
        finish_reason=row["finish_reason"],
        error=row["error"],
        token_ids=None if row["output_token_ids_json"] is None else json.loads(row["output_token_ids_json"]),
        choice_tokens=_loaded(row.get("choice_tokens_json")),
        label=row.get("label"),
        carried=_loaded(row.get("carried_json")),
        pair=_loaded(row.get("pair_json")),
        rationale=None if row.get("rationale_json") is None else Rationale.from_json(json.loads(row["rationale_json"])),
        structure=_loaded(row.get("structure_json")),
        grammar=_loaded(row.get("grammar_json")),
    )


def _loaded(text: str | None):
    return None if text is None else json.loads(text)
