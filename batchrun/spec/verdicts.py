"""Reasons, then the verdict: a row that first writes a rationale (greedy, its token limit and stop strings) and then
scores its choices after a cue ("Verdict:"), as G-Eval and Prometheus judge. No torch.

The row runs in two stages. The first is a generation row like any other; once its rationale ends, the second is a
choice row whose answer begins with the rationale and the cue, written right after the prompt as the model saw it
(Request.answer_start), so its probabilities are those of a prompt written by hand with the same rationale in it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchrun.spec.rows import Request


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a row scores once its rationale is written: its choices, after the cue."""
    cue: str
    choices: tuple[str, ...]

    def to_json(self) -> list:
        return [self.cue, list(self.choices)]


def rationale_stops(stop: tuple[str, ...], cue: str) -> tuple[str, ...]:
    """The rationale's stop strings: the row's own, and the cue itself: a model that starts writing its verdict has
    finished its reasons, and the cue then comes from the row, not from the model."""
    own_cue = cue.strip()
    return stop if not own_cue or own_cue in stop else stop + (own_cue,)


def cued_answer(rationale: str, cue: str) -> str:
    """The start of the second stage's answer: the rationale, then the cue on a line of its own (no newline is added
    after a rationale that is empty or already ends in whitespace)."""
    joiner = "" if not rationale or rationale[-1].isspace() else "\n"
    return rationale + joiner + cue


def verdict_request(request: Request, rationale: str) -> Request:
    """The second stage of a verdict row: its choices scored after its rationale and cue."""
    verdict = request.verdict
    if verdict is None:
        raise ValueError(f"row {request.index} writes no rationale before a verdict")
    return replace(request, choices=verdict.choices, max_new_tokens=0, stop=(), verdict=None,
                   answer_start=request.answer_start + cued_answer(rationale, verdict.cue))
