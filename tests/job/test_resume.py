"""Crash and resume, end to end: `batchrun submit` in a child process is SIGKILLed (by a named fault point,
or from outside while it runs), then run again. The resumed job must give exactly the answers of an
uninterrupted run, and must not redo work that was committed before the kill.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.output import read_parquet_results
from tests.support import write_jsonl

CHILD_TIMEOUT_S = 120
# Prompts on which the tiny random llama never emits its end-of-turn token within 40 tokens (checked by
# test_within_batch_resume_keeps_generated_tokens before it relies on it), so every pass of a batch runs.
LONG_PROMPT = "Write a long story about item {i}"


def generation_spec(path: Path, rows: int, max_new_tokens: int) -> Path:
    return write_jsonl(path, [{"id": i, "prompt": LONG_PROMPT.format(i=i), "max_new_tokens": max_new_tokens}
                              for i in range(rows)])


def choice_spec(path: Path, rows: int) -> Path:
    return write_jsonl(path, [{"id": f"r{i}", "prompt": f"Review {i}: it broke after a week. Positive or negative?",
                               "choices": ["positive", "negative"]} for i in range(rows)])


def submit_args(spec: Path, model: Path, db: Path, output: Path, *options: str) -> list[str]:
    return ["submit", str(spec), "--model", str(model), "--db", str(db), "--output", str(output), "--json",
            *options]


def run_killed(args: list[str], kill_at: str, log: Path) -> None:
    """`batchrun submit` in a child process that SIGKILLs itself at the fault point `kill_at`."""
    env = {**os.environ, "BATCHRUN_KILL_AT": kill_at}  # BATCHRUN_HOME: the test's isolated state dir
    with open(log, "w") as out:
        child = subprocess.run([sys.executable, "-m", "batchrun", *args], env=env, stdout=out,
                               stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGKILL, f"expected a kill at {kill_at}:\n{log.read_text()[-3000:]}"


def run_to_end(args: list[str]) -> dict:
    """`batchrun submit ... --json` run (again) to the end, in this process; its JSON summary."""
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def job_status(db: Path) -> dict:
    result = CliRunner().invoke(cli, ["status", "--db", str(db), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_passes(db: Path) -> list[tuple[int, int, str]]:
    """(run number, passes it committed, how it ended) for every run of the job in db."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        return conn.execute("select run_no, passes, end_state from runs order by run_no").fetchall()


def assert_same_answers(resumed: Path, uninterrupted: Path) -> None:
    got, want = read_parquet_results(resumed), read_parquet_results(uninterrupted)
    assert [r["id"] for r in got] == [r["id"] for r in want]
    assert len({r["id"] for r in got}) == len(got)  # every row once
    for row, expected in zip(got, want):
        for column in ("answer", "finish_reason", "output_tokens", "prompt_tokens", "error"):
            assert row[column] == expected[column], (row["id"], column)
        assert row["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
        if expected["choice_probs"] is not None:
            assert row["choice_probs"] == pytest.approx(expected["choice_probs"], abs=1e-5)


def num_layers(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]


# ---- a crash between batches (the jobs issue) ------------------------------------------------------------


def test_killed_after_committed_batches_resumes_without_recomputing_them(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = choice_spec(tmp_path / "reviews.jsonl", rows=10)
    reference = run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet",
                                       "--batch-size", "2"))
    args = submit_args(spec, model, tmp_path / "job.db", tmp_path / "job.parquet", "--batch-size", "2")

    run_killed(args, "committed:2", tmp_path / "killed.log")  # two batches committed, the rest not started
    before = job_status(tmp_path / "job.db")
    assert before["state"] == "interrupted" and before["passes"] == 2
    assert 0 < before["rows_done"] < before["rows_total"] == 10
    assert not (tmp_path / "job.parquet").exists()

    resumed = run_to_end(args)
    assert resumed["job_id"] == before["id"]
    assert resumed["rows_computed_now"] == 10 - before["rows_done"]
    # The committed batches are not scored again: the two runs together spend the uninterrupted run's passes.
    assert before["passes"] + resumed["passes_now"] == reference["passes_now"]
    assert any("ended without finishing (killed" in note for note in resumed["notes"])
    assert_same_answers(tmp_path / "job.parquet", tmp_path / "ref.parquet")


