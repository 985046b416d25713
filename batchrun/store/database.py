"""The durable progress store: jobs, their rows, runs, passes and locks, in SQLite through sqlite-utils.

A batch of answers is committed in one transaction with synchronous=FULL, so once commit_batch returns
those answers survive a crash or a power cut, and a resumed job redoes only what was never committed.
"""
from __future__ import annotations

import json
import os
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import sqlite_utils

from batchrun.errors import BatchrunError
from batchrun.host import faults
from batchrun.store import migrations as store_migrations
from batchrun.store.files import SpaceReserve, describe_failure, is_damage, is_disk_full, orphaned_log_message
from batchrun.store.locks import (HEARTBEAT_EVERY_S, HOST, LockHeartbeat, enable_wal, eta_seconds, job_summary,
                                  lock_holder_alive, log, mark_alive, process_identity, run_seconds)
from batchrun.store.reuse import Reused, fill_duplicates, reuse_answers
from batchrun.store.rows import ROW_UPDATE_SQL, JobRow, RowResult, row_result_from_db, row_update_params

__all__ = ["DatabaseDamaged", "JobLocked", "JobNotFound", "RowResult", "Store", "StoreError"]

BUSY_TIMEOUT_S = 30.0  # how long a reader (`status`) or a second writer waits for a running job's commit
RUN_END_STATES = ("done", "interrupted", "failed")  # what a run says as it ends; one that could not is 'died'
PREVIOUS_RUN_KEYS = ("run_no", "pid", "host", "started_at", "ended_at", "end_state", "batch_size", "planned_peak_bytes",
                     "passes", "memory_cgroup", "oom_kills_at_start")
# What a running job tells of its pass in flight (record_progress; migrations.m012_pass_progress).
PROGRESS_COLUMNS = ("pass_no", "passes_planned", "turns_done", "turns_total", "rows_in_flight", "eta_seconds",
                    "started_at")

# (database path, job id) pairs whose lock this process holds: tells "our own pid, still running here"
# apart from "our pid, left behind by an earlier process that had the same pid".
_HELD_IN_THIS_PROCESS: set[tuple[str, str]] = set()


class JobLocked(BatchrunError, RuntimeError):
    """Another live process is running the same job; it holds the job's lock until it ends."""

    def __init__(self, job_id: str, pid: int, host: str, since: str):
        self.job_id, self.pid, self.host, self.since = job_id, pid, host, since
        super().__init__(f"job {job_id} is being run by process {pid} on {host} since {since}; wait for it or stop it")


class StoreError(BatchrunError, RuntimeError):
    """The progress database could not be read or written (disk full, I/O error, not a database)."""


class DatabaseDamaged(StoreError):
    """SQLite reports the database file malformed: pages torn, truncated or overwritten. `batchrun db salvage` copies
    what is still readable into a new database."""


class JobNotFound(BatchrunError, LookupError):
    """A job reference matched no job, or more than one."""


