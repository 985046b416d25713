"""What a report is drawn from: one read of the job's state, its runs and passes, and its finished rows as columns.

Everything is read once, up front, in plain Python lists, so the sections only count and sort; a job still running
is read as it stands (a snapshot: its pending rows are counted, not shown).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

import pyarrow as pa

from batchrun.output import job_answers, results_table
from batchrun.output import quality as answers_quality
from batchrun.store import Store

CHOICE, GENERATION = "choice", "generation"
GENERATION_FINISHES = ("stop", "length")


@dataclass
class Rows:
    """The finished rows, column by column, as the output has them: `answers` is the answer the output gives
    (calibrated where the job calibrates), `probs` the model's own probabilities; `label`, `correct` and
    `calibrated_probs` are None where the table has no such column."""
    ids: list
    answers: list[str | None]
    probs: list[dict[str, float] | None]
    scores: list[float | None]
    output_tokens: list[int | None]
    finish: list[str | None]
    errors: list[str | None]
    labels: list[str | None] | None = None
    correct: list[bool | None] | None = None
    calibrated: list[dict[str, float] | None] | None = None

    @classmethod
    def from_table(cls, table: pa.Table) -> Rows:
        def column(name: str) -> list | None:
            return table.column(name).to_pylist() if name in table.column_names else None

        def as_dicts(pairs: list | None) -> list | None:
            # Arrow gives a map column as key/value pairs
            return None if pairs is None else [None if p is None else dict(p) for p in pairs]

        count = table.num_rows
        return cls(ids=column("id") or [], answers=column("answer") or [None] * count,
                   probs=as_dicts(column("choice_probs")) or [None] * count,
                   scores=column("score") or [None] * count, output_tokens=column("output_tokens") or [None] * count,
                   finish=column("finish_reason") or [None] * count, errors=column("error") or [None] * count,
                   labels=column("label"), correct=column("correct"),
                   calibrated=as_dicts(column("calibrated_probs")))

    def __len__(self) -> int:
        return len(self.ids)

    def of_kind(self, kind: str) -> list[int]:
        """Positions of the answered rows of a kind: choice rows, or generation rows (stopped or at their limit)."""
        wanted = (CHOICE,) if kind == CHOICE else GENERATION_FINISHES
        return [i for i, reason in enumerate(self.finish) if reason in wanted and not self.errors[i]]

    def errored(self) -> list[int]:
        return [i for i, reason in enumerate(self.finish) if reason == "error" or self.errors[i]]

    def own_answer(self, position: int) -> str | None:
        """The model's own pick of a choice row: its most probable choice (the first of a tie, as the model picks)."""
        probs = self.probs[position]
        return max(probs, key=probs.__getitem__) if probs else self.answers[position]

    def confidence(self, position: int) -> float | None:
        """The probability of the answer the output gives: the calibrated one where the row was calibrated."""
        calibrated = self.calibrated[position] if self.calibrated else None
        probs = calibrated or self.probs[position]
        return None if probs is None else probs.get(self.answers[position])


@dataclass
class ReportData:
    """A job as its report shows it: status(), every run, every recorded pass, the finished rows, and (where rows
    carry labels) the quality metrics of the output's job_quality contract."""
    job: dict
    runs: list[dict]
    passes: list[dict]
    rows: Rows
    settings: dict = field(default_factory=dict)
    quality: dict | None = None
    built_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def snapshot(self) -> bool:
        """The job may still change: rows are pending, or a live process runs it."""
        return bool(self.job["rows_pending"]) or self.job["state"] == "running"


def read_job(store: Store, job_id: str) -> ReportData:
    """Everything the report shows of `job_id`, read from `store` now: the rows as the job's output has them
    (answers_table's columns) and their quality (job_quality's), from one read of the rows."""
    job = store.status(job_id)
    answers = job_answers(store, job_id)
    return ReportData(job=job, runs=store.runs(job_id), passes=store.passes(job_id),
                      rows=Rows.from_table(results_table(answers.rows)), settings=store.job_settings(job_id),
                      quality=answers_quality(answers))
