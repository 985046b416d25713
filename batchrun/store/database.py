"""The durable progress store: jobs, their rows and the answers committed for them, in SQLite through sqlite-utils,
over the runs and locks of store/runs.py and the transactions of store/connection.py.

A batch of answers is committed in one transaction with synchronous=FULL, so once commit_batch returns
those answers survive a crash or a power cut, and a resumed job redoes only what was never committed.
"""
from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from typing import Iterator, Mapping, Sequence

from batchrun.store.errors import DatabaseDamaged, JobNotFound, StoreError
from batchrun.store.locks import eta_seconds, job_summary, log, mark_alive, run_seconds, timestamp, utc_now
from batchrun.store.reuse import Reused, fill_duplicates, reuse_answers
from batchrun.store.rows import ROW_UPDATE_SQL, JobRow, Rationale, RowResult, row_result_from_db, row_update_params
from batchrun.store.runs import Runs

__all__ = ["Store"]


class Store(Runs):
    """Jobs, their rows and the answers committed for them, on top of the runs and locks of Runs."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- jobs and rows -------------------------------------------------------------------------

    def ensure_job(
        self,
        fingerprint: str,
        *,
        spec_path: str,
        model: str,
        settings: dict,
        rows: Sequence[tuple],
    ) -> str:
        """Record a job and its rows (all pending) once; return its id. The same fingerprint -> the same job.
        Each row is a JobRow or a tuple of its leading fields: (idx, id), (idx, id, key), ..."""
        if len(fingerprint) < 16:
            raise ValueError(f"job fingerprint {fingerprint!r} is too short: need at least 16 characters")
        job_id = fingerprint[:16]
        with self._write("record the job"):
            known = self._row("jobs", job_id)
            if known is None:
                self.db["jobs"].insert({
                    "id": job_id, "fingerprint": fingerprint, "spec_path": str(spec_path), "model": model,
                    "settings_json": json.dumps(settings, sort_keys=True), "created_at": timestamp(),
                    "state": "pending", "total_rows": len(rows), "passes_done": 0})
            elif known["fingerprint"] != fingerprint:
                raise StoreError(f"job id {job_id} in {self.path} already belongs to fingerprint "
                                 f"{known['fingerprint']}, not {fingerprint}")
            # A known job short of rows lost them from a damaged database (the rest salvaged): recorded again, as
            # pending, or a resumed job would end without ever answering them.
            if known is None or self.db["rows"].count_where("job_id = ?", [job_id]) < len(rows):
                self.db["rows"].insert_all(_pending_rows(job_id, rows), ignore=known is not None)
        return job_id

    def reuse_answers(self, job_id: str) -> Reused:
        """Give this job's pending rows the answers (or tokens so far) other jobs have for the same rows. Another job's
        damaged pages cost only the reuse: this job's rows are computed instead."""
        try:
            with self._write("take answers from earlier jobs") as conn:
                return reuse_answers(conn, job_id)
        except DatabaseDamaged as damaged:
            log.warning("no answers taken from earlier jobs: %s", damaged)
            return Reused()

    def fill_duplicates(self, job_id: str) -> int:
        """Answer pending rows that repeat a finished row of the same job exactly; returns how many."""
        with self._write("answer repeated rows") as conn:
            return fill_duplicates(conn, job_id)

    def pending_indices(self, job_id: str) -> list[int]:
        with self._translate_errors("read pending rows"):
            return [row["idx"] for row in self.db["rows"].rows_where(
                "job_id = ? and state = 'pending'", [job_id], select="idx", order_by="idx")]

    def results(self, job_id: str) -> list[RowResult]:
        """Finished rows (answered or errored) in input order."""
        with self._translate_errors("read results"):
            return [row_result_from_db(row) for row in self.db["rows"].rows_where(
                "job_id = ? and state != 'pending'", [job_id], order_by="idx")]

    # ---- committing progress -------------------------------------------------------------------

    def commit_batch(self, job_id: str, results: Sequence[RowResult], passes: int) -> None:
        """Save finished rows, drop their partial tokens and count the passes, all in one transaction."""
        self.commit_pass(job_id, results, {}, passes)

    def record_errors(self, job_id: str, results: Sequence[RowResult]) -> None:
        """Save rows that failed before any pass (invalid input, prompt too long)."""
        for result in results:
            if not result.failed:
                raise ValueError(f"row {result.idx} is not an error: use commit_batch for answers")
        self.commit_batch(job_id, results, passes=0)

    def commit_pass(self, job_id: str, finished: Sequence[RowResult],
                    partial: Mapping[int, tuple[Sequence[int], float]], passes: int = 1,
                    rationales: Mapping[int, Rationale] | None = None,
                    counts: Mapping[int, dict] | None = None) -> None:
        """After one pass: rows that finished in it (their tokens so far dropped), the tokens generated so far (and
        their summed logprob) of the rows still going, the rationales that ended in it (kept for their verdict's
        pass), the pass count; `counts`: the grammar counts so far of the structured rows still going.

        One transaction, so a crash leaves either the state before the pass or the state after it.
        """
        if passes < 0:
            raise ValueError(f"passes must be >= 0, got {passes}")
        now = timestamp()
        updates = [row_update_params(job_id, result) for result in finished]
        tokens = list(_tokens_so_far(job_id, partial, now, counts or {})) + list(_rationales(job_id, rationales or {},
                                                                                              now))
        with self._write("save generated tokens" if partial else f"save {len(updates)} answers") as conn:
            # One statement for the batch (sqlite-utils updates row by row); its row count tells a row the job lacks.
            if conn.executemany(ROW_UPDATE_SQL, updates).rowcount != len(updates):
                raise ValueError(f"job {job_id} has no rows {self._missing_rows(job_id, finished)}")
            conn.executemany("delete from partial where job_id = ? and idx = ?", [(job_id, r.idx) for r in finished])
            self.db["partial"].upsert_all(tokens, pk=("job_id", "idx"))
            mark_alive(conn, job_id, self._current_run.get(job_id), passes, now)

    def partial_tokens(self, job_id: str) -> dict[int, tuple[list[int], float]]:
        """idx -> (tokens generated so far, their summed logprob) for rows interrupted mid-generation."""
        with self._translate_errors("read generated tokens"):
            return {row["idx"]: (json.loads(row["token_ids_json"]), row["logprob"] or 0.0)
                    for row in self.db["partial"].rows_where("job_id = ? and rationale_json is null", [job_id])}

    def finished_rationales(self, job_id: str) -> dict[int, Rationale]:
        """idx -> the rationale of each row whose reasons are written and whose verdict is still to be scored."""
        with self._translate_errors("read written rationales"):
            return {row["idx"]: Rationale.from_json(json.loads(row["rationale_json"]))
                    for row in self.db["partial"].rows_where("job_id = ? and rationale_json is not null", [job_id])}

    def partial_counts(self, job_id: str) -> dict[int, dict]:
        """idx -> the grammar counts so far of structured rows interrupted mid-generation."""
        with self._translate_errors("read generated tokens"):
            return {row["idx"]: json.loads(row["grammar_json"]) for row in self.db["partial"].rows_where(
                "job_id = ? and grammar_json is not null", [job_id])}

    # ---- reading state -------------------------------------------------------------------------

    def status(self, job_id: str) -> dict:
        """jobs()'s summary plus partial progress, elapsed time, ETA and the live holder's pid."""
        with self._read(f"read job {job_id}") as conn:
            job = self._require_job(job_id)
            counts = _rows_by_state(conn, job_id)
            partial_rows, partial_token_count = conn.execute(
                "select count(*), coalesce(sum(token_count), 0) from partial where job_id = ?", (job_id,)
            ).fetchone()
            runs = list(self.db["runs"].rows_where("job_id = ?", [job_id]))
            lock, progress = self._row("locks", job_id), self._row("pass_progress", job_id)
        live_run_no = self._live_run_no(job_id, lock)
        now = utc_now()
        elapsed = sum(run_seconds(run, live=run["run_no"] == live_run_no, now=now) for run in runs)
        summary = job_summary(job, counts, live=live_run_no is not None)
        live = next((run for run in runs if run["run_no"] == live_run_no), None)
        in_pass = _in_pass(progress, live, now)
        last = max(runs, key=lambda run: run["run_no"], default=None)
        return {
            **summary,
            # rows the job has but its database lost (salvaged from damage): recorded again when it next runs
            "rows_lost": max(summary["rows_total"] - sum(counts.values()), 0),
            "partial_rows": partial_rows,
            "partial_tokens": partial_token_count,
            "elapsed_seconds": elapsed,
            # the running job's own ETA where it gave one: from the plan until its first pass ends, then its pace
            "eta_seconds": (in_pass["eta_seconds"] if in_pass and in_pass["eta_seconds"] is not None
                            else eta_seconds(summary, elapsed, live, now)),
            "in_pass": in_pass,
            "last_error": last.get("error") if last and last["end_state"] == "failed" else None,
            "running_pid": lock["pid"] if live_run_no is not None else None,
            "running_host": lock["host"] if live_run_no is not None else None,
        }

    def job_settings(self, job_id: str) -> dict:
        """The answer settings the job was recorded with (template, choices, max_new_tokens, ...)."""
        with self._read():
            return json.loads(self._require_job(job_id)["settings_json"] or "{}")

    def jobs(self) -> list[dict]:
        """One summary per job, newest first, with its last run's reason where that run failed. A job whose rows sit
        on damaged pages is listed with state 'damaged' and why, its counts None: the others list as usual."""
        with self._read() as conn:
            jobs = list(self.db["jobs"].rows_where(order_by="created_at desc, rowid desc"))
            locks = {lock["job_id"]: lock for lock in self.db["locks"].rows}
            failures = dict(conn.execute(
                "select job_id, error from runs where end_state = 'failed' and run_no = "
                "(select max(run_no) from runs last where last.job_id = runs.job_id)"))
        counts = self._row_counts([job["id"] for job in jobs])
        listed = []
        for job in jobs:
            found = counts[job["id"]]
            if isinstance(found, DatabaseDamaged):
                summary = job_summary(job, {}, live=False)
                summary.update(state="damaged", rows_done=None, rows_errored=None, rows_pending=None,
                               last_error=str(found))
            else:
                summary = job_summary(job, found, live=self._live_run_no(job["id"], locks.get(job["id"])) is not None)
                summary["last_error"] = failures.get(job["id"])
            listed.append(summary)
        return listed

    def _row_counts(self, job_ids: list[str]) -> dict[str, dict[str, int] | DatabaseDamaged]:
        """Job id -> rows by state: one scan, or where a page is damaged, job by job, so one job's damaged rows
        cost only that job its counts."""
        try:
            with self._read() as conn:
                counts: dict[str, dict[str, int]] = {job_id: {} for job_id in job_ids}
                for job_id, state, count in conn.execute(
                        "select job_id, state, count(*) from rows group by job_id, state"):
                    counts.setdefault(job_id, {})[state] = count
                return counts
        except DatabaseDamaged:
            pass
        found: dict[str, dict[str, int] | DatabaseDamaged] = {}
        for job_id in job_ids:
            try:
                with self._read(f"read job {job_id}") as conn:
                    found[job_id] = _rows_by_state(conn, job_id)
            except DatabaseDamaged as damaged:
                found[job_id] = damaged
        return found

    def job_record(self, job_id: str) -> dict:
        """The job as recorded: id, fingerprint, spec path, model, settings, creation time, and the provenance its
        output was last written with (provenance_json: model checkpoint and fingerprint, spec sha256)."""
        with self._read(f"read job {job_id}"):
            job = self._require_job(job_id)
        job["settings"] = json.loads(job.pop("settings_json") or "{}")
        job["provenance"] = json.loads(job.pop("provenance_json", None) or "{}")
        return job

    def record_provenance(self, job_id: str, values: Mapping[str, object]) -> None:
        """Merge `values` (JSON values) into what the job's outputs say of where they came from."""
        with self._write("record where the job's answers come from"):
            known = json.loads(self._require_job(job_id).get("provenance_json") or "{}")
            self.db["jobs"].update(job_id, {"provenance_json": json.dumps({**known, **values}, sort_keys=True)})

    def find_job(self, ref: str | None) -> str:
        """A job id from a full id, a unique prefix of the id or fingerprint, or None for the job run last (or
        created last, if none has run since): the one a user just resumed, not an older one created later."""
        with self._read():
            recent = list(self.db.query(
                "select id, fingerprint, spec_path, created_at, coalesce((select max(started_at) from runs "
                "where runs.job_id = jobs.id), created_at) as active_at from jobs "
                "order by max(active_at, created_at) desc, rowid desc"
            ))
        if ref is None:
            if not recent:
                raise JobNotFound(f"no jobs recorded in {self.path} yet")
            return recent[0]["id"]
        wanted = ref.strip().lower()
        matches = [job for job in recent if job["fingerprint"].lower().startswith(wanted)
                   or job["id"].lower().startswith(wanted)]
        if len(matches) == 1:
            return matches[0]["id"]
        if not matches:
            known = ", ".join(_describe_job(job) for job in recent[:10]) or "none"
            raise JobNotFound(f'no job matches "{ref}" in {self.path}; recent jobs: {known}')
        listed = ", ".join(_describe_job(job) for job in matches[:10])
        raise JobNotFound(f'job reference "{ref}" is ambiguous; it matches {len(matches)} jobs: {listed}')

    def _missing_rows(self, job_id: str, results: Sequence[RowResult]) -> list[int]:
        known = {row["idx"] for row in self.db["rows"].rows_where("job_id = ?", [job_id], select="idx")}
        return sorted({r.idx for r in results} - known)


