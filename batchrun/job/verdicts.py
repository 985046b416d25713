"""Reasons, then the verdict, as a run carries them (spec/verdicts.py): a verdict row generates its rationale with the
job's other generation rows; once the rationale ends it waits in the store (a run stopped there resumes at the
verdict), and its choices are scored after the rationale and cue in choice passes of their own."""
from __future__ import annotations

from typing import Mapping, Sequence

from batchrun.job.prepare import PreparedJob
from batchrun.spec import EncodedRow, encode_requests, verdict_request
from batchrun.store import Rationale, RowResult


def verdict_rows(prepared: PreparedJob, rows: Sequence[EncodedRow],
                 rationales: Mapping[int, Rationale]) -> list[EncodedRow]:
    """The second stage of each of `rows` whose rationale is written: its choices after the rationale and cue,
    encoded as the job encodes its rows (one that then exceeds the context carries the reason as its error)."""
    requests = [verdict_request(row.request, rationales[row.request.index].text) for row in rows
                if row.request.index in rationales]
    return encode_requests(prepared.model.tokenizer, requests, raw=prepared.options.raw,
                           context_length=prepared.model.context_length)


def with_rationale(result: RowResult, rationale: Rationale, prompt_tokens: int) -> RowResult:
    """A verdict's answer as the row's: the rationale beside it, and the row's own prompt tokens (the verdict's
    prompt holds the rationale too)."""
    result.rationale, result.prompt_tokens = rationale, prompt_tokens
    return result
