"""A job's runs and its lock: taking the lock (over a dead holder's), the run that opens, what the run records as it
goes (its plan, its passes, the pass in flight), closing it, and the runs as they are told afterwards."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from batchrun.store.connection import Connection
from batchrun.store.errors import JobLocked, StoreError
from batchrun.store.files import SpaceReserve, is_disk_full
from batchrun.store.locks import (HEARTBEAT_EVERY_S, HOST, LockHeartbeat, lock_holder_alive, process_identity,
                                  timestamp)

RUN_END_STATES = ("done", "interrupted", "failed")  # what a run says as it ends; one that could not is 'died'
PREVIOUS_RUN_KEYS = ("run_no", "pid", "host", "started_at", "ended_at", "end_state", "batch_size", "planned_peak_bytes",
                     "passes", "memory_cgroup", "oom_kills_at_start")
# What a running job tells of its pass in flight (record_progress; migrations.m012_pass_progress).
PROGRESS_COLUMNS = ("pass_no", "passes_planned", "turns_done", "turns_total", "rows_in_flight", "eta_seconds",
                    "started_at")

# (database path, job id) pairs whose lock this process holds: tells "our own pid, still running here"
# apart from "our pid, left behind by an earlier process that had the same pid".
_HELD_IN_THIS_PROCESS: set[tuple[str, str]] = set()


class Runs(Connection):
    """The progress database as a job's runs see it: one lock a job, one run a process that takes it."""

    def __init__(self, path: Path | str):
        self._lock_key_prefix = str(Path(path).resolve())
        self._current_run: dict[str, int] = {}  # job id -> run_no this store opened in acquire()
        self._reserves: dict[str, SpaceReserve] = {}  # job id -> the disk space its run keeps to record its end
        super().__init__(path)

    def close(self) -> None:
        # A closed store can commit nothing more: its locks no longer count as held by this process, so a
        # later acquire here takes them over (the rows stay for other processes to see until then).
        for job_id in self._current_run:
            _HELD_IN_THIS_PROCESS.discard(self._lock_key(job_id))
        for reserve in self._reserves.values():
            reserve.free()
        super().close()

    def acquire(self, job_id: str) -> None:
        """Lock the job for this process, take over a dead holder's lock, mark the job running, open a run."""
        now = timestamp()
        with self._write("lock the job") as conn:
            self._require_job(conn, job_id)
            lock = self._lock_row(job_id)
            if lock is not None and self._holder_alive(job_id, lock):
                raise JobLocked(job_id, lock["pid"], lock["host"], lock["acquired_at"])
            # Runs still marked running belong to a dead holder: they died at their last sign of life.
            conn.execute(
                "update runs set end_state = 'died', ended_at = coalesce(last_active_at, started_at) "
                "where job_id = ? and end_state = 'running'",
                (job_id,),
            )
            (run_no,) = conn.execute(
                "select coalesce(max(run_no), 0) + 1 from runs where job_id = ?", (job_id,)
            ).fetchone()
            conn.execute(
                "insert into runs (job_id, run_no, pid, host, started_at, last_active_at, end_state, passes) "
                "values (?, ?, ?, ?, ?, ?, 'running', 0)",
                (job_id, run_no, os.getpid(), HOST, now, now),
            )
            conn.execute(
                "insert or replace into locks (job_id, pid, host, process_identity, run_no, acquired_at, "
                "heartbeat_at) values (?, ?, ?, ?, ?, ?, ?)",
                (job_id, os.getpid(), HOST, process_identity(os.getpid()), run_no, now, now),
            )
            conn.execute("update jobs set state = 'running' where id = ?", (job_id,))
        self._current_run[job_id] = run_no
        _HELD_IN_THIS_PROCESS.add(self._lock_key(job_id))
        self._reserves[job_id] = SpaceReserve(self.path, job_id)
        self._reserves[job_id].hold()

    def heartbeat_while_running(self, job_id: str, every_s: float = HEARTBEAT_EVERY_S) -> LockHeartbeat:
        """A context in which a thread refreshes this process's lock on the job every `every_s` seconds."""
        return LockHeartbeat(self.path, job_id, self._require_current_run(job_id), every_s)

    def record_run_plan(self, job_id: str, *, batch_size: int, planned_peak_bytes: int,
                        memory_cgroup: str | None = None, oom_kills_at_start: int | None = None,
                        planned_passes: int | None = None) -> None:
        """Note the current run's batch size, planned peak memory, OOM-kill baseline (read after a crash) and
        planned passes (for status's ETA)."""
        run_no = self._require_current_run(job_id)
        with self._write("record the run plan") as conn:
            conn.execute(
                "update runs set batch_size = ?, planned_peak_bytes = ?, memory_cgroup = ?, oom_kills_at_start = ?, "
                "planned_passes = ? where job_id = ? and run_no = ?",
                (batch_size, planned_peak_bytes, memory_cgroup, oom_kills_at_start, planned_passes, job_id, run_no),
            )

    def record_run_estimate(self, job_id: str, *, mode: str, planned_seconds: float | None) -> None:
        """Note the current run's mode (resident or streamed) and the plan's ETA for the rows it started with."""
        run_no = self._require_current_run(job_id)
        with self._write("record the run's estimate") as conn:
            conn.execute("update runs set mode = ?, planned_seconds = ? where job_id = ? and run_no = ?",
                         (mode, planned_seconds, job_id, run_no))

    def record_pass(self, job_id: str, *, seconds: float, rows_finished: int, bytes_read: int | None = None,
                    read_seconds: float | None = None, peak_memory_bytes: int | None = None,
                    planned_seconds: float | None = None) -> int:
        """Record one committed pass of the current run (numbered 1, 2, ... within the run); returns its number.
        `bytes_read`, `read_seconds`, `peak_memory_bytes` and `planned_seconds` are None where not known."""
        if seconds < 0 or rows_finished < 0:
            raise ValueError(f"a pass takes seconds >= 0 and rows_finished >= 0; got {seconds}, {rows_finished}")
        run_no = self._require_current_run(job_id)
        with self._write("record the pass's timing") as conn:
            (pass_no,) = conn.execute("select coalesce(max(pass_no), 0) + 1 from passes where job_id = ? and "
                                      "run_no = ?", (job_id, run_no)).fetchone()
            conn.execute(
                "insert into passes (job_id, run_no, pass_no, finished_at, seconds, rows_finished, bytes_read, "
                "read_seconds, peak_memory_bytes, planned_seconds) values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job_id, run_no, pass_no, timestamp(), float(seconds), int(rows_finished), bytes_read, read_seconds,
                 peak_memory_bytes, planned_seconds),
            )
        return pass_no

    def record_progress(self, job_id: str, progress: Mapping[str, object]) -> None:
        """The current run's pass in flight (PROGRESS_COLUMNS: pass_no, turns_done, ...), replacing what the job said
        before, for `status` (another process). It commits no answer, so no fault point sits in it; the caller
        decides what a failed write costs."""
        unknown = set(progress) - set(PROGRESS_COLUMNS)
        if unknown:
            raise ValueError(f"unknown progress fields {sorted(unknown)}; known: {', '.join(PROGRESS_COLUMNS)}")
        values = {**progress, "job_id": job_id, "run_no": self._require_current_run(job_id), "updated_at": timestamp()}
        with self._write("record the pass in flight", fault_point=None) as conn:
            conn.execute(f"insert or replace into pass_progress ({', '.join(values)}) "
                         f"values ({', '.join('?' * len(values))})", tuple(values.values()))

    def release(self, job_id: str, end_state: str, error: str | None = None) -> None:
        """Close this process's run with end_state (and, for a failure, why), drop its lock, and set the job state
        to end_state."""
        _check_choice("run end state", end_state, RUN_END_STATES)
        run_no = self._current_run.pop(job_id, None)
        reserve = self._reserves.pop(job_id, None)
        try:
            try:
                self._close_run(job_id, run_no, end_state, error)
            except StoreError as failure:
                # On a full disk the reserve's blocks make room for this last write.
                if not (is_disk_full(failure.__cause__) and reserve is not None and reserve.free()):
                    raise
                self._close_run(job_id, run_no, end_state, error)
        finally:
            _HELD_IN_THIS_PROCESS.discard(self._lock_key(job_id))
            if reserve is not None:
                reserve.free()

    def _close_run(self, job_id: str, run_no: int | None, end_state: str, error: str | None) -> None:
        now = timestamp()
        with self._write("release the job") as conn:
            if run_no is not None:
                conn.execute(
                    "update runs set end_state = ?, ended_at = ?, last_active_at = ?, error = ? "
                    "where job_id = ? and run_no = ?",
                    (end_state, now, now, error, job_id, run_no),
                )
            conn.execute(
                "delete from locks where job_id = ? and pid = ? and host = ?", (job_id, os.getpid(), HOST)
            )
            # If another process took the lock over meanwhile, the job's state is its to set.
            if conn.execute("select 1 from locks where job_id = ?", (job_id,)).fetchone() is None:
                conn.execute("update jobs set state = ? where id = ?", (end_state, job_id))

    def runs(self, job_id: str) -> list[dict]:
        """Every run of the job, the live one included, oldest first, each with all its columns; end_state 'died'
        for one left 'running' by a process that no longer runs it."""
        with self._read() as conn:
            self._require_job(conn, job_id)
            runs = list(self.db.query("select * from runs where job_id = ? order by run_no", (job_id,)))
            lock = self._lock_row(job_id)
        live_run_no = self._live_run_no(job_id, lock)
        for run in runs:
            if run["end_state"] == "running" and live_run_no != run["run_no"]:
                run["end_state"] = "died"
        return runs

    def previous_runs(self, job_id: str) -> list[dict]:
        """Every run before the current one, oldest first, with what a new run learns from it (PREVIOUS_RUN_KEYS):
        end_state 'died' for one whose process ended without closing it (SIGKILL, the OOM killer, a power cut),
        'interrupted' for one stopped by Ctrl-C or SIGTERM."""
        current = self._current_run.get(job_id)
        return [{key: run[key] for key in PREVIOUS_RUN_KEYS} for run in self.runs(job_id)
                if current is None or run["run_no"] < current]

    def passes(self, job_id: str) -> list[dict]:
        """Every recorded pass of the job, in the order they ran (run by run), each as its `passes` row."""
        with self._read() as conn:
            self._require_job(conn, job_id)
            return list(self.db.query("select * from passes where job_id = ? order by run_no, pass_no", (job_id,)))

    def _require_current_run(self, job_id: str) -> int:
        run_no = self._current_run.get(job_id)
        if run_no is None:
            raise RuntimeError(f"job {job_id} is not acquired by this store: call acquire() first")
        return run_no

    def _lock_row(self, job_id: str) -> dict | None:
        rows = list(self.db.query("select * from locks where job_id = ?", (job_id,)))
        return rows[0] if rows else None

    def _lock_key(self, job_id: str) -> tuple[str, str]:
        return (self._lock_key_prefix, job_id)

    def _holder_alive(self, job_id: str, lock: dict) -> bool:
        return lock_holder_alive(lock, held_by_this_process=self._lock_key(job_id) in _HELD_IN_THIS_PROCESS)

    def _live_run_no(self, job_id: str, lock: dict | None) -> int | None:
        """The run_no of the run a live lock holder is executing, None if nobody holds the job."""
        if lock is None or not self._holder_alive(job_id, lock):
            return None
        return lock["run_no"]


def _check_choice(what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")