def _pending_rows(job_id: str, rows: Sequence[tuple]) -> Iterator[dict]:
    for row in map(lambda fields: JobRow(*fields), rows):
        yield {"job_id": job_id, "idx": row.idx, "id_json": json.dumps(row.id), "row_key": row.key, "label": row.label,
               "carried_json": None if row.carried is None else json.dumps(row.carried, sort_keys=True),
               "pair_json": None if row.pair is None else json.dumps(row.pair, sort_keys=True), "state": "pending",
               # in its own key order: a schema's properties are written in theirs
               "structure_json": None if row.structure is None else json.dumps(row.structure, ensure_ascii=False)}


def _tokens_so_far(job_id: str, partial: Mapping[int, tuple[Sequence[int], float]], now: str,
                   counts: Mapping[int, dict]) -> Iterator[dict]:
    for idx, (token_ids, logprob) in partial.items():
        as_ints = [int(token) for token in token_ids]  # numpy / tensor scalars are not JSON
        yield {"job_id": job_id, "idx": idx, "token_ids_json": json.dumps(as_ints), "token_count": len(as_ints),
               "logprob": float(logprob), "updated_at": now,
               "grammar_json": json.dumps(counts[idx]) if idx in counts else None, "rationale_json": None}


def _rationales(job_id: str, rationales: Mapping[int, Rationale], now: str) -> Iterator[dict]:
    for idx, rationale in rationales.items():
        written = rationale.to_json()
        yield {"job_id": job_id, "idx": idx, "token_ids_json": json.dumps(written["token_ids"]),
               "token_count": len(rationale.token_ids), "logprob": rationale.logprob, "updated_at": now,
               "grammar_json": None, "rationale_json": json.dumps(written)}


def _rows_by_state(conn: sqlite3.Connection, job_id: str) -> dict[str, int]:
    return dict(conn.execute("select state, count(*) from rows where job_id = ? group by state", (job_id,)))


def _in_pass(progress: dict | None, live: dict | None, now: datetime) -> dict | None:
    """The live run's pass in flight as the job last told it; None without a live run, or once that pass committed
    (the run's committed passes caught up with it)."""
    if (progress is None or live is None or progress["run_no"] != live["run_no"]
            or progress["pass_no"] <= live["passes"]):
        return None
    age = max((now - datetime.fromisoformat(progress["updated_at"])).total_seconds(), 0.0)
    eta = progress["eta_seconds"]
    return {"pass": progress["pass_no"], "passes_planned": progress["passes_planned"],
            "turns_done": progress["turns_done"], "turns_total": progress["turns_total"],
            "rows_in_flight": progress["rows_in_flight"],
            "seconds_in_pass": max((now - datetime.fromisoformat(progress["started_at"])).total_seconds(), 0.0),
            "eta_seconds": None if eta is None else max(eta - age, 0.0), "told_seconds_ago": age}


def _describe_job(job: dict) -> str:
    return f"{job['id']} ({job['spec_path']}, created {job['created_at']})"
