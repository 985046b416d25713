"""Job locks and runs: a live holder blocks, a dead, reused or stale one is taken over, racing processes cannot both
win, a running job's heartbeat, and runs closed and reported."""
from __future__ import annotations

import os
import signal
import sqlite3
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from batchrun.host import HOST, process_identity
from batchrun.store import JobLocked, Store
from tests.support import make_job, start_python


def insert_lock(db_path: Path, job_id: str, *, pid: int, host: str = HOST, identity=None, heartbeat=None) -> None:
    stamp = (heartbeat or datetime.now(timezone.utc)).isoformat()
    with sqlite3.connect(db_path) as conn:
        conn.execute("insert or replace into locks values (?, ?, ?, ?, 1, ?, ?)",
                     (job_id, pid, host, identity, stamp, stamp))


# ---- locks and runs ------------------------------------------------------------------------------

HOLDER = """
    import sys
    from batchrun.store import Store
    store = Store(sys.argv[1])
    store.acquire(sys.argv[2])
    store.record_run_plan(sys.argv[2], batch_size=32, planned_peak_bytes=5_000_000)
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_live_holder_blocks_and_a_killed_one_is_taken_over(store, db_path, clock):
    job_id = make_job(store)
    holder = start_python(HOLDER, str(db_path), job_id)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        with pytest.raises(JobLocked) as locked:
            store.acquire(job_id)
        assert (locked.value.pid, locked.value.host) == (holder.pid, HOST)
        assert str(locked.value).startswith(f"job {job_id} is being run by process {holder.pid} on {HOST} since ")
        status = store.status(job_id)
        assert (status["state"], status["running_pid"]) == ("running", holder.pid)
    finally:
        holder.kill()
        holder.wait()
    after_crash = store.status(job_id)
    assert after_crash["state"] == "interrupted" and after_crash["running_pid"] is None
    clock.advance(3600)
    assert store.status(job_id)["elapsed_seconds"] == after_crash["elapsed_seconds"]  # a dead run's clock stopped
    store.acquire(job_id)
    previous = store.previous_runs(job_id)[-1]
    assert (previous["end_state"], previous["pid"], previous["batch_size"], previous["planned_peak_bytes"]) == (
        "died", holder.pid, 32, 5_000_000)
    store.release(job_id, "done")
    assert store.status(job_id)["state"] == "done"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to tell a zombie apart")
def test_a_killed_holder_its_parent_has_not_reaped_yet_is_taken_over(store, db_path):
    """A supervisor whose child was killed may start the job again before it wait()s: the zombie holds nothing."""
    job_id = make_job(store)
    holder = start_python(HOLDER, str(db_path), job_id)
    try:
        assert holder.stdout.readline().strip() == "locked", holder.stderr.read()
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # only stops a hung test: the kernel makes it a zombie at once
        while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed holder never became a zombie"
            time.sleep(0.02)
        assert store.status(job_id)["state"] == "interrupted"
        store.acquire(job_id)
        store.release(job_id, "done")
    finally:
        holder.kill()
        holder.wait()


def test_a_live_pid_that_is_a_different_process_does_not_hold_the_lock(store, db_path):
    job_id = make_job(store)
    bystander = start_python("import sys; sys.stdin.read()")
    try:
        insert_lock(db_path, job_id, pid=bystander.pid, identity=None)  # identity unknown: trust the pid
        with pytest.raises(JobLocked):
            store.acquire(job_id)
        if process_identity(bystander.pid) is not None:  # Linux: a reused pid (or a reboot) is told apart
            insert_lock(db_path, job_id, pid=bystander.pid, identity="another-boot:123")
            store.acquire(job_id)
    finally:
        bystander.kill()
        bystander.wait()


def test_our_own_pid_blocks_only_while_this_process_holds_the_lock(store, db_path):
    job_id = make_job(store)
    insert_lock(db_path, job_id, pid=os.getpid())  # left by an earlier process with our pid
    store.acquire(job_id)
    with Store(db_path) as second:
        with pytest.raises(JobLocked, match=f"process {os.getpid()}"):
            second.acquire(job_id)
        store.release(job_id, "interrupted")
        second.acquire(job_id)
        second.release(job_id, "done")
    assert store.db["locks"].count == 0


def test_a_lock_from_another_host_expires_with_its_heartbeat(store, db_path):
    job_id = make_job(store)
    insert_lock(db_path, job_id, pid=1, host="other-machine")
    with pytest.raises(JobLocked, match="on other-machine"):
        store.acquire(job_id)
    insert_lock(db_path, job_id, pid=1, host="other-machine",
                heartbeat=datetime.now(timezone.utc) - timedelta(days=1))
    store.acquire(job_id)


def test_a_running_job_keeps_its_lock_fresh_between_commits(store, db_path, monkeypatch):
    """A pass can outlast FOREIGN_LOCK_STALE_AFTER_S: the lock is refreshed on a timer, not only by commits."""
    import threading

    from batchrun.store.locks import LockHeartbeat

    job_id = make_job(store)
    store.acquire(job_id)
    long_ago = "2001-01-01T00:00:00+00:00"
    with sqlite3.connect(db_path) as conn:
        conn.execute("update locks set heartbeat_at = ?", (long_ago,))
        conn.execute("update runs set last_active_at = ?", (long_ago,))
    beaten, beaten_on, real_beat = threading.Event(), [], LockHeartbeat.beat

    def beat(self):
        real_beat(self)
        beaten_on.append(threading.current_thread().name)
        beaten.set()

    monkeypatch.setattr(LockHeartbeat, "beat", beat)
    with store.heartbeat_while_running(job_id, every_s=0.01):
        assert beaten.wait(timeout=60)  # a beat, with no commit meanwhile; the timeout only stops a hung test
    assert set(beaten_on) == {"batchrun-heartbeat"}  # on the timer's thread, not the caller's
    conn = sqlite3.connect(db_path)
    assert conn.execute("select heartbeat_at from locks").fetchone()[0] > long_ago
    assert conn.execute("select last_active_at from runs").fetchone()[0] > long_ago


RACER = """
    import os, sys, time
    from batchrun.store import JobLocked, Store
    store = Store(sys.argv[1])
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.001)
    try:
        store.acquire(sys.argv[2])
        print("won", flush=True)
    except JobLocked:
        print("locked", flush=True)
    sys.stdin.read()
