"""The progress database itself: migrations, its journal and sync settings, files that are not (or no longer) its
own, a read-only place and a full disk."""
from __future__ import annotations

import sqlite3
import sys

import pytest

from batchrun.store import migrations as store_migrations
from batchrun.store import Store, StoreError
from tests.support import answer, integrity_ok, make_job, start_python


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


# ---- a full disk ---------------------------------------------------------------------------------

FILL_DISK = """
    import os, resource, signal, sys
    from batchrun.store import RowResult, Store, StoreError
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



# ---- a read-only place ----------------------------------------------------------------------------------------

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
