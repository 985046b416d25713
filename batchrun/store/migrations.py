"""Numbered schema migrations for the progress database, recorded in `_migrations`.

Each migration is a small function named mNNN_<what>; opening the database applies the ones not yet
recorded, in order. Never edit or reorder a released migration: add a new one. (Pattern from simonw/llm.)
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable

import sqlite_utils

MIGRATIONS_TABLE = "_migrations"

Migration = Callable[[sqlite_utils.Database], None]
MIGRATIONS: list[Migration] = []


def migration(function: Migration) -> Migration:
    MIGRATIONS.append(function)
    return function


@migration
def m001_jobs_and_rows(db: sqlite_utils.Database) -> None:
    db["jobs"].create(
        {
            "id": str,  # first 16 hex digits of the fingerprint: short enough to type
            "fingerprint": str,
            "spec_path": str,
            "model": str,
            "settings_json": str,
            "created_at": str,
            "state": str,  # pending | running | interrupted | done | failed
            "total_rows": int,
            "passes_done": int,
        },
        pk="id",
        not_null=["fingerprint", "created_at", "state", "total_rows", "passes_done"],
        defaults={"state": "pending", "passes_done": 0},
    )
    db["rows"].create(
        {
            "job_id": str,
            "idx": int,  # position in the input: the output order
            "id_json": str,  # the row's id as JSON, so 7 and "7" stay distinct
            "state": str,  # pending | done | error
            "answer": str,
            "choice_probs_json": str,
            "score": float,
            "logprob": float,
            "prompt_tokens": int,
            "output_tokens": int,
            "finish_reason": str,
            "error": str,
            "output_token_ids_json": str,
        },
        pk=("job_id", "idx"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["id_json", "state"],
        defaults={"state": "pending"},
    )


@migration
def m002_runs_and_locks(db: sqlite_utils.Database) -> None:
    db["runs"].create(
        {
            "job_id": str,
            "run_no": int,
            "pid": int,
            "host": str,
            "started_at": str,
            "last_active_at": str,  # where a crashed run's duration ends
            "ended_at": str,
            "end_state": str,  # running | done | interrupted | failed | died (no longer running, never closed)
            "batch_size": int,
            "planned_peak_bytes": int,
            "passes": int,
        },
        pk=("job_id", "run_no"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["pid", "host", "started_at", "end_state", "passes"],
        defaults={"passes": 0},
    )
    db["locks"].create(
        {
            "job_id": str,
            "pid": int,
            "host": str,
            "process_identity": str,  # tells the holder from a later process that reuses its pid
            "run_no": int,
            "acquired_at": str,
            "heartbeat_at": str,
        },
        pk="job_id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["pid", "host", "acquired_at", "heartbeat_at"],
    )


@migration
def m003_partial_tokens(db: sqlite_utils.Database) -> None:
    # Tokens generated so far for rows still decoding, so a crash mid-batch loses at most one pass.
    db["partial"].create(
        {
            "job_id": str,
            "idx": int,
            "token_ids_json": str,
            "token_count": int,  # kept beside the JSON so status needs no JSON1 extension
            "logprob": float,  # sum over the tokens so far, so a resumed answer reports the same logprob
            "updated_at": str,
        },
        pk=("job_id", "idx"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["token_ids_json", "token_count", "updated_at"],
    )


@migration
def m004_run_memory_cgroup(db: sqlite_utils.Database) -> None:
    # Where a run's memory was accounted and its OOM-kill count at start: the next run compares them
    # to tell an out-of-memory kill from any other crash.
    db["runs"].add_column("memory_cgroup", str)
    db["runs"].add_column("oom_kills_at_start", int)


@migration
def m005_run_planned_passes(db: sqlite_utils.Database) -> None:
    # The passes a run's plan needs for the rows it started with: status's ETA counts passes left, not rows (a
    # generation batch answers all its rows at its last pass).
    db["runs"].add_column("planned_passes", int)


@migration
def m006_died_runs(db: sqlite_utils.Database) -> None:
    # Runs closed before runs could end 'died' were all 'interrupted', the silent deaths (OOM kills) among them: they
    # keep the meaning they had, so an OOM cap found from them is not lost.
    db.execute("update runs set end_state = 'died' where end_state = 'interrupted'")


@migration
def m007_run_error(db: sqlite_utils.Database) -> None:
    # Why a run failed, for `status` the morning after (the traceback, if any, went to a terminal long closed).
    db["runs"].add_column("error", str)


@migration
def m008_row_keys(db: sqlite_utils.Database) -> None:
    # What a row's answer depends on (model, dtype, tokens, choices, limit, stops), so a job made from an edited
    # spec takes the answers its unchanged rows already have in an earlier job (store/reuse.py).
    db["rows"].add_column("row_key", str)
    db["rows"].create_index(["row_key"], index_name="rows_by_key")


@migration
def m009_pass_timings(db: sqlite_utils.Database) -> None:
    # Each committed pass's wall time and rows, so a report shows a run's pace, its slow passes and its resumes; and
    # the plan's mode and ETA beside each run, to hold what the plan promised against what the passes took.
    db["passes"].create(
        {
            "job_id": str,
            "run_no": int,
            "pass_no": int,  # 1, 2, ... within its run
            "finished_at": str,
            "seconds": float,
            "rows_finished": int,  # rows the pass answered (a generation pass may finish none)
            "bytes_read": int,  # weight bytes read from the checkpoint during the pass, where known
            "read_seconds": float,  # of `seconds`, the time spent waiting for reads, where known
            "peak_memory_bytes": int,  # the process's peak memory so far (device memory on an accelerator)
            "planned_seconds": float,  # what the plan expected of this pass
        },
        pk=("job_id", "run_no", "pass_no"),
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["finished_at", "seconds", "rows_finished"],
    )
    db["runs"].add_column("mode", str)  # resident | streamed
    db["runs"].add_column("planned_seconds", float)  # the plan's ETA for the rows the run started with


@migration
def m010_row_labels_and_carried_values(db: sqlite_utils.Database) -> None:
    # A row's expected answer (accuracy, calibration fitted on labels), the values it carries to the output (metadata,
    # kept corpus columns), and each choice's token count (a calibrated answer's output_tokens).
    db["rows"].add_column("label", str)
    db["rows"].add_column("carried_json", str)
    db["rows"].add_column("choice_tokens_json", str)


@migration
def m011_job_provenance(db: sqlite_utils.Database) -> None:
    # Where a job's answers come from beyond what the job row says (the model's checkpoint directory and fingerprint,
    # the spec's sha256), recorded as its output is written: `results` writes them into a later export's metadata.
    db["jobs"].add_column("provenance_json", str)


@migration
def m012_pass_progress(db: sqlite_utils.Database) -> None:
    # The pass in flight as the running job last told it (every few seconds at most), one row a job: `status` shows a
    # long pass moving, and its ETA, before the pass commits anything.
    db["pass_progress"].create(
        {
            "job_id": str,
            "run_no": int,
            "pass_no": int,  # 1, 2, ... within its run, as passes.pass_no will number it once committed
            "passes_planned": int,
            "turns_done": int,  # forward calls' turns at decoder layers done in the pass
            "turns_total": int,
            "rows_in_flight": int,
            "eta_seconds": float,  # time left for the job as the running process saw it, where known
            "started_at": str,  # when the pass began
            "updated_at": str,
        },
        pk="job_id",
        foreign_keys=[("job_id", "jobs", "id")],
        not_null=["run_no", "pass_no", "turns_done", "turns_total", "rows_in_flight", "started_at", "updated_at"],
    )


@migration
def m013_pair_orders(db: sqlite_utils.Database) -> None:
    # Which order of a pair row a row is, the lengths of the pair's two answers and its expected verdict: the output
    # folds a pair's two rows into one with nothing but the store to read.
    db["rows"].add_column("pair_json", str)


@migration
def m014_rationales(db: sqlite_utils.Database) -> None:
    # A row that writes its reasons before its verdict: the finished rationale waits in `partial` for the verdict's
    # pass (a run stopped between the two resumes at the verdict), then rides with the answer in `rows`.
    db["partial"].add_column("rationale_json", str)
    db["rows"].add_column("rationale_json", str)


@migration
def m015_row_structures(db: sqlite_utils.Database) -> None:
    # The JSON Schema or regex a structured row's answer must match ({"json_schema": ...} or {"regex": ...}): the
    # output validates each answer against it with nothing but the store to read.
    db["rows"].add_column("structure_json", str)
    # What the grammar did to a structured row (tokens overridden and forced, the lowest chosen log-probability),
    # with its answer and, while it decodes, beside its tokens so far: a resumed row keeps its counts.
    db["rows"].add_column("grammar_json", str)
    db["partial"].add_column("grammar_json", str)


def applied_migrations(db: sqlite_utils.Database) -> set[str]:
    return {row["name"] for row in db[MIGRATIONS_TABLE].rows_where(select="name")}  # none before the table exists


def pending_migrations(db: sqlite_utils.Database) -> list[Migration]:
    applied = applied_migrations(db)
    return [function for function in MIGRATIONS if function.__name__ not in applied]


def apply_pending(db: sqlite_utils.Database) -> list[str]:
    """Apply unrecorded migrations in one transaction; return their names.

    The caller holds a write transaction (BEGIN IMMEDIATE), so a second process opening a fresh database
    at the same moment waits, then finds nothing left to do.
    """
    db[MIGRATIONS_TABLE].create({"name": str, "applied_at": str}, pk="name", if_not_exists=True)
    applied_now = []
    for function in pending_migrations(db):
        function(db)
        db[MIGRATIONS_TABLE].insert(
            {"name": function.__name__, "applied_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        )
        applied_now.append(function.__name__)
    return applied_now
