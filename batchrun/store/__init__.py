"""Progress in SQLite: jobs, rows, runs and locks, numbered migrations, answers reused across jobs, and what a damaged
database still holds (check, salvage).
"""
from batchrun.store.database import Store
from batchrun.store.errors import DatabaseDamaged, JobLocked, JobNotFound, StoreError
from batchrun.store.rows import JobRow, RowResult
from batchrun.store.salvage import (DatabaseCheck, DatabaseUnreadable, check_database, describe_check,
                                    salvage_database)

__all__ = ["DatabaseCheck", "DatabaseDamaged", "DatabaseUnreadable", "JobLocked", "JobNotFound", "JobRow",
           "RowResult", "Store", "StoreError", "check_database", "describe_check", "salvage_database"]
