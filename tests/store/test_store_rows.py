"""Jobs and their rows in the progress store: recording a job, atomic commits, partial tokens, status, and answers
taken from earlier jobs or from a job's repeated rows."""
from __future__ import annotations

import os

import pytest

from batchrun.store import JobNotFound
from tests.support import FINGERPRINT, answer, failure, make_job


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
    """A commit per row would take minutes with synchronous=FULL: the rows go in with one BEGIN and one COMMIT."""
    statements = []

    def trace(statement: str) -> None:
        statements.append(statement.split(None, 1)[0].upper())

    store.db.conn.set_trace_callback(trace)
    try:
        job_id = make_job(store, ids=list(range(100_000)))
    finally:
        store.db.conn.set_trace_callback(None)
    assert (statements[0], statements[-1]) == ("BEGIN", "COMMIT")
    assert statements.count("BEGIN") == statements.count("COMMIT") == 1
    assert store.pending_indices(job_id) == list(range(100_000))


# ---- commits -------------------------------------------------------------------------------------

def test_commit_batch_saves_rows_drops_their_partials_and_counts_passes(store):
    job_id = make_job(store)
    store.acquire(job_id)
    store.commit_pass(job_id, [], {0: ([5], -0.5), 1: ([7], -0.25)})
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


def test_a_pass_overwrites_the_tokens_so_far_and_counts_itself_each_time(store):
    job_id = make_job(store)
    store.commit_pass(job_id, [], {0: ([1], -1.0), 2: ([9], -2.0)})
    store.commit_pass(job_id, [], {0: ([1, 2], -1.5), 2: ([9, 8], -2.5)})
    store.commit_pass(job_id, [], {0: ([1, 2, 3], -1.75)})
    assert store.partial_tokens(job_id) == {0: ([1, 2, 3], -1.75), 2: ([9, 8], -2.5)}
    status = store.status(job_id)
    assert (status["passes"], status["partial_rows"], status["partial_tokens"]) == (3, 2, 5)


def test_status_counts_rows_and_estimates_time_left(store, clock):
    job_id = make_job(store, n=6)
    store.acquire(job_id)
    assert store.status(job_id)["eta_seconds"] is None  # nothing answered yet: no rate to go by
    clock.advance(10)
    store.commit_batch(job_id, [answer(0), answer(1)], passes=1)
    store.record_errors(job_id, [failure(2)])
    status = store.status(job_id)
    assert (status["rows_total"], status["rows_done"], status["rows_errored"], status["rows_pending"]) == (6, 2, 1, 3)
    assert status["state"] == "running" and status["running_pid"] == os.getpid()
    assert status["elapsed_seconds"] == 10
    assert status["eta_seconds"] == pytest.approx(3 * 10 / 2)  # 3 rows pending at 2 rows per 10 s


def test_a_running_job_with_a_plan_estimates_time_left_from_passes_not_rows(store, clock):
    """A generation batch answers all its rows at its last pass: after 4 of 20 planned passes no row may be done, and
    after the first batch's last pass the rows' rate would say the job is nearly over."""
    job_id = make_job(store, n=4)
    store.acquire(job_id)
    store.record_run_plan(job_id, batch_size=2, planned_peak_bytes=1, planned_passes=20)
    for _ in range(4):
        clock.advance(2)
        store.commit_pass(job_id, [], {0: ([1], -1.0)})  # a decode pass: no row finished
    status = store.status(job_id)
    assert status["rows_done"] == 0 and status["passes"] == 4 and status["elapsed_seconds"] == 8
    assert status["eta_seconds"] == pytest.approx(16 * 2)  # 16 passes to go at 2 s a pass
    store.commit_batch(job_id, [answer(0), answer(1), answer(2)], passes=6)  # 10 passes: half the plan, 3/4 rows
    status = store.status(job_id)
    assert status["eta_seconds"] == pytest.approx(10 * 8 / 10)  # as long again, not a third of it
    store.release(job_id, "interrupted")
    assert store.status(job_id)["eta_seconds"] == pytest.approx(8 / 3)  # stopped: 1 row pending at 3 rows per 8 s


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


def test_find_job_by_prefix_fingerprint_or_newest(store, clock):
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
    clock.advance(1)
    store.acquire(first)  # resuming the older job makes it the one `status` shows by default
    assert store.find_job(None) == first
    store.release(first, "done")


# ---- answers from earlier jobs ---------------------------------------------------------------------------------

def test_a_new_job_takes_answers_and_tokens_so_far_of_the_same_rows_from_earlier_jobs(store):
    """Rows match by key (what the answer depends on), never by id or place: the edited spec's job gets the finished
    answer and the tokens generated so far of its unchanged rows, and computes only the changed one."""
    old = store.ensure_job("a" * 64, spec_path="s.jsonl", model="m", settings={},
                           rows=[(0, "r0", "key-done"), (1, "r1", "key-midway"), (2, "r2", "key-edited")])
    store.acquire(old)
    store.commit_batch(old, [answer(0, "r0", text="kept answer")], passes=1)
    store.commit_pass(old, [], {1: ([7, 8, 9], -1.5)})
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


def test_repeated_rows_of_a_job_take_the_answer_of_the_one_computed(store):
    job = store.ensure_job("d" * 64, spec_path="s.jsonl", model="m", settings={},
                           rows=[(0, "a", "same"), (1, "b", "same"), (2, "c", "other"), (3, "d", None)])
    assert store.fill_duplicates(job) == 0  # nothing finished yet
    store.acquire(job)
    store.commit_batch(job, [answer(0, "a", text="once")], passes=1)
    store.commit_pass(job, [], {1: ([4], -0.1)})  # a repeat a stopped run had started anyway
    assert store.fill_duplicates(job) == 1
    assert [(r.idx, r.id, r.answer) for r in store.results(job)] == [(0, "a", "once"), (1, "b", "once")]
    assert store.pending_indices(job) == [2, 3] and store.partial_tokens(job) == {}
