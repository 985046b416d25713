"""The progress store: migrations, jobs and rows, atomic commits, partial tokens, locks, status, full disk."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from batchrun.store import migrations as store_migrations
from batchrun.store.database import JobLocked, JobNotFound, RowResult, Store, StoreError, integrity_ok
from batchrun.host.processes import HOST, process_identity

REPO_ROOT = Path(__file__).resolve().parents[1]
FINGERPRINT = "0123456789abcdef" + "0" * 48


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / "state" / "progress.db"


@pytest.fixture
def store(db_path):
    opened = Store(db_path)
    yield opened
    opened.close()


def make_job(store: Store, n: int = 5, fingerprint: str = FINGERPRINT, ids=None) -> str:
    ids = ids if ids is not None else [f"doc-{i}" for i in range(n)]
    return store.ensure_job(fingerprint, spec_path="jobs/docs.jsonl", model="tiny", settings={"max_tokens": 4},
                            rows=list(enumerate(ids)))


def answer(idx: int, row_id="x", text="yes", tokens=(5, 6)) -> RowResult:
    return RowResult(idx=idx, id=row_id, answer=text, choice_probs=None, score=None, logprob=-0.5,
                     prompt_tokens=12, output_tokens=len(tokens), finish_reason="stop", error=None,
                     token_ids=list(tokens))


def failure(idx: int, message="prompt has 9000 tokens; the context holds 8192") -> RowResult:
    return RowResult(idx=idx, id="x", answer=None, choice_probs=None, score=None, logprob=None,
                     prompt_tokens=None, output_tokens=None, finish_reason="error", error=message)


def start_python(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def insert_lock(db_path: Path, job_id: str, *, pid: int, host: str = HOST, identity=None, heartbeat=None) -> None:
    stamp = (heartbeat or datetime.now(timezone.utc)).isoformat()
    with sqlite3.connect(db_path) as conn:
        conn.execute("insert or replace into locks values (?, ?, ?, ?, 1, ?, ?)",
                     (job_id, pid, host, identity, stamp, stamp))


# ---- migrations and connection -------------------------------------------------------------------

def test_migrations_are_recorded_once_and_not_rerun_on_reopen(db_path):
    Store(db_path).close()
    first = list(sqlite3.connect(db_path).execute("select name, applied_at from _migrations order by name"))
    assert [name for name, _ in first] == [m.__name__ for m in store_migrations.MIGRATIONS]
    Store(db_path).close()
    assert list(sqlite3.connect(db_path).execute("select name, applied_at from _migrations order by name")) == first


def test_a_migration_added_later_runs_once_on_an_existing_database(db_path, monkeypatch):
    with Store(db_path) as old:
        job_id = make_job(old)

    def m999_add_note(db):
        db["jobs"].add_column("note", str)

    monkeypatch.setattr(store_migrations, "MIGRATIONS", [*store_migrations.MIGRATIONS, m999_add_note])
    with Store(db_path) as upgraded:
        assert "note" in upgraded.db["jobs"].columns_dict
        assert upgraded.status(job_id)["rows_total"] == 5
    Store(db_path).close()  # would fail with "duplicate column" if it ran twice
    names = [row[0] for row in sqlite3.connect(db_path).execute("select name from _migrations")]
    assert names.count("m999_add_note") == 1


def test_runs_an_older_version_closed_as_interrupted_keep_their_meaning_of_maybe_killed(db_path, monkeypatch):
    """Before runs could end 'died', a silent death (an OOM kill) was recorded 'interrupted': after the upgrade those
    runs still count for the OOM cap; runs closed from now on say which they were."""
    without_m006 = [m for m in store_migrations.MIGRATIONS if m.__name__ != "m006_died_runs"]
    monkeypatch.setattr(store_migrations, "MIGRATIONS", without_m006)
    with Store(db_path) as old:
        job_id = make_job(old)
        old.acquire(job_id)
        old.release(job_id, "interrupted")
    monkeypatch.undo()
    with Store(db_path) as upgraded:
        assert [run["end_state"] for run in upgraded.previous_runs(job_id)] == ["died"]
        upgraded.acquire(job_id)
        upgraded.release(job_id, "interrupted")
        assert [run["end_state"] for run in upgraded.previous_runs(job_id)] == ["died", "interrupted"]


def test_a_failing_migration_leaves_no_trace(db_path, monkeypatch):
    Store(db_path).close()

    def m999_broken(db):
        db["half_done"].create({"x": int})
        raise RuntimeError("migration bug")

    monkeypatch.setattr(store_migrations, "MIGRATIONS", [*store_migrations.MIGRATIONS, m999_broken])
    with pytest.raises(RuntimeError, match="migration bug"):
        Store(db_path)
    conn = sqlite3.connect(db_path)
    assert conn.execute("select count(*) from sqlite_master where name = 'half_done'").fetchone()[0] == 0
    assert conn.execute("select count(*) from _migrations where name = 'm999_broken'").fetchone()[0] == 0


def test_database_is_wal_with_full_sync(store):
    assert store.db.journal_mode == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_status_reads_while_another_process_holds_the_write_lock(store, db_path):
    job_id = make_job(store)
    writer = sqlite3.connect(db_path, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("update rows set state = 'done' where idx = 0")
    with Store(db_path) as reader:
        assert reader.status(job_id)["rows_pending"] == 5  # sees the last commit, not the open write
    writer.execute("COMMIT")


def test_opening_a_file_that_is_not_a_database_names_it(tmp_path):
    bogus = tmp_path / "notes.db"
    bogus.write_text("these are my notes, not a database" * 100)
    with pytest.raises(StoreError, match="notes.db"):
        Store(bogus)
    assert not integrity_ok(bogus)


def test_a_log_left_beside_a_deleted_database_is_refused_not_replayed(db_path):
    """A killed run leaves its -wal file; the user deletes the database to start over. SQLite would replay the log
    into the new database (the deleted job came back) or fail with SQLITE_IOERR_SHORT_READ: refuse, name the log,
    and leave it where it is."""
    store = Store(db_path)
    store.db.execute("PRAGMA wal_autocheckpoint=0")  # the commits stay in the log, as when the process is killed
    make_job(store)
    log = db_path.with_name(db_path.name + "-wal")
    left_behind = log.read_bytes()
    store.close()  # a clean close checkpoints and deletes the log: put the killed process's back
    db_path.unlink()
    log.write_bytes(left_behind)
    with pytest.raises(StoreError, match=f"{log.name}.*no longer at"):
        Store(db_path)
    assert log.read_bytes() == left_behind and not db_path.exists()
    log.rename(db_path.with_name("moved-away"))
    with Store(db_path) as fresh:
        assert fresh.jobs() == []


# ---- jobs and rows -------------------------------------------------------------------------------

def test_ensure_job_is_idempotent(store):
    first = make_job(store)
    assert first == FINGERPRINT[:16]
    assert make_job(store) == first
    assert store.db["rows"].count == 5
    assert len(store.jobs()) == 1
    other = make_job(store, fingerprint="fedcba9876543210" + "1" * 48)
    assert other != first and len(store.jobs()) == 2


def test_row_ids_keep_their_type(store):
    job_id = make_job(store, ids=[7, "7"])
    store.commit_batch(job_id, [answer(0), answer(1)], passes=1)
    assert [r.id for r in store.results(job_id)] == [7, "7"]


def test_ensure_job_records_100k_rows_in_one_transaction(store):
    started = time.perf_counter()
    job_id = make_job(store, ids=list(range(100_000)))
    assert time.perf_counter() - started < 5  # a commit per row would take minutes with synchronous=FULL
    assert store.pending_indices(job_id) == list(range(100_000))


# ---- commits -------------------------------------------------------------------------------------

def test_commit_batch_saves_rows_drops_their_partials_and_counts_passes(store):
    job_id = make_job(store)
    store.acquire(job_id)
    store.save_partial(job_id, {0: ([5], -0.5), 1: ([7], -0.25)})
    store.commit_batch(job_id, [answer(0, tokens=(5, 6))], passes=2)
    assert store.partial_tokens(job_id) == {1: ([7], -0.25)}
    assert store.pending_indices(job_id) == [1, 2, 3, 4]
    assert store.status(job_id)["passes"] == 3
    store.release(job_id, "interrupted")
    assert store.previous_runs(job_id)[-1]["passes"] == 3
    (saved,) = store.results(job_id)
    assert (saved.answer, saved.token_ids, saved.id) == ("yes", [5, 6], "doc-0")


def test_commit_batch_is_all_or_nothing(store):
    job_id = make_job(store)
    with pytest.raises(ValueError, match=r"no rows \[99\]"):
        store.commit_batch(job_id, [answer(0), answer(99)], passes=1)
    bad_reason = answer(1)
    bad_reason.finish_reason = "eos"
    with pytest.raises(ValueError, match="finish_reason"):
        store.commit_batch(job_id, [answer(0), bad_reason], passes=1)
    assert store.pending_indices(job_id) == [0, 1, 2, 3, 4]
    assert store.status(job_id)["passes"] == 0


def test_record_errors_saves_failed_rows_without_passes_and_refuses_answers(store):
    job_id = make_job(store)
    store.record_errors(job_id, [failure(3)])
    (row,) = store.results(job_id)
    assert (row.idx, row.finish_reason, row.error) == (3, "error", "prompt has 9000 tokens; the context holds 8192")
    assert store.status(job_id)["passes"] == 0
    with pytest.raises(ValueError, match="row 1 is not an error"):
        store.record_errors(job_id, [answer(1)])


def test_results_are_finished_rows_in_input_order(store):
    job_id = make_job(store)
    store.commit_batch(job_id, [answer(4, text="d"), answer(1, text="b")], passes=1)
    store.record_errors(job_id, [failure(2)])
    assert [(r.idx, r.answer) for r in store.results(job_id)] == [(1, "b"), (2, None), (4, "d")]


def test_save_partial_overwrites_and_counts_a_pass_each_time(store):
    job_id = make_job(store)
    store.save_partial(job_id, {0: ([1], -1.0), 2: ([9], -2.0)})
    store.save_partial(job_id, {0: ([1, 2], -1.5), 2: ([9, 8], -2.5)})
    store.save_partial(job_id, {0: ([1, 2, 3], -1.75)})
    assert store.partial_tokens(job_id) == {0: ([1, 2, 3], -1.75), 2: ([9, 8], -2.5)}
    status = store.status(job_id)
    assert (status["passes"], status["partial_rows"], status["partial_tokens"]) == (3, 2, 5)


def test_status_counts_rows_and_estimates_time_left(store):
    job_id = make_job(store, n=6)
    store.acquire(job_id)
    assert store.status(job_id)["eta_seconds"] is None  # nothing answered yet: no rate to go by
    time.sleep(0.05)
    store.commit_batch(job_id, [answer(0), answer(1)], passes=1)
    store.record_errors(job_id, [failure(2)])
    status = store.status(job_id)
    assert (status["rows_total"], status["rows_done"], status["rows_errored"], status["rows_pending"]) == (6, 2, 1, 3)
    assert status["state"] == "running" and status["running_pid"] == os.getpid()
    assert status["elapsed_seconds"] >= 0.05
    assert status["eta_seconds"] == pytest.approx(3 * status["elapsed_seconds"] / 2, rel=0.5)


def test_a_running_job_with_a_plan_estimates_time_left_from_passes_not_rows(store):
    """A generation batch answers all its rows at its last pass: after 4 of 20 planned passes no row may be done, and
    after the first batch's last pass the rows' rate would say the job is nearly over."""
    job_id = make_job(store, n=4)
    store.acquire(job_id)
    store.record_run_plan(job_id, batch_size=2, planned_peak_bytes=1, planned_passes=20)
    for _ in range(4):
        store.save_partial(job_id, {0: ([1], -1.0)})  # a decode pass: no row finished
    time.sleep(0.05)
    status = store.status(job_id)
    assert status["rows_done"] == 0 and status["passes"] == 4
    assert status["eta_seconds"] == pytest.approx(16 * status["elapsed_seconds"] / 4, rel=0.5)
    store.commit_batch(job_id, [answer(0), answer(1), answer(2)], passes=6)  # 10 passes: half the plan, 3/4 rows
    status = store.status(job_id)
    assert status["eta_seconds"] == pytest.approx(status["elapsed_seconds"], rel=0.5)  # not a third of it
    store.release(job_id, "interrupted")
    assert store.status(job_id)["eta_seconds"] == pytest.approx(store.status(job_id)["elapsed_seconds"] / 3)


def test_status_of_an_unknown_job_names_it(store):
    with pytest.raises(JobNotFound, match="no job feedfeedfeedfeed"):
        store.status("feedfeedfeedfeed")


def test_jobs_lists_newest_first_with_counts(store):
    older = make_job(store)
    newer = make_job(store, n=2, fingerprint="fedcba9876543210" + "1" * 48)
    store.commit_batch(newer, [answer(0)], passes=1)
    listed = store.jobs()
    assert [job["id"] for job in listed] == [newer, older]
    assert (listed[0]["rows_done"], listed[0]["rows_pending"], listed[0]["state"]) == (1, 1, "pending")


def test_find_job_by_prefix_fingerprint_or_newest(store):
    with pytest.raises(JobNotFound, match="no jobs recorded"):
        store.find_job(None)
    first = make_job(store, fingerprint="abc1000000000000" + "2" * 48)
    second = make_job(store, fingerprint="abc2000000000000" + "3" * 48)
    assert store.find_job(None) == second
    assert store.find_job("ABC1") == first
    assert store.find_job("abc2000000000000" + "3" * 48) == second
    with pytest.raises(JobNotFound, match=f"ambiguous.*{first}.*|ambiguous.*{second}.*"):
        store.find_job("abc")
    with pytest.raises(JobNotFound, match=f'no job matches "zzz".*{second}'):
        store.find_job("zzz")
    time.sleep(0.01)  # timestamps have millisecond resolution
    store.acquire(first)  # resuming the older job makes it the one `status` shows by default
    assert store.find_job(None) == first
    store.release(first, "done")


# ---- locks and runs ------------------------------------------------------------------------------

HOLDER = """
    import sys
    from batchrun.store.database import Store
    store = Store(sys.argv[1])
    store.acquire(sys.argv[2])
    store.record_run_plan(sys.argv[2], batch_size=32, planned_peak_bytes=5_000_000)
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_live_holder_blocks_and_a_killed_one_is_taken_over(store, db_path):
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
    time.sleep(0.05)
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
        for _ in range(100):  # until the kernel has made it a zombie (not reaped: no wait() yet)
            if Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
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


