"""The progress database's files as the user sees them: a write-ahead log left without its database, and what a
failed open or write tells the user. No SQLite connection here."""
from __future__ import annotations

import os
from pathlib import Path


def orphaned_log_message(path: Path) -> str | None:
    """Why not to open `path`, if a write-ahead log lies beside it while the database is gone (a killed run's log,
    the database deleted to start over): SQLite would replay it into the new database there, bringing the deleted
    jobs back, or fail with SQLITE_IOERR_SHORT_READ where it was partly checkpointed. The log is the user's: say so,
    delete nothing."""
    log = path.with_name(path.name + "-wal")
    if path.exists() or not log.exists() or log.stat().st_size == 0:
        return None
    return (f"{log} is the write-ahead log of a progress database that is no longer at {path} (deleted "
            "after a run was stopped?); SQLite would replay it into a new database there. Put the database back "
            f"to resume its jobs, or move {log.name} (and {path.name}-shm) away to start afresh.")


def describe_failure(path: Path, action: str, exc: BaseException) -> str:
    reason = str(exc)
    error_name = getattr(exc, "sqlite_errorname", None)
    if error_name:
        reason += f" [{error_name}]"
    if error_name in ("SQLITE_CANTOPEN", "SQLITE_READONLY") and not writable(path):
        # WAL mode writes its -wal and -shm files beside the database, even to read it.
        return (f"could not {action} in {path}: {reason}; the database or its directory is read-only, and "
                "batchrun writes beside the database even to read it: copy it to a writable place and pass "
                "that copy as --db")
    message = f"could not {action} in {path}: {reason}. Answers committed before this point are safe."
    if isinstance(exc, OSError) or "disk" in reason.lower():  # "database or disk is full", "disk I/O error"
        message += " Check free disk space and file-size limits, then run the job again to resume."
    return message


def writable(path: Path) -> bool:
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
