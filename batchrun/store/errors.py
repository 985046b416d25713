"""What the store raises: a job another process runs, a job not found, a database that could not be read or written,
or one that is damaged."""
from __future__ import annotations

from batchrun.errors import BatchrunError


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
