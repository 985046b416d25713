"""A damaged progress database: the error says what is true and what to do, one job's damaged pages block no other
job, `batchrun db check` says what is readable and `batchrun db salvage` copies it into a new database, leaving the
damaged file as it was."""
from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from pathlib import Path

import pytest

from batchrun.store import DatabaseDamaged, DatabaseUnreadable, Store, check_database, salvage_database
from tests.support import answer, invoke, make_job

JOB_A = "aaaaaaaaaaaaaaaa" + "0" * 48
JOB_B = "bbbbbbbbbbbbbbbb" + "0" * 48
ROWS = 300


def marker(job: str, idx: int) -> str:
    return f"answer-{job[:4]}-{idx:04d}-" + "x" * 160  # ~20 rows a 4 KiB page


def two_jobs(path: Path) -> tuple[str, str]:
    """A database holding jobs A and B, every row answered with a text naming its job and row, closed (the log
    checkpointed into the file)."""
    with Store(path) as store:
        ids = []
        for fingerprint in (JOB_A, JOB_B):
            job_id = make_job(store, fingerprint=fingerprint, ids=[f"r{i}" for i in range(ROWS)])
            store.acquire(job_id)
            store.commit_batch(job_id, [answer(i, f"r{i}", text=marker(fingerprint, i)) for i in range(ROWS)],
                               passes=1)
            store.release(job_id, "done")
            ids.append(job_id)
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return ids[0], ids[1]


def damage_page_holding(path: Path, text: str) -> set[str]:
    """Overwrite the page that holds `text` with 0xFF bytes (no valid page starts so); the markers it held."""
    data = bytearray(path.read_bytes())
    page_size = int.from_bytes(data[16:18], "big")
    start = data.index(text.encode()) // page_size * page_size
    held = set(re.findall(rb"answer-[a-z]{4}-\d{4}", bytes(data[start:start + page_size])))
    data[start:start + page_size] = b"\xff" * page_size
    path.write_bytes(bytes(data))
    return {marker.decode() for marker in held}


def answers_by_marker(path: Path) -> set[str]:
    with Store(path) as store:
        return {row.answer[:16] for job in store.jobs() for row in store.results(job["id"])}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_corrupt_database_error_says_what_is_true(tmp_path):
    """A truncated file: the error names the file and SQLite's verdict, does not promise that answers are safe or
    that running again resumes, and gives the commands that check and salvage it."""
    db = tmp_path / "j.db"
    two_jobs(db)
    with open(db, "r+b") as handle:
        handle.truncate(40_000)
    result = invoke("status", "--db", db)
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {db} is damaged: SQLite said \"database disk image is malformed")
    assert f"`batchrun db check --db {db}`" in line
    assert f"`batchrun db salvage --db {db} -o {tmp_path / 'j.salvaged.db'}`" in line
    assert "move" in line and "aside" in line
    assert "are safe" not in line and "run the job again" not in line
    with pytest.raises(DatabaseDamaged, match="is damaged"):
        Store(db)


def test_a_file_that_is_not_a_database_is_not_called_damaged(tmp_path):
    notes = tmp_path / "notes.db"
    notes.write_text("my notes, not a database\n" * 200)
    result = invoke("jobs", "--db", notes)
    assert result.exit_code == 1 and "is not a SQLite database" in result.stderr and "salvage" not in result.stderr
    with pytest.raises(DatabaseUnreadable, match="is not a SQLite database"):
        check_database(notes)
    # nor sent to SQLite's shell to recover a database it never was
    checked = invoke("db", "check", "--db", notes)
    assert checked.exit_code == 1 and "is not a SQLite database" in checked.stderr
    assert ".recover" not in checked.stderr and "pass the progress database as --db" in checked.stderr


def test_damaged_rows_of_one_job_never_block_the_others(tmp_path):
    db = tmp_path / "j.db"
    job_a, job_b = two_jobs(db)
    damage_page_holding(db, marker(JOB_A, 150))

    listing = invoke("jobs", "--db", db)
    assert listing.exit_code == 0, listing.output
    assert re.search(rf"^{job_b}\s+done\s+{ROWS}/{ROWS}\s", listing.stdout, re.M)
    assert re.search(rf"^{job_a}\s+damaged\s+\?/{ROWS}\s", listing.stdout, re.M)
    assert "cannot be read" in listing.stderr and "db salvage" in listing.stderr
    listed = {job["id"]: job for job in json.loads(invoke("jobs", "--db", db, "--json").stdout)}
    assert listed[job_b]["rows_done"] == ROWS and listed[job_a]["state"] == "damaged"

    other = invoke("status", job_b, "--db", db)
    assert other.exit_code == 0 and f"{ROWS} done, 0 errored, 0 pending of {ROWS}" in other.stdout
    damaged = invoke("status", job_a, "--db", db)
    assert damaged.exit_code == 1 and f"when asked to read job {job_a}" in damaged.stderr
    with Store(db) as store:  # a new job still runs beside the damaged one; reusing its answers is given up
        job_c = make_job(store, fingerprint="cccccccccccccccc" + "0" * 48, ids=["r150"])
        assert store.reuse_answers(job_c).answers == 0 and store.pending_indices(job_c) == [0]


