"""A way out of every failure: --json failures a script can parse, a failed run's reason kept through a full disk,
disk-full errors that name the place and the size, the plan's state-directory disk, a headed `jobs` listing and a
note on reused answers that stays short."""
from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from batchrun.store import Reused, Store, StoreError, describe_failure
from tests.support import REPO_ROOT, answer, invoke, make_job, write_jsonl


@pytest.fixture
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture
def spec(tmp_path) -> Path:
    return write_jsonl(tmp_path / "reviews.jsonl", [{"id": f"r{i}", "prompt": f"Review {i}: fine. Positive?",
                                                     "choices": ["yes", "no"]} for i in range(4)])


def only_json_object(stdout: str) -> dict:
    (line,) = stdout.splitlines()
    return json.loads(line)


@pytest.mark.parametrize("command, kind, exit_code, says", [
    (["status", "--db", "{tmp}/none.db", "--json"], "JobNotFound", 1, "no jobs recorded"),
    (["results", "--db", "{tmp}/none.db", "-o", "{tmp}/a.csv", "--json"], "JobNotFound", 1, "no jobs recorded"),
    (["jobs", "--db", "{tmp}/none.db", "--json"], "JobNotFound", 1, "no database at"),
    (["plan", "{tmp}/bad.jsonl", "--json"], "SpecError", 1, "bad.jsonl:line 1: malformed JSON"),
    (["submit", "{tmp}/bad.jsonl", "--json", "--model", "{tmp}"], "SpecError", 1, "bad.jsonl:line 1: malformed JSON"),
    (["db", "check", "--db", "{tmp}/bad.jsonl", "--json"], "DatabaseUnreadable", 1, "not a SQLite database"),
    (["db", "salvage", "--db", "{tmp}/j.db", "-o", "{tmp}/bad.jsonl", "--json"], "OutputRefused", 1, "already exists"),
    (["jobs", "--json", "--limit", "3"], "usage", 2, "No such option '--limit'"),
    (["db", "check", "--json", "--quick=7"], "usage", 2, "--quick"),
])
def test_json_failure_prints_an_object_on_stdout(tmp_path, command, kind, exit_code, says):
    write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": '])
    Store(tmp_path / "j.db").close()
    result = invoke(*[part.format(tmp=tmp_path) for part in command])
    assert result.exit_code == exit_code, result.output
    found = only_json_object(result.stdout)
    assert set(found) == {"error", "kind", "exit_code"}
    assert (found["kind"], found["exit_code"]) == (kind, exit_code) and says in found["error"]
    assert len([line for line in result.stderr.splitlines() if line.startswith("Error:")]) == 1


def test_without_json_a_failure_leaves_stdout_empty(tmp_path):
    result = invoke("status", "--db", tmp_path / "none.db")
    assert result.exit_code == 1 and result.stdout == "" and result.stderr.startswith("Error: no jobs recorded")


def disk_full(path: Path, action: str) -> StoreError:
    """The StoreError a full disk gives: SQLite's "database or disk is full" as the store translates it."""
    cause = sqlite3.OperationalError("database or disk is full")
    cause.sqlite_errorname = "SQLITE_FULL"
    error = StoreError(describe_failure(path, action, cause))
    error.__cause__ = cause
    return error


def test_failed_run_reason_shown_by_status(tmp_path, spec, model, monkeypatch):
    """The disk fills during a commit and stays full: the reserve the run kept beside the database makes room to
    record why it failed, so status and jobs --json show the reason, and the next run does not call it a crash."""
    db = tmp_path / "j.db"
    reserves = lambda: list(tmp_path.glob(".j.db.reserve-*"))  # noqa: E731
    real_close_run = Store._close_run
    held = []

    def full_commit(self, job_id, results, passes):
        held.append(bool(reserves()))
        raise disk_full(self.path, f"save {len(results)} answers")

    def full_until_the_reserve_is_freed(self, *args):
        if reserves():
            raise disk_full(self.path, "release the job")
        return real_close_run(self, *args)

    monkeypatch.setattr(Store, "commit_batch", full_commit)
    monkeypatch.setattr(Store, "_close_run", full_until_the_reserve_is_freed)
    failed = invoke("submit", spec, "--model", model, "--db", db, "-q")
    assert failed.exit_code == 1 and held == [True]
    assert f"The disk holding {tmp_path} is full (" in failed.stderr and "free there now" in failed.stderr
    assert not reserves()

    status = invoke("status", "--db", db)
    assert re.search(r"^job [0-9a-f]{16}: failed$", status.stdout, re.M), status.stdout
    assert re.search(r"^  failed   StoreError: could not save 4 answers in .*database or disk is full", status.stdout,
                     re.M)
    (listed,) = json.loads(invoke("jobs", "--db", db, "--json").stdout)
    assert listed["state"] == "failed" and "database or disk is full" in listed["last_error"]

    monkeypatch.undo()
    resumed = invoke("submit", spec, "--model", model, "--db", db, "-q", "--force")
    assert resumed.exit_code == 0, resumed.output
    assert "killed, or the machine went down" not in resumed.stderr
    assert not reserves()


