"""A job's runs and its lock: taking the lock (over a dead holder's), the run that opens, what the run records as it
goes (its plan, its passes, the pass in flight), closing it, and the runs as they are told afterwards."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

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
        now, pid = timestamp(), os.getpid()
        with self._write("lock the job") as conn:
            self._require_job(job_id)
            lock = self._row("locks", job_id)
            if lock is not None and self._holder_alive(job_id, lock):
                raise JobLocked(job_id, lock["pid"], lock["host"], lock["acquired_at"])
            # Runs still marked running belong to a dead holder: they died at their last sign of life.
            conn.execute("update runs set end_state = 'died', ended_at = coalesce(last_active_at, started_at) "
                         "where job_id = ? and end_state = 'running'", (job_id,))
            (run_no,) = conn.execute("select coalesce(max(run_no), 0) + 1 from runs where job_id = ?",
                                     (job_id,)).fetchone()
            self.db["runs"].insert({"job_id": job_id, "run_no": run_no, "pid": pid, "host": HOST, "started_at": now,
                                    "last_active_at": now, "end_state": "running", "passes": 0})
            self.db["locks"].insert({"job_id": job_id, "pid": pid, "host": HOST, "run_no": run_no,
                                     "process_identity": process_identity(pid), "acquired_at": now,
                                     "heartbeat_at": now}, replace=True)
            self.db["jobs"].update(job_id, {"state": "running"})
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
        self._update_current_run(job_id, "record the run plan", {
            "batch_size": batch_size, "planned_peak_bytes": planned_peak_bytes, "memory_cgroup": memory_cgroup,
            "oom_kills_at_start": oom_kills_at_start, "planned_passes": planned_passes})

    def record_run_estimate(self, job_id: str, *, mode: str, planned_seconds: float | None) -> None:
        """Note the current run's mode (resident or streamed) and the plan's ETA for the rows it started with."""
        self._update_current_run(job_id, "record the run's estimate",
                                 {"mode": mode, "planned_seconds": planned_seconds})

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
            self.db["passes"].insert({
                "job_id": job_id, "run_no": run_no, "pass_no": pass_no, "finished_at": timestamp(),
                "seconds": float(seconds), "rows_finished": int(rows_finished), "bytes_read": bytes_read,
                "read_seconds": read_seconds, "peak_memory_bytes": peak_memory_bytes,
                "planned_seconds": planned_seconds})
        return pass_no

    def record_progress(self, job_id: str, progress: Mapping[str, object]) -> None:
        """The current run's pass in flight (PROGRESS_COLUMNS: pass_no, turns_done, ...), replacing what the job said
        before, for `status` (another process). It commits no answer, so no fault point sits in it; the caller
        decides what a failed write costs."""
        unknown = set(progress) - set(PROGRESS_COLUMNS)
        if unknown:
            raise ValueError(f"unknown progress fields {sorted(unknown)}; known: {', '.join(PROGRESS_COLUMNS)}")
        values = {**progress, "job_id": job_id, "run_no": self._require_current_run(job_id), "updated_at": timestamp()}
        with self._write("record the pass in flight", fault_point=None):
            self.db["pass_progress"].insert(values, replace=True)

    def release(self, job_id: str, end_state: str, error: str | None = None) -> None:
        """Close this process's run with end_state (and, for a failure, why), drop its lock, and set the job state
        to end_state."""
        if end_state not in RUN_END_STATES:
            raise ValueError(f"run end state must be one of {', '.join(RUN_END_STATES)}; got {end_state!r}")
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
        with self._write("release the job"):
            if run_no is not None:
                self.db["runs"].update((job_id, run_no), {"end_state": end_state, "ended_at": now,
                                                          "last_active_at": now, "error": error})
            self.db["locks"].delete_where("job_id = ? and pid = ? and host = ?", [job_id, os.getpid(), HOST])
            # If another process took the lock over meanwhile, the job's state is its to set.
            if self._row("locks", job_id) is None:
                self.db["jobs"].update(job_id, {"state": end_state})

    def runs(self, job_id: str) -> list[dict]:
        """Every run of the job, the live one included, oldest first, each with all its columns; end_state 'died'
        for one left 'running' by a process that no longer runs it."""
        with self._read():
            self._require_job(job_id)
            runs = list(self.db["runs"].rows_where("job_id = ?", [job_id], order_by="run_no"))
            live_run_no = self._live_run_no(job_id, self._row("locks", job_id))
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
        with self._read():
            self._require_job(job_id)
            return list(self.db["passes"].rows_where("job_id = ?", [job_id], order_by="run_no, pass_no"))

    def _update_current_run(self, job_id: str, action: str, values: Mapping[str, object]) -> None:
        run_no = self._require_current_run(job_id)
        with self._write(action):
            self.db["runs"].update((job_id, run_no), dict(values))

    def _require_current_run(self, job_id: str) -> int:
        run_no = self._current_run.get(job_id)
        if run_no is None:
            raise RuntimeError(f"job {job_id} is not acquired by this store: call acquire() first")
        return run_no

    def _lock_key(self, job_id: str) -> tuple[str, str]:
        return (self._lock_key_prefix, job_id)

    def _holder_alive(self, job_id: str, lock: dict) -> bool:
        return lock_holder_alive(lock, held_by_this_process=self._lock_key(job_id) in _HELD_IN_THIS_PROCESS)

    def _live_run_no(self, job_id: str, lock: dict | None) -> int | None:
        """The run_no of the run a live lock holder is executing, None if nobody holds the job."""
        if lock is None or not self._holder_alive(job_id, lock):
            return None
        return lock["run_no"]