class Store:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        self._lock_key_prefix = str(self.path.resolve())
        self._current_run: dict[str, int] = {}  # job id -> run_no this Store opened in acquire()
        self._reserves: dict[str, SpaceReserve] = {}  # job id -> the disk space its run keeps to record its end
        if (orphaned := orphaned_log_message(self.path)) is not None:
            raise StoreError(orphaned)
        with self._translate_errors("open the progress database"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S)
            try:
                self.db = sqlite_utils.Database(conn, execute_plugins=False)
                enable_wal(self.db, BUSY_TIMEOUT_S)
                # FULL, not NORMAL: in WAL mode NORMAL may lose the last commits on power loss.
                self.db.execute("PRAGMA synchronous=FULL")
                if store_migrations.pending_migrations(self.db):
                    with self._write("upgrade the database schema"):
                        store_migrations.apply_pending(self.db)
            except BaseException:
                conn.close()
                raise

    def close(self) -> None:
        # A closed store can commit nothing more: its locks no longer count as held by this process, so a
        # later acquire here takes them over (the rows stay for other processes to see until then).
        for job_id in self._current_run:
            _HELD_IN_THIS_PROCESS.discard(self._lock_key(job_id))
        for reserve in self._reserves.values():
            reserve.free()
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- jobs and rows -------------------------------------------------------------------------

    def ensure_job(
        self,
        fingerprint: str,
        *,
        spec_path: str,
        model: str,
        settings: dict,
        rows: Sequence[tuple],
    ) -> str:
        """Record a job and its rows (all pending) once; return its id. The same fingerprint -> the same job.
        Each row is a JobRow or a tuple of its leading fields: (idx, id), (idx, id, key), ..."""
        if len(fingerprint) < 16:
            raise ValueError(f"job fingerprint {fingerprint!r} is too short: need at least 16 characters")
        job_id = fingerprint[:16]
        with self._write("record the job") as conn:
            existing = conn.execute("select fingerprint from jobs where id = ?", (job_id,)).fetchone()
            if existing is not None:
                if existing[0] != fingerprint:
                    raise StoreError(
                        f"job id {job_id} in {self.path} already belongs to fingerprint {existing[0]}, "
                        f"not {fingerprint}"
                    )
                _restore_lost_rows(conn, job_id, rows)
                return job_id
            conn.execute(
                "insert into jobs (id, fingerprint, spec_path, model, settings_json, created_at, state, "
                "total_rows, passes_done) values (?, ?, ?, ?, ?, ?, 'pending', ?, 0)",
                (job_id, fingerprint, str(spec_path), model, json.dumps(settings, sort_keys=True), _now(), len(rows)),
            )
            conn.executemany("insert" + _PENDING_ROW_SQL, _pending_row_values(job_id, rows))
        return job_id

    def reuse_answers(self, job_id: str) -> Reused:
        """Give this job's pending rows the answers (or tokens so far) other jobs have for the same rows. Another job's
        damaged pages cost only the reuse: this job's rows are computed instead."""
        try:
            with self._write("take answers from earlier jobs") as conn:
                return reuse_answers(conn, job_id)
        except DatabaseDamaged as damaged:
            log.warning("no answers taken from earlier jobs: %s", damaged)
            return Reused()

    def fill_duplicates(self, job_id: str) -> int:
        """Answer pending rows that repeat a finished row of the same job exactly; returns how many."""
        with self._write("answer repeated rows") as conn:
            return fill_duplicates(conn, job_id)

    def pending_indices(self, job_id: str) -> list[int]:
        with self._translate_errors("read pending rows"):
            cursor = self.db.execute(
                "select idx from rows where job_id = ? and state = 'pending' order by idx", (job_id,)
            )
            return [idx for (idx,) in cursor]

    def results(self, job_id: str) -> list[RowResult]:
        """Finished rows (answered or errored) in input order."""
        with self._translate_errors("read results"):
            rows = self.db.query(
                "select * from rows where job_id = ? and state != 'pending' order by idx", (job_id,)
            )
            return [row_result_from_db(row) for row in rows]

    # ---- committing progress -------------------------------------------------------------------

    def commit_batch(self, job_id: str, results: Sequence[RowResult], passes: int) -> None:
        """Save finished rows, drop their partial tokens and count the passes, all in one transaction."""
        self.commit_pass(job_id, results, {}, passes)

    def record_errors(self, job_id: str, results: Sequence[RowResult]) -> None:
        """Save rows that failed before any pass (invalid input, prompt too long)."""
        for result in results:
            if not result.failed:
                raise ValueError(f"row {result.idx} is not an error: use commit_batch for answers")
        self.commit_batch(job_id, results, passes=0)

    def commit_pass(self, job_id: str, finished: Sequence[RowResult],
                    partial: Mapping[int, tuple[Sequence[int], float]], passes: int = 1) -> None:
        """After one pass: rows that finished in it (their tokens so far dropped), the tokens generated so far (and
        their summed logprob) of the rows still going, the pass count.

        One transaction, so a crash leaves either the state before the pass or the state after it.
        """
        if passes < 0:
            raise ValueError(f"passes must be >= 0, got {passes}")
        now = _now()
        updates = [row_update_params(job_id, result) for result in finished]
        upserts = []
        for idx, (token_ids, logprob) in partial.items():
            as_ints = [int(token) for token in token_ids]  # numpy / tensor scalars are not JSON
            upserts.append((job_id, idx, json.dumps(as_ints), len(as_ints), float(logprob), now))
        with self._write("save generated tokens" if partial else f"save {len(updates)} answers") as conn:
            if conn.executemany(ROW_UPDATE_SQL, updates).rowcount != len(updates):
                raise ValueError(f"job {job_id} has no rows {self._missing_rows(job_id, finished)}")
            conn.executemany("delete from partial where job_id = ? and idx = ?", [(job_id, r.idx) for r in finished])
            conn.executemany(
                "insert into partial (job_id, idx, token_ids_json, token_count, logprob, updated_at) "
                "values (?, ?, ?, ?, ?, ?) "
                "on conflict (job_id, idx) do update set token_ids_json = excluded.token_ids_json, "
                "token_count = excluded.token_count, logprob = excluded.logprob, updated_at = excluded.updated_at",
                upserts,
            )
            mark_alive(conn, job_id, self._current_run.get(job_id), passes, now)

    def partial_tokens(self, job_id: str) -> dict[int, tuple[list[int], float]]:
        """idx -> (tokens generated so far, their summed logprob) for rows interrupted mid-generation."""
        with self._translate_errors("read generated tokens"):
            cursor = self.db.execute("select idx, token_ids_json, logprob from partial where job_id = ?", (job_id,))
            return {idx: (json.loads(token_ids), logprob or 0.0) for idx, token_ids, logprob in cursor}

    def heartbeat_while_running(self, job_id: str, every_s: float = HEARTBEAT_EVERY_S) -> LockHeartbeat:
        """A context in which a thread refreshes this process's lock on the job every `every_s` seconds."""
        return LockHeartbeat(self.path, job_id, self._require_current_run(job_id), every_s)

    # ---- locks and runs ------------------------------------------------------------------------

    def acquire(self, job_id: str) -> None:
        """Lock the job for this process, take over a dead holder's lock, mark the job running, open a run."""
        now = _now()
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
                (job_id, run_no, pass_no, _now(), float(seconds), int(rows_finished), bytes_read, read_seconds,
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
        values = {**progress, "job_id": job_id, "run_no": self._require_current_run(job_id), "updated_at": _now()}
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
        now = _now()
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

    def previous_runs(self, job_id: str) -> list[dict]:
        """Every run before the current one, oldest first, with what a new run learns from it (PREVIOUS_RUN_KEYS):
        end_state 'died' for one whose process ended without closing it (SIGKILL, the OOM killer, a power cut),
        'interrupted' for one stopped by Ctrl-C or SIGTERM."""
        current = self._current_run.get(job_id)
        return [{key: run[key] for key in PREVIOUS_RUN_KEYS} for run in self.runs(job_id)
                if current is None or run["run_no"] < current]

    # ---- reading state -------------------------------------------------------------------------

    def status(self, job_id: str) -> dict:
        """jobs()'s summary plus partial progress, elapsed time, ETA and the live holder's pid."""
        with self._read(f"read job {job_id}") as conn:
            job = self._require_job(conn, job_id)
            counts = dict(conn.execute("select state, count(*) from rows where job_id = ? group by state", (job_id,)))
            partial_rows, partial_token_count = conn.execute(
                "select count(*), coalesce(sum(token_count), 0) from partial where job_id = ?", (job_id,)
            ).fetchone()
            runs = list(self.db.query("select * from runs where job_id = ?", (job_id,)))
            lock = self._lock_row(job_id)
            progress = next(iter(self.db.query("select * from pass_progress where job_id = ?", (job_id,))), None)
        live_run_no = self._live_run_no(job_id, lock)
        now = datetime.now(timezone.utc)
        elapsed = sum(run_seconds(run, live=run["run_no"] == live_run_no, now=now) for run in runs)
        summary = job_summary(job, counts, live=live_run_no is not None)
        live = next((run for run in runs if run["run_no"] == live_run_no), None)
        in_pass = _in_pass(progress, live, now)
        last = max(runs, key=lambda run: run["run_no"], default=None)
        return {
            **summary,
            # rows the job has but its database lost (salvaged from damage): recorded again when it next runs
            "rows_lost": max(summary["rows_total"] - sum(counts.values()), 0),
            "partial_rows": partial_rows,
            "partial_tokens": partial_token_count,
            "elapsed_seconds": elapsed,
            # the running job's own ETA where it gave one: from the plan until its first pass ends, then its pace
            "eta_seconds": (in_pass["eta_seconds"] if in_pass and in_pass["eta_seconds"] is not None
                            else eta_seconds(summary, elapsed, live, now)),
            "in_pass": in_pass,
            "last_error": last.get("error") if last and last["end_state"] == "failed" else None,
            "running_pid": lock["pid"] if live_run_no is not None else None,
            "running_host": lock["host"] if live_run_no is not None else None,
        }

    def passes(self, job_id: str) -> list[dict]:
        """Every recorded pass of the job, in the order they ran (run by run), each as its `passes` row."""
        with self._read() as conn:
            self._require_job(conn, job_id)
            return list(self.db.query("select * from passes where job_id = ? order by run_no, pass_no", (job_id,)))

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

    def job_settings(self, job_id: str) -> dict:
        """The answer settings the job was recorded with (template, choices, max_new_tokens, ...)."""
        with self._read() as conn:
            return json.loads(self._require_job(conn, job_id)["settings_json"] or "{}")

    def jobs(self) -> list[dict]:
        """One summary per job, newest first, with its last run's reason where that run failed. A job whose rows sit
        on damaged pages is listed with state 'damaged' and why, its counts None: the others list as usual."""
        with self._read() as conn:
            jobs = list(self.db.query("select * from jobs order by created_at desc, rowid desc"))
            locks = {lock["job_id"]: lock for lock in self.db.query("select * from locks")}
            failures = dict(conn.execute(
                "select job_id, error from runs where end_state = 'failed' and run_no = "
                "(select max(run_no) from runs last where last.job_id = runs.job_id)"))
        counts = self._row_counts([job["id"] for job in jobs])
        listed = []
        for job in jobs:
            found = counts[job["id"]]
            if isinstance(found, DatabaseDamaged):
                summary = job_summary(job, {}, live=False)
                summary.update(state="damaged", rows_done=None, rows_errored=None, rows_pending=None,
                               last_error=str(found))
            else:
                summary = job_summary(job, found, live=self._live_run_no(job["id"], locks.get(job["id"])) is not None)
                summary["last_error"] = failures.get(job["id"])
            listed.append(summary)
        return listed

    def _row_counts(self, job_ids: list[str]) -> dict[str, dict[str, int] | DatabaseDamaged]:
        """Job id -> rows by state: one scan, or where a page is damaged, job by job, so one job's damaged rows
        cost only that job its counts."""
        try:
            with self._read() as conn:
                counts: dict[str, dict[str, int]] = {job_id: {} for job_id in job_ids}
                for job_id, state, count in conn.execute(
                        "select job_id, state, count(*) from rows group by job_id, state"):
                    counts.setdefault(job_id, {})[state] = count
                return counts
        except DatabaseDamaged:
            pass
        found: dict[str, dict[str, int] | DatabaseDamaged] = {}
        for job_id in job_ids:
            try:
                with self._read(f"read job {job_id}") as conn:
                    found[job_id] = dict(conn.execute(
                        "select state, count(*) from rows where job_id = ? group by state", (job_id,)))
            except DatabaseDamaged as damaged:
                found[job_id] = damaged
        return found

    def job_record(self, job_id: str) -> dict:
        """The job as recorded: id, fingerprint, spec path, model, settings, creation time, and the provenance its
        output was last written with (provenance_json: model checkpoint and fingerprint, spec sha256)."""
        with self._read(f"read job {job_id}") as conn:
            job = self._require_job(conn, job_id)
        job["settings"] = json.loads(job.pop("settings_json") or "{}")
        job["provenance"] = json.loads(job.pop("provenance_json", None) or "{}")
        return job

    def record_provenance(self, job_id: str, values: Mapping[str, object]) -> None:
        """Merge `values` (JSON values) into what the job's outputs say of where they came from."""
        with self._write("record where the job's answers come from") as conn:
            known = json.loads(self._require_job(conn, job_id).get("provenance_json") or "{}")
            conn.execute("update jobs set provenance_json = ? where id = ?",
                         (json.dumps({**known, **values}, sort_keys=True), job_id))

    def find_job(self, ref: str | None) -> str:
        """A job id from a full id, a unique prefix of the id or fingerprint, or None for the job run last (or
        created last, if none has run since): the one a user just resumed, not an older one created later."""
        with self._read():
            recent = list(self.db.query(
                "select id, fingerprint, spec_path, created_at, coalesce((select max(started_at) from runs "
                "where runs.job_id = jobs.id), created_at) as active_at from jobs "
                "order by max(active_at, created_at) desc, rowid desc"
            ))
        if ref is None:
            if not recent:
                raise JobNotFound(f"no jobs recorded in {self.path} yet")
            return recent[0]["id"]
        wanted = ref.strip().lower()
        matches = [job for job in recent if job["fingerprint"].lower().startswith(wanted)
                   or job["id"].lower().startswith(wanted)]
        if len(matches) == 1:
            return matches[0]["id"]
        if not matches:
            known = ", ".join(_describe_job(job) for job in recent[:10]) or "none"
            raise JobNotFound(f'no job matches "{ref}" in {self.path}; recent jobs: {known}')
        listed = ", ".join(_describe_job(job) for job in matches[:10])
        raise JobNotFound(f'job reference "{ref}" is ambiguous; it matches {len(matches)} jobs: {listed}')

    # ---- internals -----------------------------------------------------------------------------

    @contextmanager
    def _translate_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.DatabaseError, OSError) as exc:
            error_class = DatabaseDamaged if is_damage(exc) else StoreError
            raise error_class(describe_failure(self.path, action, exc)) from exc

    @contextmanager
    def _write(self, action: str, *, fault_point: str | None = "commit") -> Iterator[sqlite3.Connection]:
        """One write transaction. IMMEDIATE takes the write lock up front, so two processes checking and
        taking a job lock at once are serialised instead of both reading "free". `fault_point` is reached just
        before COMMIT (None for a write that commits no progress)."""
        conn = self.db.conn
        with self._translate_errors(action):
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                if fault_point is not None:
                    faults.reached(fault_point)
                conn.execute("COMMIT")
            except BaseException:
                _rollback_quietly(conn)
                raise

    @contextmanager
    def _read(self, action: str = "read the progress database") -> Iterator[sqlite3.Connection]:
        """A read transaction: several queries see one snapshot even while a job commits (WAL)."""
        conn = self.db.conn
        with self._translate_errors(action):
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                _rollback_quietly(conn)

    def _require_job(self, conn: sqlite3.Connection, job_id: str) -> dict:
        cursor = conn.execute("select * from jobs where id = ?", (job_id,))
        row = cursor.fetchone()
        if row is None:
            raise JobNotFound(f"no job {job_id} in {self.path}")
        return dict(zip([column[0] for column in cursor.description], row))

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

    def _missing_rows(self, job_id: str, results: Sequence[RowResult]) -> list[int]:
        known = {idx for (idx,) in self.db.conn.execute("select idx from rows where job_id = ?", (job_id,))}
        return sorted({r.idx for r in results} - known)