FILL_DISK = """
    import os, resource, signal, sys
    from pathlib import Path
    from batchrun.output import OutputError, write_results
    from batchrun.store import RowResult
    path = Path(sys.argv[1])
    rows = [RowResult(i, i, os.urandom(4096).hex(), None, None, None, 1, 1, "stop", None) for i in range(300)]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    try:
        write_results(path, rows, sys.argv[2], model="m")
    except OutputError as error:
        print(error)
        sys.exit(0)
    sys.exit("the oversized write did not fail")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_a_full_disk_for_the_output_names_the_directory_and_the_bytes_needed(tmp_path, fmt):
    path = tmp_path / f"answers.{fmt}"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    filler = subprocess.run([sys.executable, "-c", textwrap.dedent(FILL_DISK), str(path), fmt], env=env,
                            capture_output=True, text=True, timeout=60)
    assert filler.returncode == 0, filler.stderr
    assert f"the disk holding {tmp_path} has " in filler.stdout
    needed = re.search(r"the file needs ([\d.]+) MiB", filler.stdout)
    assert needed and float(needed.group(1)) >= 1.0, filler.stdout  # 300 rows of 8 KB text, however encoded
    assert not path.exists() and not list(tmp_path.iterdir())


def test_a_full_disk_under_the_database_names_its_directory(tmp_path):
    message = str(disk_full(tmp_path / "j.db", "save 4 answers"))
    assert message.startswith(f"could not save 4 answers in {tmp_path / 'j.db'}: database or disk is full")
    assert f"The disk holding {tmp_path} is full (" in message and "Answers committed before this point" in message


def test_plan_shows_the_disk_of_the_state_directory(spec, model):
    result = invoke("plan", spec, "--model", model)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("disk ")]
    assert "free at the checkpoint" in line
    assert f"free in the state directory {os.environ['BATCHRUN_HOME']} (progress database)" in line


def test_jobs_prints_a_header(tmp_path):
    db = tmp_path / "j.db"
    with Store(db) as store:
        first = make_job(store, n=3)
        store.commit_batch(first, [answer(0)], passes=1)
        second = make_job(store, n=2, fingerprint="fedcba9876543210" + "1" * 48)
    header, *lines = invoke("jobs", "--db", db).stdout.splitlines()
    assert header.split() == ["JOB", "STATE", "DONE/ROWS", "CREATED", "MODEL", "SPEC"]
    assert [line.split()[:3] for line in lines] == [[second, "pending", "0/2"], [first, "pending", "1/3"]]
    for line in lines:  # each column under its heading
        assert line.index("pending") == header.index("STATE")
        assert line.index("tiny") == header.index("MODEL")
    listed = json.loads(invoke("jobs", "--db", db, "--json").stdout)
    assert [job["id"] for job in listed] == [second, first] and listed[1]["rows_done"] == 1


def test_reuse_note_names_at_most_three_jobs():
    from batchrun.job import reused_note

    earlier = [f"job{i:012d}" for i in range(7)]
    note = reused_note(Reused(answers=12, partial_rows=2, from_jobs=earlier))
    assert note.startswith(f"12 answer(s) taken from earlier job(s) {earlier[0]}, {earlier[1]}, {earlier[2]} "
                           "and 4 more: the same rows")
    assert all(job not in note for job in earlier[3:]) and "2 row(s) resume" in note
    assert "more" not in reused_note(Reused(answers=1, from_jobs=earlier[:3]))
