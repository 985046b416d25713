"""Progress a user can see and keep: `status` follows a pass while it runs, a kill loses at most one pass of the
bound, and an existing output file is refused before any work."""
from __future__ import annotations

import json
import signal

import pytest

from batchrun.errors import OutputRefused
from batchrun.job import execute, progress
from batchrun.output import read_parquet_results
from batchrun.store import Store
from tests.procs import assert_same_answers, batchrun_env, reference_run, run, submit_args
from tests.support import choice_spec, generation_spec, invoke, run_job, write_jsonl


@pytest.mark.parametrize("streaming, spec_of", [("never", choice_spec), ("always", generation_spec)],
                         ids=["choices-resident", "generation-streamed"])
def test_progress_moves_within_the_first_pass(tmp_path, tiny_checkpoint, monkeypatch, streaming, spec_of):
    """What `status` reads from another connection while the first pass runs: the pass, its layer turns moving,
    the rows it carries and an ETA (the plan's, no pass being done), all before the pass commits a row."""
    monkeypatch.setattr(progress, "STORE_EVERY_S", 0.0)  # every layer turn marked: the tiny model's pass is short
    seen = []
    record = Store.record_progress

    def record_and_read(self, job_id, marks):
        record(self, job_id, marks)
        with Store(self.path) as reader:
            seen.append(reader.status(job_id))

    monkeypatch.setattr(Store, "record_progress", record_and_read)
    summary, _ = run_job(spec_of(tmp_path), tmp_path, tiny_checkpoint("llama"), "progress", streaming=streaming,
                         micro_batch=2)
    first = [status for status in seen if status["in_pass"] and status["in_pass"]["pass"] == 1]
    turns = [status["in_pass"]["turns_done"] for status in first]
    assert len(first) >= 3 and turns == sorted(set(turns))  # it moves, turn by turn
    for status in first:
        assert status["rows_done"] == 0 and status["state"] == "running"  # nothing committed yet
        assert status["in_pass"]["rows_in_flight"] == 6 and status["in_pass"]["passes_planned"] >= 1
        assert status["in_pass"]["eta_seconds"] is not None and status["eta_seconds"] is not None
    with Store(tmp_path / "progress.db") as store:
        after = store.status(summary.job_id)
    assert after["in_pass"] is None and after["rows_done"] == 6


def plan_of(spec, model, *options) -> dict:
    result = invoke("plan", spec, "--model", model, "--json", "--memory", "4", *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["candidates"][0]


def test_kill_loses_at_most_one_bounded_pass(tmp_path, tiny_checkpoint, isolated_state):
    """Unbounded, the job is one pass and a kill -9 in it loses every row; held to a quarter of that pass, a kill
    in the third pass keeps the two committed passes' answers and loses only the third's rows."""
    model = tiny_checkpoint("llama")
    rows = 48
    spec = write_jsonl(tmp_path / "reviews.jsonl", [
        {"id": f"r{i}", "prompt": f"Review {i}: " + "the kettle is fine " * (i % 7), "choices": ["good", "bad"]}
        for i in range(rows)])
    unbounded = plan_of(spec, model, "--pass-minutes", "100000")
    assert unbounded["passes"] == 1
    minutes = unbounded["longest_pass_seconds"] / 4 / 60
    bounded = plan_of(spec, model, "--pass-minutes", repr(minutes))
    assert bounded["passes"] >= 4
    db, out = tmp_path / "progress.db", tmp_path / "answers.parquet"
    args = submit_args(spec, model, db, out, "--memory", "4", "--pass-minutes", repr(minutes), "--quiet")

    killed = run(args, batchrun_env(isolated_state, BATCHRUN_KILL_AT="pass:3"))  # computed, not yet committed
    assert killed.returncode == -signal.SIGKILL, killed.describe()
    with Store(db) as store:
        (job,) = store.jobs()
        committed = store.passes(job["id"])
        status = store.status(job["id"])
    assert len(committed) == 2 and status["rows_done"] == sum(p["rows_finished"] for p in committed) > 0
    lost = rows - status["rows_done"] - status["rows_pending"]
    assert lost == 0 and 0 < rows - status["rows_done"]  # nothing half-written; the pass in flight is pending again
    assert status["rows_done"] >= rows - (bounded["passes"] - 2) * bounded["batch_size"]

    resumed = run(args, batchrun_env(isolated_state))
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.summary["rows_computed_now"] == rows - status["rows_done"]  # the committed passes are not redone
    reference = reference_run(tmp_path / "reference", model, spec, dict(memory_gb=4, pass_minutes=minutes))
    assert_same_answers(read_parquet_results(out), reference.answers)


def test_existing_output_refused_before_reading_the_spec(tmp_path, tiny_checkpoint, monkeypatch):
    spec = choice_spec(tmp_path)
    out, db = tmp_path / "answers.parquet", tmp_path / "progress.db"
    out.write_bytes(b"mine")

    def reads_the_spec(*args, **kwargs):
        raise AssertionError("the spec was read before the existing output was refused")

    with monkeypatch.context() as patch:
        patch.setattr(execute, "prepare_job", reads_the_spec)
        with pytest.raises(OutputRefused, match="exists; pass --force to overwrite it"):
            execute.submit(spec, output=out, db=db)
    assert out.read_bytes() == b"mine"

    summary, _ = run_job(spec, tmp_path, tiny_checkpoint("llama"), "progress")  # writes progress.parquet, done
    monkeypatch.setattr(execute, "prepare_job", reads_the_spec)
    complete = f"job {summary.job_id} .* is complete.*batchrun results {summary.job_id}"
    with pytest.raises(OutputRefused, match=complete):
        execute.submit(spec, output=tmp_path / "progress.parquet", db=db)
