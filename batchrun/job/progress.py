"""Progress inside a pass: a pass commits nothing until it ends, so the bar and `status` follow its layer turns (every
forward call's turn at every decoder layer, told by the runtime), the rows it carries, and the job's ETA: the plan's
until the first pass ends, then the plan's remaining passes at the pace the run has measured against it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable

from batchrun.plan import Candidate, format_duration
from batchrun.store import Store, StoreError

log = logging.getLogger("batchrun")

BAR_EVERY_S = 0.5  # the bar redraws at most this often inside a pass
# `status` (another process) reads the pass in flight from the store; each mark is a small write transaction, so
# it is written at most this often (and at the first turn of a run).
STORE_EVERY_S = 2.0
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # the ETA is ours


@dataclass
class _Pass:
    number: int  # 1, 2, ... within the run
    rows: Callable[[], int]  # rows the pass carries (a generation pass knows them once it admitted its rows)
    answers: bool  # it answers every row it carries (a choice pass), so the bar's row count moves with it
    started_at: str
    turns: tuple[int, int] = (0, 1)  # (done, in the pass)

    @property
    def fraction(self) -> float:
        return self.turns[0] / self.turns[1]


@dataclass
class RunProgress:
    """The run's progress as the bar shows it and as `status` reads it from the store (Store.record_progress).
    `pass_seconds`: the run's committed passes, measured (shared with the run's summary)."""
    store: Store
    job_id: str
    bar: object  # tqdm
    plan: Candidate
    pass_seconds: list[float]
    clock: Callable[[], float] = time.monotonic
    _pass: _Pass | None = None
    _bar_at: float = float("-inf")
    _store_at: float = float("-inf")
    _rows_shown: int = 0  # rows of the pass in flight the bar counts already
    _store_failed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.bar.set_postfix_str(self._postfix(None))  # the plan's ETA from the start

    def begin(self, rows: Callable[[], int], *, answers: bool) -> None:
        """A pass starts, carrying `rows()` rows; `answers`: it answers all of them as it ends."""
        started = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        self._pass = _Pass(len(self.pass_seconds) + 1, rows, answers, started)

    def turn(self, done: int, total: int) -> None:
        """The runtime's word that `done` of the pass's `total` layer turns are over."""
        current = self._pass
        if current is None or not total:
            return
        current.turns = (done, total)
        now = self.clock()
        if now - self._bar_at >= BAR_EVERY_S:
            self._bar_at = now
            self._show(current)
        if now - self._store_at >= STORE_EVERY_S:
            self._store_at = now
            self._mark(current)

    def committed(self, rows: int) -> None:
        """The pass in flight committed `rows` answers."""
        self._pass = None
        self.bar.n -= self._rows_shown
        self._rows_shown = 0
        self.bar.update(rows)
        self.bar.set_postfix_str(self._postfix(None), refresh=True)

    def eta_seconds(self, fraction: float = 0.0) -> float | None:
        """Time left: the plan's passes still to run (`fraction` of the one in flight done), at the pace the run's
        committed passes kept against their plan; before any pass commits, the plan's own."""
        planned, done = self.plan.time.pass_seconds, len(self.pass_seconds)
        if planned and None not in planned and done < len(planned):
            left = sum(planned[done:]) - fraction * planned[done]
            planned_done = sum(planned[:done])
            pace = sum(self.pass_seconds) / planned_done if done and planned_done > 0 else 1.0
            return max(left, 0.0) * pace
        if not done:
            return None
        return max(self.plan.batching.passes - done - fraction, 0.0) * sum(self.pass_seconds) / done

    def _show(self, current: _Pass) -> None:
        if current.answers:
            shown = max(min(int(current.rows() * current.fraction), current.rows() - 1), 0)
            self.bar.n += shown - self._rows_shown
            self._rows_shown = shown
        self.bar.set_postfix_str(self._postfix(current), refresh=True)

    def _postfix(self, current: _Pass | None) -> str:
        eta = f"ETA {format_duration(self.eta_seconds(current.fraction if current else 0.0))}"
        if current is None:
            done = len(self.pass_seconds)
            if not done:
                return f"{self.plan.batching.passes} passes planned, {eta}"
            median = sorted(self.pass_seconds)[done // 2]
            return f"{done} of {self.plan.batching.passes} passes, {format_duration(median)} a pass, {eta}"
        return (f"pass {current.number} of {self.plan.batching.passes} {current.fraction:.0%}, "
                f"{current.rows():,} rows in flight, {eta}")

    def _mark(self, current: _Pass) -> None:
        """The pass in flight, for `status`. A failed write costs the run nothing: the next commit says what is
        wrong with the database, if anything is."""
        turns = current.turns
        try:
            self.store.record_progress(self.job_id, {
                "pass_no": current.number, "passes_planned": self.plan.batching.passes, "turns_done": turns[0],
                "turns_total": turns[1], "rows_in_flight": current.rows(),
                "eta_seconds": self.eta_seconds(current.fraction), "started_at": current.started_at})
        except StoreError as error:
            if not self._store_failed:
                log.warning("could not record the pass in flight for `batchrun status`: %s", error)
            self._store_failed = True
