"""Progress in SQLite: jobs, rows, runs and locks, numbered migrations, answers reused across jobs.
"""
from batchrun.store.database import JobLocked, JobNotFound, Store, StoreError
from batchrun.store.rows import JobRow, RowResult

__all__ = ["JobLocked", "JobNotFound", "JobRow", "RowResult", "Store", "StoreError"]
