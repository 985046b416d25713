"""A job's run as its parts meet: how it is set up besides its job (RunSetup), what the computation of its pending
rows is handed (JobRun) and does (Computation), and what the run returns (RunSummary). No torch here: the Ray driver
module subclasses Computation at import, and `batchrun plan` stays light."""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from batchrun.job.prepare import PreparedJob
from batchrun.plan import Candidate
from batchrun.spec import EncodedRow
from batchrun.host import stops_deferred
from batchrun.store import Reused, Store, StoreError

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    job_id: str
    state: str = "done"
    rows_total: int = 0
    rows_done: int = 0
    rows_errored: int = 0
    rows_computed_now: int = 0
    passes_now: int = 0
    seconds: float = 0.0
    output: str | None = None
    mode: str | None = None
    batch_size: int | None = None
    notes: list[str] = field(default_factory=list)
    bytes_read: int = 0  # weight bytes read from the checkpoint by this run (streamed mode)
    pass_seconds: list[float] = field(default_factory=list)  # wall time of each pass of this run
    empty_answers: int = 0  # generated answers of this run that stopped before any text
    model_reused: bool = False  # the run took a model an earlier run of this process kept open (job.models)
    quality: dict | None = None  # accuracy over labelled rows and the calibration used (output.quality)
    # the grammar's work over this run's structured rows: tokens forced and chosen, masks computed, its share of
    # the passes' time (runtime.GrammarStats)
    grammar: dict | None = None

    @property
    def median_pass_seconds(self) -> float | None:
        ordered = sorted(self.pass_seconds)
        return ordered[len(ordered) // 2] if ordered else None

    def to_json(self) -> dict:
        return {**self.__dict__, "median_pass_seconds": self.median_pass_seconds}


@dataclass(frozen=True)
class JobRun:
    """One run of a job, locked, as its computation is handed it; `summary` is the one the run returns."""
    prepared: PreparedJob
    store: Store
    job_id: str
    summary: RunSummary
    quiet: bool = True
    on_plan: Callable[[Candidate], None] | None = None


class Computation:
    """Where a run's pending rows are computed. The run around them (the job recorded and locked, answers reused,
    its end recorded, its files written) is the same wherever that is; this machine's model computes them unless a
    run is given another computation (the Ray driver's)."""

    def connected(self) -> AbstractContextManager:
        """Held from after the output checks to the run's end: a link to where the rows are computed."""
        return nullcontext()

    def merge_earlier(self, run: JobRun) -> None:
        """Before the pending rows are counted: answers an earlier run had computed there, into the job's store."""

    def compute(self, run: JobRun, rows: list[EncodedRow], partial: dict) -> None:
        """Answer `rows` (pending, runnable, one of each set of repeats) in the job's store; `partial`: row index ->
        tokens an earlier run generated for it."""
        raise NotImplementedError


@dataclass(frozen=True)
class AnswersFile:
    """Where a run writes its answers: the file, its format (read from its name) and whether it may replace one."""
    path: Path
    format: str
    force: bool


@dataclass(frozen=True)
class RunSetup:
    """How a run goes besides its job: the database it records to, the answers file it writes (None: none), whether
    it is quiet, who is shown its plan, and who computes its rows (None: this machine's model)."""
    db_path: Path
    answers: AnswersFile | None = None
    quiet: bool = True
    on_plan: Callable[[Candidate], None] | None = None
    elsewhere: Computation | None = None


def release_run(store: Store, job_id: str, state: str, error: str | None = None) -> None:
    """Release the job. When the run already failed (disk full, ...), a release failing the same way must not
    hide that first error; the lock left behind is taken over by the next run, as after a crash. A SIGTERM waits
    for the release: cut short, it would leave the run looking dead (and maybe killed for lack of memory)."""
    try:
        with stops_deferred():
            store.release(job_id, state, error)
    except StoreError as failure:
        if state == "done":
            raise
        log.warning("could not record how job %s's run ended (%s): %s; the next run will take its lock over", job_id,
                    error or state, failure)


def reused_note(reused: Reused) -> str | None:
    """What a run says of the answers it took from earlier jobs (at most three named), None where it took none."""
    if not (reused.answers or reused.partial_rows):
        return None
    jobs = ", ".join(reused.from_jobs[:3])  # a job rerun many times would otherwise list every earlier run
    if len(reused.from_jobs) > 3:
        jobs += f" and {len(reused.from_jobs) - 3} more"
    note = f"{reused.answers} answer(s) taken from earlier job(s) {jobs}: the same rows on the same model"
    if reused.partial_rows:
        note += f"; {reused.partial_rows} row(s) resume from the tokens generated for them there"
    return note
