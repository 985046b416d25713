"""The progress database's connection: opened in WAL mode with synchronous=FULL and its numbered migrations applied,
and the read and write transactions every store method runs in, SQLite's failures said as the user can act on them."""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import sqlite_utils
from sqlite_utils.db import NotFoundError

from batchrun.host import faults
from batchrun.store import migrations as store_migrations
from batchrun.store.errors import DatabaseDamaged, JobNotFound, StoreError
from batchrun.store.files import describe_failure, is_damage, orphaned_log_message
from batchrun.store.locks import enable_wal

BUSY_TIMEOUT_S = 30.0  # how long a reader (`status`) or a second writer waits for a running job's commit


class Connection:
    """One progress database, open through sqlite-utils, and the transactions the store's methods run in."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
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
        self.db.close()

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

    def _row(self, table: str, key: str | tuple) -> dict | None:
        """The row of `table` whose primary key is `key`, None if it has none."""
        try:
            return self.db[table].get(key)
        except NotFoundError:
            return None

    def _require_job(self, job_id: str) -> dict:
        if (job := self._row("jobs", job_id)) is None:
            raise JobNotFound(f"no job {job_id} in {self.path}")
        return job


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    # After an I/O error SQLite may already have rolled back; a failing ROLLBACK must not hide the cause.
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