def test_killed_from_outside_while_running_resumes_to_the_same_answers(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = generation_spec(tmp_path / "stories.jsonl", rows=10, max_new_tokens=24)
    options = ("--batch-size", "2", "--streaming", "always")
    db = tmp_path / "job.db"
    args = submit_args(spec, model, db, tmp_path / "job.parquet", *options)

    with open(tmp_path / "killed.log", "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "batchrun", *args], stdout=log, stderr=subprocess.STDOUT)
        try:
            rows_done_seen = _kill_once_rows_are_done(child, db)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    before = job_status(db)
    assert before["state"] == "interrupted" and before["running_pid"] is None
    assert rows_done_seen <= before["rows_done"] < before["rows_total"], "the kill came after the last row"

    resumed = run_to_end(args)
    assert resumed["rows_computed_now"] == before["rows_total"] - before["rows_done"]
    run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet", *options))
    assert_same_answers(tmp_path / "job.parquet", tmp_path / "ref.parquet")


def _kill_once_rows_are_done(child: subprocess.Popen, db: Path) -> int:
    """Poll `batchrun status --json` as a user would; SIGKILL the job once it reports a finished row."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        assert child.poll() is None, "the job ended before the test could interrupt it"
        if db.exists():
            result = CliRunner().invoke(cli, ["status", "--db", str(db), "--json"])
            # Before the job is recorded, status has nothing to show (exit 1): keep polling.
            if result.exit_code == 0 and json.loads(result.stdout)["rows_done"] >= 1:
                os.kill(child.pid, signal.SIGKILL)
                return json.loads(result.stdout)["rows_done"]
        time.sleep(0.02)
    pytest.fail("no row finished in time")


# ---- a crash inside a batch (tokens generated so far are kept) ------------------------------------------


def test_within_batch_resume_keeps_generated_tokens(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = generation_spec(tmp_path / "stories.jsonl", rows=4, max_new_tokens=40)
    options = ("--batch-size", "4", "--streaming", "always")
    reference = run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet", *options))
    expected = read_parquet_results(tmp_path / "ref.parquet")
    # Precondition: no row stops early, so every one of the 40 passes runs all 4 rows.
    assert [(r["output_tokens"], r["finish_reason"]) for r in expected] == [(40, "length")] * 4
    uninterrupted_passes = reference["passes_now"]
    assert uninterrupted_passes == 40  # one batch, one pass per new token

    db = tmp_path / "job.db"
    args = submit_args(spec, model, db, tmp_path / "job.parquet", *options)
    layers = num_layers(model)
    # Each kill point counts from its own process's start. The last lands inside a pass: after the first
    # layer of that run's 4th pass, so 3 passes are committed and the 4th is lost.
    kills = [("committed:7", 7), ("committed:9", 9), ("committed:12", 12), (f"layer:{3 * layers + 1}", 3)]
    committed_before = 0
    for kill_at, passes_committed in kills:
        run_killed(args, kill_at, tmp_path / f"killed-{kill_at.replace(':', '-')}.log")
        status = job_status(db)
        assert status["rows_done"] == 0 and status["partial_rows"] == 4
        # Every committed pass, the resume's prefill included, produced one kept token per row.
        assert status["passes"] == committed_before + passes_committed
        assert status["partial_tokens"] == 4 * status["passes"]
        committed_before = status["passes"]

    resumed = run_to_end(args)
    assert resumed["passes_now"] == uninterrupted_passes - committed_before
    assert_same_answers(tmp_path / "job.parquet", tmp_path / "ref.parquet")

    final = job_status(db)
    interruptions = len(kills)
    runs = run_passes(db)
    assert [end for _, _, end in runs] == ["died"] * interruptions + ["done"]
    assert sum(passes for _, passes, _ in runs) == final["passes"]
    # Each resume may cost one extra pass (its prefill of prompt + kept tokens); here the prefill also yields
    # the next token, so the committed passes of all runs together are no more than the uninterrupted ones.
    assert final["passes"] <= uninterrupted_passes + interruptions
    # Lost work: only the pass in flight at a kill inside a pass; a kill right after a commit loses none.
    lost_passes = sum(1 for kill_at, _ in kills if kill_at.startswith("layer:"))
    assert final["passes"] + lost_passes <= uninterrupted_passes + interruptions


# ---- what `batchrun status` shows for an interrupted job ---------------------------------------------------


def test_status_of_job_killed_mid_batch_shows_done_rows_and_kept_tokens(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = generation_spec(tmp_path / "stories.jsonl", rows=4, max_new_tokens=10)
    db = tmp_path / "job.db"
    args = submit_args(spec, model, db, tmp_path / "job.parquet", "--batch-size", "2")
    # First batch: 10 passes finish its 2 rows; then 3 passes of the second batch, 2 rows x 3 tokens kept.
    run_killed(args, "committed:13", tmp_path / "killed.log")

    info = job_status(db)
    assert info["state"] == "interrupted" and info["running_pid"] is None
    assert (info["rows_done"], info["rows_pending"], info["rows_total"]) == (2, 2, 4)
    assert (info["partial_rows"], info["partial_tokens"], info["passes"]) == (2, 6, 13)

    text = CliRunner().invoke(cli, ["status", "--db", str(db)])
    assert text.exit_code == 0, text.output
    assert f"job {info['id']}: interrupted" in text.stdout
    assert "rows     2 done, 0 errored, 2 pending of 4" in text.stdout
    assert "partial  6 tokens generated in 2 unfinished rows (kept on resume)" in text.stdout
    assert "passes   13" in text.stdout

    # Answers so far can be exported while the job is unfinished: only the finished rows.
    partial = CliRunner().invoke(cli, ["results", "--db", str(db), "--output", str(tmp_path / "so-far.parquet")])
    assert partial.exit_code == 0, partial.output
    assert [r["id"] for r in read_parquet_results(tmp_path / "so-far.parquet")] == [0, 1]