def test_a_running_job_keeps_its_lock_fresh_between_commits(store, db_path):
    """A pass can outlast FOREIGN_LOCK_STALE_AFTER_S: the lock is refreshed on a timer, not only by commits."""
    job_id = make_job(store)
    store.acquire(job_id)
    long_ago = "2001-01-01T00:00:00+00:00"
    with sqlite3.connect(db_path) as conn:
        conn.execute("update locks set heartbeat_at = ?", (long_ago,))
        conn.execute("update runs set last_active_at = ?", (long_ago,))
    with store.heartbeat_while_running(job_id, every_s=0.05):
        time.sleep(0.5)  # no commit meanwhile
    conn = sqlite3.connect(db_path)
    assert conn.execute("select heartbeat_at from locks").fetchone()[0] > long_ago
    assert conn.execute("select last_active_at from runs").fetchone()[0] > long_ago


RACER = """
    import os, sys, time
    from batchrun.store.database import JobLocked, Store
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


# ---- a full disk ---------------------------------------------------------------------------------

FILL_DISK = """
    import os, resource, signal, sys
    from batchrun.store.database import RowResult, Store, StoreError
    path, job_id = sys.argv[1], sys.argv[2]
    store = Store(path)
    # A file-size limit makes writes fail like a full disk; ignore SIGXFSZ so write() returns EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = max(os.path.getsize(path), os.path.getsize(path + "-wal")) + 64 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    batch = [RowResult(i, i, "x" * 20_000, None, None, None, 1, 1, "stop", None) for i in range(2, 102)]
    try:
        store.commit_batch(job_id, batch, passes=1)
    except StoreError as error:
        print(error)
        sys.exit(0)
    sys.exit("the oversized commit did not fail")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_full_disk_raises_store_error_and_keeps_earlier_commits(store, db_path):
    job_id = make_job(store, ids=list(range(120)))
    store.commit_batch(job_id, [answer(0, text="first"), answer(1, text="second")], passes=1)
    filler = start_python(FILL_DISK, str(db_path), job_id)
    stdout, stderr = filler.communicate(timeout=60)
    assert filler.returncode == 0, stderr
    assert str(db_path) in stdout and "committed before this point are safe" in stdout
    store.close()
    assert integrity_ok(db_path)
    with Store(db_path) as reopened:
        assert [r.answer for r in reopened.results(job_id)] == ["first", "second"]
        assert reopened.pending_indices(job_id) == list(range(2, 120))
        assert reopened.status(job_id)["passes"] == 1


