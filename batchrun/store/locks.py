"""Runs and locks: whether the process named in a lock still lives (so a crashed run is taken over), its heartbeat
and progress marks, run durations, what `status` says of a job, and SQLite's own lock where a busy handler does not
wait for it."""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
from datetime import datetime, timezone
from pathlib import Path
from time import monotonic, sleep
from typing import Mapping

from batchrun.host import HOST, pid_alive, process_identity

log = logging.getLogger("batchrun")

# A process on another machine cannot be signalled; its lock counts as held while its heartbeat
# (refreshed by LockHeartbeat while the job runs, and on every commit) is younger than this.
FOREIGN_LOCK_STALE_AFTER_S = 2 * 3600
HEARTBEAT_EVERY_S = 60.0
WAL_RETRY_EVERY_S = 0.01


def utc_now() -> datetime:
    """The store's clock: every time it records or compares is read here."""
    return datetime.now(timezone.utc)


def timestamp() -> str:
    """Now as the store records it: ISO 8601 in UTC, to the millisecond."""
    return utc_now().isoformat(timespec="milliseconds")


def enable_wal(db, timeout_s: float) -> None:
    """Put the database (a sqlite_utils.Database) in WAL mode, waiting up to `timeout_s` for another connection.
    Switching a fresh database takes an exclusive lock, and SQLite answers SQLITE_BUSY at once, without calling the
    busy handler, while another process holds its write lock (to wait there could deadlock): two runs opening a new
    database together met that. Each retry reads the mode again, so a database another process switched meanwhile
    needs nothing more."""
    deadline = monotonic() + timeout_s
    while True:
        try:
            db.enable_wal()
            return
        except sqlite3.OperationalError as error:
            if not _busy(error) or monotonic() >= deadline:
                raise
        sleep(WAL_RETRY_EVERY_S)


def _busy(error: sqlite3.OperationalError) -> bool:
    name = getattr(error, "sqlite_errorname", None)  # Python 3.11+
    return name == "SQLITE_BUSY" if name else str(error) == "database is locked"


def lock_holder_alive(lock: Mapping, *, held_by_this_process: bool, now: datetime | None = None) -> bool:
    """True when the process that wrote `lock` (a locks row) may still be running the job."""
    if lock["host"] != HOST:
        now = now or utc_now()
        heartbeat_age = (now - datetime.fromisoformat(lock["heartbeat_at"])).total_seconds()
        return heartbeat_age < FOREIGN_LOCK_STALE_AFTER_S
    pid = lock["pid"]
    if pid == os.getpid():
        # Our own pid: either this process holds the lock, or a previous process with the same pid
        # (a restarted container's pid 1, a reboot) left it behind.
        return held_by_this_process
    if not pid_alive(pid):
        return False
    recorded, current = lock["process_identity"], process_identity(pid)
    # The pid is alive, but a process started later under the same pid cannot be the holder.
    return recorded is None or current is None or recorded == current


def run_seconds(run: Mapping, *, live: bool, now: datetime) -> float:
    """How long a runs row lasted; a live run counts up to now, a dead unclosed one up to its last commit."""
    started = datetime.fromisoformat(run["started_at"])
    if run["ended_at"]:
        ended = datetime.fromisoformat(run["ended_at"])
    elif live:
        ended = now
    else:
        ended = datetime.fromisoformat(run["last_active_at"] or run["started_at"])
    return max(0.0, (ended - started).total_seconds())


def eta_seconds(summary: dict, elapsed: float, live_run: dict | None, now: datetime) -> float | None:
    """Time left: the running run's passes still to go at its own seconds per pass so far (rows finish in bursts,
    a generation batch's all at its last pass); else, and for a stopped job, pending rows at the rate so far."""
    if not summary["rows_pending"]:
        return None
    if live_run and live_run.get("planned_passes") and live_run["passes"]:
        per_pass = run_seconds(live_run, live=True, now=now) / live_run["passes"]
        return max(live_run["planned_passes"] - live_run["passes"], 0) * per_pass
    done = summary["rows_done"]
    return summary["rows_pending"] * elapsed / done if done and elapsed > 0 else None


def effective_job_state(stored: str, held_by_live_process: bool) -> str:
    # A job left 'running' by a process that died (kill -9, OOM, power cut) is resumable, not running.
    return "interrupted" if stored == "running" and not held_by_live_process else stored


class LockHeartbeat:
    """While a job runs, refresh its lock's heartbeat and the run's last sign of life every `every_s` seconds, on a
    thread with its own connection: one pass of a large model can outlast FOREIGN_LOCK_STALE_AFTER_S, and without
    it another host would take a live job over. A failed refresh is logged, not fatal (the next one may succeed)."""

    def __init__(self, db_path: Path, job_id: str, run_no: int, every_s: float = HEARTBEAT_EVERY_S):
        self.db_path, self.job_id, self.run_no, self.every_s = db_path, job_id, run_no, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_stopped, name="batchrun-heartbeat", daemon=True)

    def __enter__(self) -> LockHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat_until_stopped(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.beat()
            except sqlite3.Error as error:
                log.warning("could not refresh the lock of job %s: %s", self.job_id, error)

    def beat(self) -> None:
        conn = sqlite3.connect(str(self.db_path), timeout=30.0)
        try:
            with conn:
                mark_alive(conn, self.job_id, self.run_no, passes=0)
        finally:
            conn.close()


def mark_alive(conn: sqlite3.Connection, job_id: str, run_no: int | None, passes: int, now: str | None = None) -> None:
    """In the caller's transaction: count `passes` on the job and its run `run_no`, and refresh this process's lock
    heartbeat and the run's last sign of life."""
    now = now or timestamp()
    conn.execute("update jobs set passes_done = passes_done + ? where id = ?", (passes, job_id))
    if run_no is not None:
        conn.execute("update runs set passes = passes + ?, last_active_at = ? where job_id = ? and run_no = ?",
                     (passes, now, job_id, run_no))
    conn.execute("update locks set heartbeat_at = ? where job_id = ? and pid = ? and host = ?",
                 (now, job_id, os.getpid(), HOST))


def job_summary(job: dict, row_counts: Mapping[str, int], *, live: bool) -> dict:
    return {
        "id": job["id"],
        "state": effective_job_state(job["state"], live),
        "model": job["model"],
        "spec_path": job["spec_path"],
        "created_at": job["created_at"],
        "rows_total": job["total_rows"],
        "rows_done": row_counts.get("done", 0),
        "rows_errored": row_counts.get("error", 0),
        "rows_pending": row_counts.get("pending", 0),
        "passes": job["passes_done"],
    }
