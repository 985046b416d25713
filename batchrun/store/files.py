"""The progress database's files as the user sees them: a write-ahead log left without its database, what a failed
open or write tells the user (damaged, disk full, read-only), and the space a running job keeps in reserve so a full
disk cannot stop it from saying why it failed. No SQLite connection here."""
from __future__ import annotations

import errno
import glob
import os
import sqlite3
from pathlib import Path

from batchrun.host import HOST, disk_free_bytes, pid_alive
from batchrun.plan import format_bytes

SQLITE_MAGIC = b"SQLite format 3\x00"
DAMAGE_ERRORS = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Enough for a failed run to close its run with the reason and drop its lock: a few pages in the write-ahead log.
RESERVE_BYTES = 64 * 1024


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


def is_damage(exc: BaseException) -> bool:
    """SQLite found the file's pages inconsistent (a torn or truncated file, bytes written over it)."""
    if getattr(exc, "sqlite_errorname", None) in DAMAGE_ERRORS:
        return True
    return isinstance(exc, sqlite3.DatabaseError) and "malformed" in str(exc)


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in DISK_FULL_ERRNOS
    return getattr(exc, "sqlite_errorname", None) == "SQLITE_FULL" or "database or disk is full" in str(exc)


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
    if is_damage(exc):
        return damaged_message(path, action, reason)
    if is_disk_full(exc):
        return disk_full_message(path, f"could not {action} in {path}: {reason}")
    message = f"could not {action} in {path}: {reason}. Answers committed before this point are safe."
    if isinstance(exc, OSError) or "disk" in reason.lower():  # "disk I/O error"
        message += (" Check the disk (free space, file-size limits, errors in the system log), then run the job "
                    "again to resume.")
    return message


def damaged_message(path: Path, action: str, reason: str) -> str:
    """What is true of a damaged database, and the commands that recover what it still holds."""
    if not _starts_like_sqlite(path):
        return (f"could not {action} in {path}: {reason}; the file is not a SQLite database (its first bytes are "
                "not SQLite's): pass the progress database as --db, or a new file name to start one")
    salvaged = path.with_name(f"{path.stem}.salvaged{path.suffix or '.db'}")
    return (f"{path} is damaged: SQLite said \"{reason}\" when asked to {action}. Answers stored on its "
            "damaged pages cannot be read; the rest may be. See what is readable with "
            f"`batchrun db check --db {path}`, and copy every readable job into a new database with "
            f"`batchrun db salvage --db {path} -o {salvaged}` (the damaged file is left as it is); then move {path} "
            f"(and any {path.name}-wal, {path.name}-shm) aside and {salvaged.name} into its place, or pass "
            f"--db {salvaged}")


def disk_full_message(path: Path, failure: str, needed_bytes: int | None = None) -> str:
    """`failure` said again with where the space ran out, what is free there now and, where known, what was needed."""
    directory = Path(path).absolute().parent
    try:
        free = f"{format_bytes(disk_free_bytes(directory))} free there now"
    except OSError:
        free = "free space unknown"
    needed = f"; about {format_bytes(needed_bytes)} needed" if needed_bytes else ""
    return (f"{failure}. The disk holding {directory} is full ({free}{needed}). Answers committed before this point "
            "are safe: free space there (or raise the file-size limit), then run the same command again")


def writable(path: Path) -> bool:
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def _starts_like_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return True  # unreadable: not known to be another kind of file


class SpaceReserve:
    """A hidden file of RESERVE_BYTES beside the database while this process runs a job. When the disk fills, the
    run's last write (closing its run with the reason, dropping its lock) needs a few pages; deleting the reserve
    gives them back, so the failure is recorded instead of looking like a crash."""

    def __init__(self, db_path: Path, job_id: str):
        self.prefix = f".{db_path.name}.reserve-{HOST}-"
        self.path = db_path.with_name(f"{self.prefix}{os.getpid()}-{job_id}")

    def hold(self) -> None:
        """Make the reserve; on a disk already too full for it, run without one (the failure says what it can)."""
        self._remove_abandoned()
        try:
            with open(self.path, "wb") as handle:
                handle.write(bytes(RESERVE_BYTES))  # written, not sparse: the blocks are really taken
                handle.flush()
                os.fsync(handle.fileno())
        except OSError:
            self.free()

    def free(self) -> bool:
        """Delete the reserve; True if there was one to give back."""
        try:
            self.path.unlink()
        except OSError:
            return False
        return True

    def _remove_abandoned(self) -> None:
        """Reserves of processes on this host that died without deleting theirs (killed, out of memory)."""
        for reserve in self.path.parent.glob(glob.escape(self.prefix) + "*"):
            pid = reserve.name[len(self.prefix):].partition("-")[0]
            if pid.isdecimal() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                try:
                    reserve.unlink()
                except OSError:
                    pass  # removed by another process first, or not ours to remove