def test_db_salvage_copies_every_readable_row(tmp_path):
    """One damaged page costs exactly the rows on it; every other row of every job, its runs and partial tokens
    are copied; the new database works (status, a resume records the lost rows again) and the damaged file is
    unchanged."""
    db = tmp_path / "j.db"
    job_a, job_b = two_jobs(db)
    with Store(db) as store:
        store.acquire(job_b)
        store.commit_pass(job_b, [], {3: ([5, 6, 7], -1.5)})
        store.release(job_b, "interrupted")
        store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    lost = damage_page_holding(db, marker(JOB_A, 150))
    assert 5 <= len(lost) <= 40 and f"answer-{JOB_A[:4]}-0150" in lost
    before = sha256(db)

    check = invoke("db", "check", "--db", db)
    assert check.exit_code == 1 and f"{db}: DAMAGED" in check.stdout
    assert f"job {job_a}  {ROWS - len(lost)} of {ROWS} rows readable, {len(lost)} lost" in check.stdout
    assert f"job {job_b}  {ROWS} of {ROWS} rows readable ({ROWS} finished); 1 partial, 2 runs" in check.stdout

    out = tmp_path / "salvaged.db"
    result = invoke("db", "salvage", "--db", db, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"{len(lost)} rows lost" in result.stdout and f"mv {db} {db}.damaged" in result.stdout
    assert sha256(db) == before  # read, never written
    everything = {f"answer-{job[:4]}-{i:04d}" for job in (JOB_A, JOB_B) for i in range(ROWS)}
    assert answers_by_marker(out) == everything - lost

    with Store(out) as salvaged:
        assert salvaged.partial_tokens(job_b) == {3: ([5, 6, 7], -1.5)}
        assert [run["end_state"] for run in salvaged.runs(job_b)] == ["done", "interrupted"]
        status = salvaged.status(job_a)
        assert (status["state"], status["rows_lost"]) == ("interrupted", len(lost))  # not "done" any more
        make_job(salvaged, fingerprint=JOB_A, ids=[f"r{i}" for i in range(ROWS)])  # the spec submitted again
        assert len(salvaged.pending_indices(job_a)) == len(lost)
    assert check_database(out).ok


def test_db_salvage_of_a_truncated_database_keeps_the_jobs_and_says_what_was_lost(tmp_path):
    db = tmp_path / "j.db"
    job_a, job_b = two_jobs(db)
    with open(db, "r+b") as handle:
        handle.truncate(40_000)
    found = json.loads(invoke("db", "check", "--db", db, "--json").stdout)
    assert found["ok"] is False and found["integrity_error"]
    result = invoke("db", "salvage", "--db", db, "-o", tmp_path / "new.db", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    jobs = {job["id"]: job for job in report["jobs"]}
    assert set(jobs) == {job_a, job_b}
    for job in jobs.values():
        assert job["rows_readable"] + job["rows_lost"] == ROWS
    assert sum(job["rows_readable"] for job in jobs.values()) == len(answers_by_marker(tmp_path / "new.db"))


def test_db_salvage_refuses_to_overwrite_and_a_sound_database_checks_ok(tmp_path):
    db = tmp_path / "j.db"
    two_jobs(db)
    check = invoke("db", "check", "--db", db)
    assert check.exit_code == 0 and f"{db}: sound" in check.stdout and "integrity  ok" in check.stdout
    existing = tmp_path / "mine.db"
    existing.write_text("keep me")
    refused = invoke("db", "salvage", "--db", db, "-o", existing)
    assert refused.exit_code == 1 and "already exists" in refused.stderr and existing.read_text() == "keep me"
    itself = invoke("db", "salvage", "--db", db, "-o", db)
    assert itself.exit_code == 1 and "is the damaged database itself" in itself.stderr
    copy = tmp_path / "copy.db"
    assert invoke("db", "salvage", "--db", db, "-o", copy).exit_code == 0
    assert answers_by_marker(copy) == answers_by_marker(db)
    assert not list(tmp_path.glob(".copy.db.salvage-*"))


def test_salvage_reads_a_database_left_with_its_write_ahead_log(tmp_path):
    """Commits still in the -wal file (a killed run's) are part of the database: salvage reads them too."""
    db = tmp_path / "j.db"
    store = Store(db)
    store.db.execute("PRAGMA wal_autocheckpoint=0")
    job_id = make_job(store, ids=["a", "b"])
    store.commit_batch(job_id, [answer(0, "a", text="kept in the log")], passes=1)
    log = db.with_name("j.db-wal").read_bytes()
    store.close()
    db.with_name("j.db-wal").write_bytes(log)  # a clean close folded the log in: put the killed run's back
    found = salvage_database(db, tmp_path / "new.db")
    assert [(job.id, job.rows_readable, job.rows_finished) for job in found.jobs] == [(job_id, 2, 1)]
    with Store(tmp_path / "new.db") as salvaged:
        assert [row.answer for row in salvaged.results(job_id)] == ["kept in the log"]


def test_records_with_undecodable_text_are_rejected_not_copied(tmp_path):
    db = tmp_path / "j.db"
    with Store(db) as store:
        job_id = make_job(store, ids=["a", "b", "c"])
        store.commit_batch(job_id, [answer(i, "x", text=f"fine {i}") for i in range(3)], passes=1)
    conn = sqlite3.connect(db)
    conn.execute("update rows set id_json = cast(x'22ff22' as text) where idx = 1")  # not UTF-8
    conn.commit()
    conn.close()
    found = salvage_database(db, tmp_path / "new.db")
    assert found.tables["rows"].rejected == 1 and found.jobs[0].rows_lost == 1
    with Store(tmp_path / "new.db") as salvaged:
        assert [row.idx for row in salvaged.results(job_id)] == [0, 2]
