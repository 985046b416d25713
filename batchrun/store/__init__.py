"""Progress in SQLite: jobs, rows, runs and locks, numbered migrations, answers reused across jobs, and what a damaged
database still holds (check, salvage).
"""
from batchrun.store.database import Store
from batchrun.store.errors import DatabaseDamaged, JobLocked, JobNotFound, StoreError
from batchrun.store.files import describe_failure
from batchrun.store.reuse import Reused
from batchrun.store.rows import JobRow, Rationale, RowResult
from batchrun.store.salvage import (DatabaseCheck, DatabaseUnreadable, check_database, describe_check,
                                    salvage_database)

__all__ = ["DatabaseCheck", "DatabaseDamaged", "DatabaseUnreadable", "JobLocked", "JobNotFound", "JobRow", "Rationale",
           "Reused", "RowResult", "Store", "StoreError", "check_database", "describe_check", "describe_failure",
           "salvage_database"]
