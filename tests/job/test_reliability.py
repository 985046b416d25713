"""`batchrun submit` on a full disk, twice at once on one job, and with a hub token it must never write down.

Real processes (see tests/procs.py): file-size limits, disk space and job locks act on the process.
"""
from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from batchrun.output import read_parquet_results
from tests.procs import (
    Reference, assert_clean_error, assert_same_answers, batchrun_env, done_answers, finish, mixed_job,
    reference_run, run, start, submit_args, wait_until_frozen,
)
from tests.support import integrity_ok

JOB_OPTIONS = ("--streaming", "always", "--batch-size", "4")


@pytest.fixture
def reference(tmp_path, tiny_checkpoint) -> Reference:
    return reference_run(tmp_path, tiny_checkpoint("llama"), mixed_job(tmp_path / "job.jsonl"),
                         dict(streaming="always", batch_size=4))


def partial_token_rows(db: Path) -> int:
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as conn:
        return conn.execute("select count(*) from partial").fetchone()[0]


# ---------------------------------------------------------------------------------------------------------------
# Full disk

# The database's write-ahead log grows by a few pages per committed pass: at this size the limit is hit during the
# generation passes, after the first answers were committed.
FILE_SIZE_LIMIT = 256 * 1024


def limit_file_size() -> None:
    """In the child: files cannot grow past FILE_SIZE_LIMIT, and writing past it fails (EFBIG) instead of killing."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))


def test_database_full_mid_run_keeps_committed_answers_and_the_old_output(tmp_path, reference, isolated_state):
    db, out_dir = tmp_path / "progress.db", tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "answers.parquet"
    output.write_bytes(b"the answers of an earlier run")
    args = submit_args(reference.spec, reference.model, db, output, *JOB_OPTIONS, "--force")
    env = batchrun_env(isolated_state)

    full = run(args, env, preexec_fn=limit_file_size)
    error = assert_clean_error(full, str(db), "Answers committed before this point are safe",
                               "run the job again to resume")
    assert "disk" in error
    assert output.read_bytes() == b"the answers of an earlier run"
    assert sorted(p.name for p in out_dir.iterdir()) == [output.name]
    assert integrity_ok(db)
    committed = done_answers(db)
    # It failed mid-job, after real progress: answers, or tokens of unfinished rows, were committed.
    assert len(committed) + partial_token_rows(db) > 0 and len(committed) < 12

    resumed = run(args, env)  # the same command, with room
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.summary["rows_computed_now"] == 12 - len(committed)  # nothing committed is computed again
    after = done_answers(db)
    assert all(after[idx] == answer for idx, answer in committed.items())
    assert_same_answers(read_parquet_results(output), reference.answers)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root to mount); unmounted after the test."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the disk is full."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(descriptor, b"\0" * 4096):
            pass
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(descriptor)
    return filler


def test_output_on_a_full_disk_fails_cleanly_and_succeeds_once_there_is_room(
        tmp_path, reference, isolated_state, small_disk):
    db, output = tmp_path / "progress.db", small_disk / "answers.parquet"
    shutil.copy(tmp_path / "reference.parquet", output)  # an earlier run's answers
    previous = output.read_bytes()
    filler = fill(small_disk)
    args = submit_args(reference.spec, reference.model, db, output, *JOB_OPTIONS, "--force")
    env = batchrun_env(isolated_state)

    full = run(args, env)
    assert_clean_error(full, f"could not write {output}", "No space left on device", "the previous file")
    assert output.read_bytes() == previous
    assert sorted(p.name for p in small_disk.iterdir()) == sorted([output.name, filler.name])  # no temp file
    assert len(done_answers(db)) == 12  # every answer was committed before the output was written

    filler.unlink()
    resumed = run(args, env)
    assert resumed.returncode == 0, resumed.describe()
    assert resumed.summary["rows_computed_now"] == 0
    assert_same_answers(read_parquet_results(output), reference.answers)


# ---------------------------------------------------------------------------------------------------------------
# Two runs of one job


def start_paused_in_first_pass(tmp_path, model, home) -> tuple[list[str], Path, subprocess.Popen]:
    """A run that paused itself inside its first pass, holding the job: deterministic, outside any transaction."""
    db = tmp_path / "progress.db"
    args = submit_args(mixed_job(tmp_path / "job.jsonl"), model, db, tmp_path / "answers.parquet", *JOB_OPTIONS)
    first = start(args, batchrun_env(home, BATCHRUN_STOP_AT="layer:1"))
    wait_until_frozen(first)
    return args, db, first


def test_a_second_run_of_a_running_job_is_refused_naming_the_holder_and_a_dead_holder_blocks_nothing(
        tmp_path, tiny_checkpoint, isolated_state):
    args, db, first = start_paused_in_first_pass(tmp_path, tiny_checkpoint("llama"), isolated_state)
    try:
        status = run(["status", "--db", str(db), "--json"], batchrun_env(isolated_state))
        assert status.returncode == 0, status.describe()
        assert '"running_pid": %d' % first.pid in status.stdout and '"state": "running"' in status.stdout

        second = run(args, batchrun_env(isolated_state))
        assert_clean_error(second, f"is being run by process {first.pid} on ")
        with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as conn:
            assert [pid for (pid,) in conn.execute("select pid from runs")] == [first.pid]  # the second never ran
    finally:
        first.kill()  # SIGKILL: its lock stays behind, as after a crash
        finish(first, args)

    third = run(args, batchrun_env(isolated_state))
    assert third.returncode == 0, third.describe()
    assert third.summary["rows_done"] == 12
    assert "the previous run (pid %d) ended without finishing (killed" % first.pid in third.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_unwind_like_ctrl_c_and_the_job_resumes(tmp_path, tiny_checkpoint, isolated_state, signum):
    """docker stop, systemd, Slurm and a closed terminal send these: the run is marked interrupted, the lock freed."""
    args, db, first = start_paused_in_first_pass(tmp_path, tiny_checkpoint("llama"), isolated_state)
    try:
        first.send_signal(signum)
        first.send_signal(signal.SIGCONT)
    finally:
        stopped = finish(first, args)
    assert stopped.returncode == 128 + signum, stopped.describe()
    assert f"Stopped by {signal.Signals(signum).name}; committed passes are kept" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as conn:
        assert conn.execute("select end_state from runs").fetchall() == [("interrupted",)]
        assert conn.execute("select count(*) from locks").fetchone() == (0,)
    resumed = run(args, batchrun_env(isolated_state))
    assert resumed.returncode == 0 and resumed.summary["rows_done"] == 12, resumed.describe()


# ---------------------------------------------------------------------------------------------------------------
# A hub token is a secret: never in logs, the database or the answers


def test_a_hub_token_never_reaches_logs_database_or_output(tmp_path, tiny_checkpoint, isolated_state):
    token = "hf_batchrunTestSecret" + secrets.token_hex(8)
    hub_home = tmp_path / "hf-home"
    spec = mixed_job(tmp_path / "job.jsonl", rows=4)
    local_args = submit_args(spec, tiny_checkpoint("llama"), tmp_path / "local.db", tmp_path / "local.parquet",
                             "--hf-token", token)
    hub_args = submit_args(spec, Path("batchrun-test-org/no-such-model"), tmp_path / "hub.db",
                           tmp_path / "hub.parquet")
    local = start(local_args, batchrun_env(isolated_state, HF_HOME=str(hub_home)))
    hub = start(hub_args, batchrun_env(isolated_state, HF_HOME=str(hub_home), HF_TOKEN=token))
    local, hub = finish(local, local_args), finish(hub, hub_args)

    assert local.returncode == 0, local.describe()
    assert_clean_error(hub, "batchrun-test-org/no-such-model", "not found")
    for result in (local, hub):
        assert token not in result.stdout and token not in result.stderr
    written = [path for root in (tmp_path, isolated_state) for path in root.rglob("*") if path.is_file()]
    assert tmp_path / "local.db" in written and tmp_path / "local.parquet" in written
    leaked = [path for path in written if token.encode() in path.read_bytes()]
    assert not leaked