# ---- answers from earlier jobs ---------------------------------------------------------------------------------

def test_a_new_job_takes_answers_and_tokens_so_far_of_the_same_rows_from_earlier_jobs(store):
    """Rows match by key (what the answer depends on), never by id or place: the edited spec's job gets the finished
    answer and the tokens generated so far of its unchanged rows, and computes only the changed one."""
    old = store.ensure_job("a" * 64, spec_path="s.jsonl", model="m", settings={},
                           rows=[(0, "r0", "key-done"), (1, "r1", "key-midway"), (2, "r2", "key-edited")])
    store.acquire(old)
    store.commit_batch(old, [answer(0, "r0", text="kept answer")], passes=1)
    store.save_partial(old, {1: ([7, 8, 9], -1.5)})
    store.release(old, "interrupted")
    new = store.ensure_job("b" * 64, spec_path="s.jsonl", model="m", settings={},
                           rows=[(0, "renamed", "key-midway"), (1, "r1", "key-changed"), (2, "r0", "key-done")])
    reused = store.reuse_answers(new)
    assert (reused.answers, reused.partial_rows, reused.from_jobs) == (1, 1, [old])
    assert [(r.idx, r.id, r.answer) for r in store.results(new)] == [(2, "r0", "kept answer")]
    assert store.partial_tokens(new) == {0: ([7, 8, 9], -1.5)}
    assert store.pending_indices(new) == [0, 1]
    assert store.reuse_answers(new).answers == 0  # once taken, nothing more to take
    # rows without a key (an older database, rows that cannot run) take nothing
    bare = store.ensure_job("c" * 64, spec_path="s.jsonl", model="m", settings={}, rows=[(0, "r0")])
    assert store.reuse_answers(bare).answers == 0 and store.pending_indices(bare) == [0]