"""


def test_racing_processes_cannot_both_take_the_lock(store, db_path, tmp_path):
    job_id = make_job(store)
    go = tmp_path / "go"
    racers = [start_python(RACER, str(db_path), job_id, str(go)) for _ in range(4)]
    try:
        for racer in racers:
            assert racer.stdout.readline().strip() == "ready", racer.stderr.read()
        go.touch()
        outcomes = sorted(racer.stdout.readline().strip() for racer in racers)
    finally:
        for racer in racers:
            racer.kill()
            racer.wait()
    assert outcomes == ["locked", "locked", "locked", "won"]


def test_a_new_database_another_process_is_writing_opens_once_it_is_free(tmp_path, monkeypatch):
    """Switching a new database to WAL while another connection holds its write lock gets SQLITE_BUSY at once, with
    no busy wait (two runs started together on a new --db met it): the store waits for the lock as for any other."""
    from batchrun.store import locks

    path = tmp_path / "new.db"
    other = sqlite3.connect(path, isolation_level=None)  # another process's first transaction on the new file
    other.execute("create table early (x)")
    other.execute("begin immediate")
    waits = []

    def other_commits(seconds):  # the first wait is when the other process's transaction ends
        waits.append(seconds)
        if other.in_transaction:
            other.execute("commit")

    monkeypatch.setattr(locks, "sleep", other_commits, raising=False)
    try:
        opened = Store(path)
    finally:
        other.close()
    assert len(waits) == 1
    assert opened.db.journal_mode == "wal" and opened.jobs() == []
    opened.close()


def test_release_closes_the_run_and_previous_run_reports_it(store):
    job_id = make_job(store)
    assert store.previous_runs(job_id) == []
    store.acquire(job_id)
    store.record_run_plan(job_id, batch_size=8, planned_peak_bytes=1024)
    store.release(job_id, "failed")
    assert store.status(job_id)["state"] == "failed" and store.db["locks"].count == 0
    store.acquire(job_id)
    assert store.previous_runs(job_id)[-1]["end_state"] == "failed"
    assert store.previous_runs(job_id)[-1]["batch_size"] == 8
    with pytest.raises(ValueError, match="run end state"):
        store.release(job_id, "finished")
