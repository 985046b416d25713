"""Reasons, then the verdict, as a run carries them (spec/verdicts.py): a verdict row generates its rationale with the
job's other generation rows; once the rationale ends it waits in the store (a run stopped there resumes at the
verdict), and its choices are scored after the rationale and cue in choice passes of their own."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from batchrun.host import faults
from batchrun.job.commits import PassCommits, error_result, to_row_result
from batchrun.job.prepare import PreparedJob, row_costs
from batchrun.plan import Candidate, pack_batches
from batchrun.runtime import generation_answer, score_choices
from batchrun.spec import EncodedRow, encode_requests, verdict_request
from batchrun.store import Rationale, RowResult, Store


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


def written_verdicts(prepared: PreparedJob, store: Store, job_id: str, rows: list[EncodedRow],
                     rationales: Mapping[int, Rationale]) -> list[EncodedRow]:
    """`rows`, each verdict row whose rationale an earlier run wrote replaced by its verdict (a choice row); a
    verdict that no longer fits the context is answered with its error here, its rationale kept."""
    written = [row for row in rows if row.request.index in rationales]
    if not written:
        return rows
    verdicts = _runnable(prepared, store, job_id, written, rationales)
    return [row for row in rows if row.request.index not in rationales] + verdicts


def _runnable(prepared: PreparedJob, store: Store, job_id: str, rows: list[EncodedRow],
              rationales: Mapping[int, Rationale]) -> list[EncodedRow]:
    """The verdicts of `rows` that can run; those that cannot are answered with their error, rationale kept."""
    verdicts = verdict_rows(prepared, rows, rationales)
    prompts = {row.request.index: len(row.prompt_ids) for row in rows}
    failed = [with_rationale(error_result(row.request.index, row.request.id, f"the verdict after the rationale: "
                                          f"{row.error}"), rationales[row.request.index], prompts[row.request.index])
              for row in verdicts if row.error]
    if failed:
        store.commit_batch(job_id, failed, passes=0)
    return [row for row in verdicts if not row.error]


def answers_and_rationales(sequences, ids: Mapping) -> tuple[list[RowResult], dict[int, Rationale]]:
    """The answers of finished sequences (score.Sequence_), and the rationales of those that are a verdict row's
    first stage."""
    results, rationales = [], {}
    for seq in sequences:
        index = seq.row.request.index
        if seq.row.request.verdict is not None:
            rationales[index] = Rationale(seq.text, tuple(seq.generated), seq.logprob, seq.finish or "length")
        else:
            results.append(to_row_result(generation_answer(seq), ids[index]))
    return results, rationales


@dataclass
class ChoicePasses:
    """Choice passes of a run: each scores a batch and commits its answers (a verdict's with its rationale)."""
    model: object
    pad_id: int
    micro_batch: int | None
    commits: PassCommits
    rows_by_index: Mapping[int, EncodedRow]  # the job's rows as the spec encoded them: a verdict's own prompt
    rationales: dict[int, Rationale]  # the written rationales whose verdicts are still to be scored

    def score(self, batch: list[EncodedRow]) -> None:
        commits = self.commits
        started = commits.pass_started(functools.partial(len, batch), answers=True)
        answers = score_choices(self.model, batch, self.pad_id, micro_batch=self.micro_batch)
        faults.reached("pass")
        ids = {r.request.index: r.request.id for r in batch}
        results = [to_row_result(a, ids[a.idx]) for a in answers]
        for result in results:
            if result.idx in self.rationales:
                with_rationale(result, self.rationales[result.idx], len(self.rows_by_index[result.idx].prompt_ids))
        commits.store.commit_batch(commits.job_id, results, passes=1)
        commits.pass_committed(len(answers), started)

    def score_verdicts(self, prepared: PreparedJob, plan: Candidate, rows: list[EncodedRow]) -> None:
        """The verdicts of the rationales this run wrote (`rows`), in choice passes packed as the plan packs rows."""
        if not rows:
            return
        faults.reached("verdicts")
        verdicts = _runnable(prepared, self.commits.store, self.commits.job_id, rows, self.rationales)
        for batch in pack_batches(row_costs(verdicts), plan.batching.batch_size, plan.batching.batch_tokens):
            self.score([verdicts[i] for i in batch])