def test_a_read_only_database_is_named_as_such_with_the_way_out(tmp_path, monkeypatch):
    """Root ignores permissions, so the read-only directory is simulated: the message says why and what to do."""
    from batchrun.store import files as store_files

    error = sqlite3.OperationalError("unable to open database file")
    error.sqlite_errorname = "SQLITE_CANTOPEN"
    monkeypatch.setattr(store_files, "writable", lambda path: False)
    message = store_files.describe_failure(tmp_path / "x.db", "open the progress database", error)
    assert "read-only" in message and "copy it to a writable place" in message and "--db" in message
    monkeypatch.setattr(store_files, "writable", lambda path: True)  # writable: some other cause, said as before
    assert "read-only" not in store_files.describe_failure(tmp_path / "x.db", "open the progress database", error)


def test_repeated_rows_of_a_job_take_the_answer_of_the_one_computed(store):
    job = store.ensure_job("d" * 64, spec_path="s.jsonl", model="m", settings={},
                           rows=[(0, "a", "same"), (1, "b", "same"), (2, "c", "other"), (3, "d", None)])
    assert store.fill_duplicates(job) == 0  # nothing finished yet
    store.acquire(job)
    store.commit_batch(job, [answer(0, "a", text="once")], passes=1)
    store.save_partial(job, {1: ([4], -0.1)})  # a repeat a stopped run had started anyway
    assert store.fill_duplicates(job) == 1
    assert [(r.idx, r.id, r.answer) for r in store.results(job)] == [(0, "a", "once"), (1, "b", "once")]
    assert store.pending_indices(job) == [2, 3] and store.partial_tokens(job) == {}
