"""Ctrl-C, a real SIGINT, to a running `batchrun submit`: it exits 130 saying the committed passes are kept, status
shows the job interrupted, and the same command resumes to the answers of an uninterrupted run without computing a
committed row again.

A real process (see tests/procs.py): only then does the signal go through the kernel and Python's own handler."""
from __future__ import annotations

import json
import os
import signal
import sqlite3

import pytest

from batchrun.output import read_parquet_results
from tests.procs import (
    Reference, assert_same_answers, batchrun_env, ctrl_c_raises, done_answers, finish, mixed_job, reference_run, run,
    start, submit_args, wait_until_frozen,
)

JOB_OPTIONS = ("--streaming", "always", "--batch-size", "4")  # 12 rows, many passes of a few rows each
ROWS = 12


@pytest.fixture
def reference(tmp_path, tiny_checkpoint) -> Reference:
    return reference_run(tmp_path, tiny_checkpoint("llama"), mixed_job(tmp_path / "job.jsonl", rows=ROWS),
                         dict(streaming="always", batch_size=4))


def refuse_rewriting_done_rows(db) -> None:
    """A trigger that fails any write to a row already done: a resumed run that computed one again fails loudly."""
    with sqlite3.connect(db) as conn:
        conn.execute("create trigger committed_rows_stay before update on rows when old.state = 'done' "
                     "begin select raise(abort, 'a committed row was written again'); end")
    conn.close()


def test_ctrl_c_keeps_the_committed_passes_and_the_same_command_resumes_the_job(tmp_path, reference, isolated_state):
    assert reference.work["pass"] >= 4  # several passes, so the first one committed leaves work to do
    db, output = tmp_path / "progress.db", tmp_path / "answers.parquet"
    args = submit_args(reference.spec, reference.model, db, output, *JOB_OPTIONS)

    # Frozen (SIGSTOP) right after its first pass was committed; the SIGINT is delivered as it continues.
    running = start(args, batchrun_env(isolated_state, BATCHRUN_STOP_AT="committed:1"), preexec_fn=ctrl_c_raises)
    try:
        wait_until_frozen(running)
        committed = done_answers(db)
        os.kill(running.pid, signal.SIGINT)
        os.kill(running.pid, signal.SIGCONT)
    finally:
        interrupted = finish(running, args)
    assert 0 < len(committed) < ROWS, interrupted.describe()

    assert interrupted.returncode == 130, interrupted.describe()
    assert "Interrupted; committed passes are kept: run the same command again to resume." in interrupted.stderr
    assert "Traceback" not in interrupted.stderr, interrupted.describe()
    assert not output.exists()
    assert done_answers(db) == committed  # nothing lost, nothing half-committed after the signal

    status = run(["status", "--db", str(db), "--json"], batchrun_env(isolated_state))
    assert status.returncode == 0, status.describe()
    info = json.loads(status.stdout)
    assert (info["state"], info["rows_done"], info["rows_pending"], info["running_pid"]) == (
        "interrupted", len(committed), ROWS - len(committed), None)

    refuse_rewriting_done_rows(db)
    resumed = run(args, batchrun_env(isolated_state))
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.summary["rows_done"] == ROWS
    assert resumed.summary["rows_computed_now"] == ROWS - len(committed)  # none of the committed rows again
    after = done_answers(db)
    assert {idx: after[idx] for idx in committed} == committed
    assert_same_answers(read_parquet_results(output), reference.answers)
