"""Answers a new job takes from earlier ones: the same row (row_key) on the same model needs no second computation.

A job is the fingerprint of its whole spec, so a blank line, one edited prompt or an appended row makes a new job;
without this, its run would start from nothing while the old job's answers sat in the same database. Rows are
matched by what their answer depends on (prepare.row_keys: model, compute dtype, tokens, choices, token limit, stop
strings), never by id or position. Finished answers are copied; a row another job left mid-generation gives its
tokens so far, which the run restores with one prefill pass as it would its own. Within one job, rows with the
same key (a corpus's repeated documents) are computed once and the others filled from it (fill_duplicates).
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

ANSWER_COLUMNS = ("state", "answer", "choice_probs_json", "score", "logprob", "prompt_tokens", "output_tokens",
                  "finish_reason", "error", "output_token_ids_json", "choice_tokens_json", "rationale_json",
                  "grammar_json")

# The finished rows a pending row of this job may take its answer from: another job's, or its own job's repeats.
_DONE_ELSEWHERE = ("from rows other where other.row_key = rows.row_key and other.state = 'done' "
                   "and other.job_id != rows.job_id")
_DONE_IN_THIS_JOB = ("from rows other where other.row_key = rows.row_key and other.state = 'done' "
                     "and other.job_id = rows.job_id and other.idx != rows.idx")


@dataclass
class Reused:
    answers: int = 0  # pending rows that took a finished answer
    partial_rows: int = 0  # pending rows that took another job's tokens so far
    from_jobs: list[str] = field(default_factory=list)


def reuse_answers(conn: sqlite3.Connection, job_id: str) -> Reused:
    """Fill this job's pending rows from other jobs' rows with the same key (inside the caller's transaction)."""
    sources = [job for (job,) in conn.execute(
        "select distinct other.job_id from rows join rows other on other.row_key = rows.row_key "
        "and other.job_id != rows.job_id and (other.state = 'done' or exists (select 1 from partial "
        "where partial.job_id = other.job_id and partial.idx = other.idx)) "
        "where rows.job_id = ? and rows.state = 'pending' and rows.row_key is not null", (job_id,))]
    if not sources:
        return Reused()
    answers = _copy_answers(conn, job_id, _DONE_ELSEWHERE)
    # The longest run of tokens another job generated for a row this job has not started (SQLite takes the bare
    # columns from the row where max() is found).
    partial_rows = conn.execute(
        "insert into partial (job_id, idx, token_ids_json, token_count, logprob, updated_at, rationale_json, "
        "grammar_json) select rows.job_id, rows.idx, p.token_ids_json, max(p.token_count), p.logprob, p.updated_at, "
        "p.rationale_json, p.grammar_json "
        "from rows join rows other on other.row_key = rows.row_key and other.job_id != rows.job_id "
        "join partial p on p.job_id = other.job_id and p.idx = other.idx "
        "where rows.job_id = ? and rows.state = 'pending' and rows.row_key is not null "
        "and not exists (select 1 from partial own where own.job_id = rows.job_id and own.idx = rows.idx) "
        "group by rows.idx", (job_id,)).rowcount
    return Reused(answers, partial_rows, sources if answers or partial_rows else [])


def fill_duplicates(conn: sqlite3.Connection, job_id: str) -> int:
    """Answer this job's pending rows from its own finished rows with the same key; returns how many."""
    return _copy_answers(conn, job_id, _DONE_IN_THIS_JOB)


def _copy_answers(conn: sqlite3.Connection, job_id: str, sources: str) -> int:
    """Give each pending keyed row of the job the answer of a row `sources` finds for it (a `from rows other ...`
    clause); drop the tokens so far of the rows that got one. Returns how many did."""
    columns = ", ".join(ANSWER_COLUMNS)
    copied = conn.execute(
        f"update rows set ({columns}) = (select {', '.join('other.' + c for c in ANSWER_COLUMNS)} {sources} limit 1) "
        f"where job_id = ? and state = 'pending' and row_key is not null and exists (select 1 {sources})",
        (job_id,)).rowcount
    conn.execute("delete from partial where job_id = ? and idx in (select idx from rows where job_id = ? "
                 "and state != 'pending')", (job_id, job_id))
    return copied