def _restore_lost_rows(conn: sqlite3.Connection, job_id: str, rows: Sequence[tuple]) -> None:
    """Record again, as pending, rows a known job no longer has (lost from a damaged database, the rest salvaged):
    without them a resumed job would end without ever answering them."""
    (recorded,) = conn.execute("select count(*) from rows where job_id = ?", (job_id,)).fetchone()
    if recorded >= len(rows):
        return
    conn.executemany("insert or ignore" + _PENDING_ROW_SQL, _pending_row_values(job_id, rows))


_PENDING_ROW_SQL = (" into rows (job_id, idx, id_json, row_key, label, carried_json, state) "
                    "values (?, ?, ?, ?, ?, ?, 'pending')")


def _pending_row_values(job_id: str, rows: Sequence[tuple]) -> Iterator[tuple]:
    for row in map(lambda fields: JobRow(*fields), rows):
        yield (job_id, row.idx, json.dumps(row.id), row.key, row.label,
               None if row.carried is None else json.dumps(row.carried, sort_keys=True))


def _in_pass(progress: dict | None, live: dict | None, now: datetime) -> dict | None:
    """The live run's pass in flight as the job last told it; None without a live run, or once that pass committed
    (the run's committed passes caught up with it)."""
    if progress is None or live is None or progress["run_no"] != live["run_no"] or progress["pass_no"] <= live["passes"]:
        return None
    age = max((now - datetime.fromisoformat(progress["updated_at"])).total_seconds(), 0.0)
    eta = progress["eta_seconds"]
    return {"pass": progress["pass_no"], "passes_planned": progress["passes_planned"],
            "turns_done": progress["turns_done"], "turns_total": progress["turns_total"],
            "rows_in_flight": progress["rows_in_flight"],
            "seconds_in_pass": max((now - datetime.fromisoformat(progress["started_at"])).total_seconds(), 0.0),
            "eta_seconds": None if eta is None else max(eta - age, 0.0), "told_seconds_ago": age}


def _describe_job(job: dict) -> str:
    return f"{job['id']} ({job['spec_path']}, created {job['created_at']})"


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    # After an I/O error SQLite may already have rolled back; a failing ROLLBACK must not hide the cause.
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _check_choice(what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}; got {value!r}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
