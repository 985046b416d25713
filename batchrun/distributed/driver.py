"""The driver of a job run on a Ray cluster.

It reads, checks, encodes and plans the spec as `batchrun submit` does (the tokenizer only: no weight is read
here), records the job in its own progress database, cuts the rows still to compute into shards and runs them on
the cluster's nodes. As each shard's answers are published to the shared directory the driver merges them into its
database; once every row is in, batchrun's own executor finishes the job there exactly as on one machine (repeated
rows, calibration, accuracy, the output file and the report), computing nothing.

Rerun after a crash, the driver first merges every shard published meanwhile, so no published shard is computed
again, and cuts the same shards as before: a shard that was running resumes on its node, or from its snapshot.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from batchrun.checkpoint import progress_bars
from batchrun.errors import OutputRefused, PlanRefused
from batchrun.host import default_db_path, failure_reason, stops_deferred
from batchrun.job import (JobOptions, PreparedJob, calibration_settings, nothing_runs, one_row_per_key, plan_rows,
                          prepare_job)
from batchrun.output import check_output_writable, default_output_path, output_format
from batchrun.plan import Candidate
from batchrun.spec import EncodedRow
from batchrun.store import JobRow, RowResult, Store, StoreError

from batchrun.distributed import pool
from batchrun.distributed.layout import SharedLayout, now_iso, read_json, record_shared_dir, write_json
from batchrun.distributed.settings import RaySettings, default_shard_rows
from batchrun.distributed.shards import Shard, cut_shards, range_rows, shard_options, write_shard_spec
from batchrun.distributed.worker import ShardOutcome, ShardTask

log = logging.getLogger("batchrun")


@dataclass
class _ClusterWork:
    """What the cluster did for this run: shards, rows and passes computed now, and shards published before."""
    shards: int = 0
    published_before: int = 0
    rows: int = 0
    passes: int = 0
    nodes: set[str] = field(default_factory=set)
    modes: set[str] = field(default_factory=set)
    models_opened: int = 0  # by the shards: once per worker while its shards ask for the model the same way


def submit_on_ray(spec_path: str | Path, options: JobOptions | None, cluster: RaySettings, *,
                  output: str | Path | None = None, db: str | Path | None = None, force: bool = False,
                  quiet: bool = True, on_plan: Callable[[Candidate], None] | None = None, write_output: bool = True):
    """`batchrun.job.submit` with the rows computed on a Ray cluster: the same job, the same answers, the same
    output and database records; returns the executor's RunSummary with this run's work on the cluster."""
    from batchrun.job import submit as run_job

    options = options or JobOptions()
    spec_path = Path(spec_path)
    output_path = (Path(output) if output else default_output_path(spec_path)) if write_output else None
    db_path = Path(db) if db else default_db_path()
    if output_path is not None:
        check_output_writable(output_path, spec_path, db_path)  # before the night's work, not after
        output_format(output_path)
        if output_path.exists() and not force:
            raise OutputRefused(f"{output_path} exists; pass --force to overwrite it, or -o another file")
    started = time.monotonic()
    connected = pool.connect(cluster.address)
    try:
        work = _compute_on_cluster(spec_path, options, cluster, db_path, quiet=quiet, on_plan=on_plan)
        summary = run_job(spec_path, options=options, output=output_path, db=db_path, force=force, quiet=True,
                          write_output=write_output)
    finally:
        if connected:
            pool.disconnect()
    note = (f"{work.shards} shard(s) computed on {len(work.nodes)} node(s) of the Ray cluster "
            f"({cluster.address}), the model opened {work.models_opened} time(s)" + (f"; {work.published_before} published before this run were merged"
                                      if work.published_before else ""))
    modes = "/".join(sorted(work.modes)) or summary.mode
    return replace(summary, rows_computed_now=work.rows, passes_now=work.passes, mode=modes,
                   seconds=time.monotonic() - started, notes=[note, *summary.notes])


def _compute_on_cluster(spec_path: Path, options: JobOptions, cluster: RaySettings, db_path: Path, *,
                        quiet: bool, on_plan: Callable[[Candidate], None] | None) -> _ClusterWork:
    """Every row of the job answered in the driver's database, computed on the cluster; the job's lock held
    meanwhile, so `batchrun status` shows it running and a second driver is refused."""
    with progress_bars(shown=not quiet):  # a model got for the first time converts or downloads here
        prepared = prepare_job(spec_path, options)
    with Store(db_path) as store:
        calibration = calibration_settings(prepared, lambda path, side: submit_on_ray(
            path, side, cluster, db=db_path, write_output=False).job_id)
        job_id = store.ensure_job(prepared.fingerprint, spec_path=str(spec_path.resolve()), model=prepared.model.name,
                                  settings={**prepared.options.answer_settings(), **calibration},
                                  rows=_job_rows(prepared))
        layout = SharedLayout.of(cluster.shared, job_id)
        record_shared_dir(db_path, job_id, layout, cluster.address)
        store.acquire(job_id)
        state, error = "failed", None
        try:
            with store.heartbeat_while_running(job_id):
                work = _run_shards(prepared, store, job_id, layout, cluster, quiet=quiet, on_plan=on_plan)
            state = "done"
            return work
        except KeyboardInterrupt:
            state = "interrupted"
            raise
        except Exception as failure:  # recorded for `status` (an unforeseen one with its traceback's log), then raised
            error = failure_reason(failure, [options.hf_token])
            raise
        finally:
            _release(store, job_id, state, error)


def _run_shards(prepared: PreparedJob, store: Store, job_id: str, layout: SharedLayout, cluster: RaySettings, *,
                quiet: bool, on_plan: Callable[[Candidate], None] | None) -> _ClusterWork:
    work = _ClusterWork(published_before=_merge_published(store, job_id, layout, prepared.fingerprint))
    store.reuse_answers(job_id)
    store.fill_duplicates(job_id)
    pending = set(store.pending_indices(job_id))
    refusal = nothing_runs(prepared.rows, len(prepared.spec.invalid))
    if refusal:
        raise PlanRefused(refusal)
    runnable = [row for row in prepared.rows if row.request.index in pending and not row.error]
    rows = one_row_per_key(runnable, prepared.row_keys)
    if rows:
        plan = plan_rows(prepared.model, rows, prepared.options, prepared.device, held=prepared.rows)
        if on_plan is not None:
            on_plan(plan)
        width = _range_width(layout, prepared, cluster, len(rows), plan.batch_size)
        shards = cut_shards(rows, prepared.row_keys, prepared.fingerprint, width)
        _write_shards(layout, shards, rows)
        log.info("%d shard(s) of up to %d rows; each node plans its own batches from its own memory", len(shards),
                 width)
        _run_on_cluster(prepared, store, job_id, layout, cluster, shards, work, quiet)
    store.fill_duplicates(job_id)
    # Rows that cannot run (invalid, too long, refused by the chat template) are answered with their error by the
    # executor's finishing run, as on one machine: no shard carries them.
    unrunnable = ({bad.index for bad in prepared.spec.invalid}
                  | {row.request.index for row in prepared.rows if row.error})
    left = [index for index in store.pending_indices(job_id) if index not in unrunnable]
    if left:
        raise pool.ShardFailed(f"{len(left)} row(s) of job {job_id} have no answer after every shard was merged "
                               f"(the first: row {left[0] + 1}); run the same command again")
    return work


def _run_on_cluster(prepared: PreparedJob, store: Store, job_id: str, layout: SharedLayout, cluster: RaySettings,
                    shards: list[Shard], work: _ClusterWork, quiet: bool) -> None:
    """Run the shards, merging each as it is published; the bar counts the rows merged and those the workers report
    finished in the shards they run."""
    options = shard_options(prepared.options, prepared.compute_dtype)
    tasks = [ShardTask(job_id, prepared.fingerprint, str(layout.root), shard, options, cluster.snapshot_every_s,
                       cluster.report_every_s) for shard in shards]
    status = store.status(job_id)
    finished_before = status["rows_done"] + status["rows_errored"]
    bar = tqdm(total=status["rows_total"], initial=finished_before, unit="row", disable=quiet, dynamic_ncols=True,
               desc=f"batchrun {job_id[:8]} (ray)")

    def done(task: ShardTask, outcome: ShardOutcome) -> None:
        rows, passes = _merge(store, job_id, layout, prepared.fingerprint, task.shard.id)
        work.shards += 1
        work.rows += rows
        work.passes += outcome.passes if not outcome.already_published else passes
        work.nodes.add(outcome.node)
        work.models_opened += outcome.model_opened
        if outcome.mode:
            work.modes.add(outcome.mode)

    def tick(running: list[ShardTask]) -> None:
        bar.n = finished_before + work.rows + sum(_reported_rows(layout, task.shard.id) for task in running)
        bar.refresh()

    try:
        pool.run_shards(tasks, cluster, on_done=done, on_tick=tick)
        tick([])
    finally:
        bar.close()


def _range_width(layout: SharedLayout, prepared: PreparedJob, cluster: RaySettings, computed: int,
                 batch_size: int) -> int:
    """The width of a shard's range of rows: the one this job's shards were first cut with (a rerun cuts the same
    shards, so a running shard's progress is found again), unless --shard-rows asks for another size."""
    manifest = read_json(layout.manifest) if layout.manifest.is_file() else None
    if manifest is not None and manifest.get("fingerprint") != prepared.fingerprint:
        raise StoreError(f"{layout.manifest} belongs to another job ({manifest.get('fingerprint')}); the shared "
                         "directory holds one folder per job id: move that folder away")
    if manifest is not None and cluster.shard_rows in (None, manifest.get("shard_rows")):
        return int(manifest["range_rows"])
    shard_rows = cluster.shard_rows or default_shard_rows(computed, batch_size, len(pool.cpu_nodes()))
    width = range_rows(shard_rows, computed, prepared.spec.total_rows)
    write_json(layout.manifest, {"fingerprint": prepared.fingerprint, "shard_rows": shard_rows, "range_rows": width,
                                 "rows": prepared.spec.total_rows, "written_at": now_iso()})
    return width


def _write_shards(layout: SharedLayout, shards: list[Shard], rows: list[EncodedRow]) -> None:
    by_index = {row.request.index: row for row in rows}
    for shard in shards:
        write_shard_spec(layout.spec(shard.id), [by_index[index] for index in shard.indices])
    write_json(layout.plan, {"shards": [shard.to_json() for shard in shards], "written_at": now_iso()})


def _merge_published(store: Store, job_id: str, layout: SharedLayout, fingerprint: str) -> int:
    """Merge the shards published since the job's last merge (a driver that crashed, or finished computing but not
    merging); returns how many. A shard already merged is left alone: its passes are counted once."""
    pending = set(store.pending_indices(job_id))
    merged = 0
    for shard_id in layout.published():
        record = _published(layout, fingerprint, shard_id)
        if any(row["idx"] in pending for row in record["rows"]):
            _commit(store, job_id, record)
            merged += 1
    return merged


def _merge(store: Store, job_id: str, layout: SharedLayout, fingerprint: str, shard_id: str) -> tuple[int, int]:
    """One published shard's answers into the job's rows; (rows, passes the shard took)."""
    record = _published(layout, fingerprint, shard_id)
    _commit(store, job_id, record)
    return len(record["rows"]), int(record["passes"])


def _published(layout: SharedLayout, fingerprint: str, shard_id: str) -> dict:
    record = read_json(layout.result(shard_id))
    if record.get("fingerprint") != fingerprint:
        raise StoreError(f"{layout.result(shard_id)} holds answers of another job")
    return record


def _commit(store: Store, job_id: str, record: dict) -> None:
    store.commit_batch(job_id, [RowResult(**row) for row in record["rows"]], passes=int(record["passes"]))


def _reported_rows(layout: SharedLayout, shard_id: str) -> int:
    try:
        return int(read_json(layout.progress(shard_id)).get("finished", 0))
    except (OSError, ValueError):
        return 0


def _job_rows(prepared: PreparedJob) -> list[JobRow]:
    """The job's rows as the executor records them: each valid row with its key, label and carried values, and each
    invalid one named by its id or location."""
    rows = [JobRow(row.request.index, row.request.id, prepared.row_keys[row.request.index], row.request.label,
                   row.request.carried) for row in prepared.rows]
    rows += [JobRow(bad.index, bad.output_id, carried=bad.carried) for bad in prepared.spec.invalid]
    return sorted(rows, key=lambda row: row.idx)


def _release(store: Store, job_id: str, state: str, error: str | None) -> None:
    """As the executor releases a job: a release failing after a failed run must not hide the first error."""
    try:
        with stops_deferred():
            store.release(job_id, state, error)
    except StoreError:
        if state == "done":
            raise
        log.warning("could not release job %s after the run failed; the next run will take its lock over", job_id)
