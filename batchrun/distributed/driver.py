"""The driver of a job run on a Ray cluster.

The run is batchrun's own (batchrun.job.submit): the spec read and encoded once (the tokenizer only: no weight is
read here), the job recorded and locked in the driver's progress database, answers reused, its end recorded, the
output and the report written. The driver supplies only where the rows still pending are computed: it cuts them
into shards and runs them on the cluster's nodes, and as each shard's answers are published to the shared directory
it merges them into its database.

Rerun after a crash, the driver first merges every shard published meanwhile, so no published shard is computed
again, and cuts the same shards as before: a shard that was running resumes on its node, or from its snapshot.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from batchrun.job import Computation, JobRun, PreparedJob, RunSummary, plan_rows
from batchrun.spec import EncodedRow
from batchrun.store import Rationale, RowResult, Store, StoreError

from batchrun.distributed import pool
from batchrun.distributed.layout import SharedLayout, now_iso, read_json, record_shared_dir, write_json
from batchrun.distributed.settings import RaySettings, default_shard_rows
from batchrun.distributed.shards import Shard, cut_shards, range_rows, shard_options, write_shard_spec
from batchrun.distributed.worker import ShardOutcome, ShardTask

log = logging.getLogger("batchrun")


@dataclass
class _ClusterWork:
    """What the cluster did for one job's run: shards, rows and passes computed now, and shards published before."""
    shards: int = 0
    published_before: int = 0
    rows: int = 0
    passes: int = 0
    nodes: set[str] = field(default_factory=set)
    modes: set[str] = field(default_factory=set)
    models_opened: int = 0  # by the shards: once per worker while its shards ask for the model the same way


def submit_on_ray(spec_path: str | Path, cluster: RaySettings, **run) -> RunSummary:
    """`batchrun.job.submit` (with its keywords, `run`) with the rows computed on a Ray cluster: the same job, the
    same answers, the same output and database records; returns its RunSummary with this run's work on the cluster."""
    from batchrun.job import submit

    started = time.monotonic()
    on_cluster = _OnCluster(cluster)
    summary = submit(spec_path, elsewhere=on_cluster, **run)
    work = on_cluster.work.get(summary.job_id, _ClusterWork())
    note = (f"{work.shards} shard(s) computed on {len(work.nodes)} node(s) of the Ray cluster ({cluster.address}), "
            f"the model opened {work.models_opened} time(s)"
            + (f"; {work.published_before} published before this run were merged" if work.published_before else ""))
    log.warning(note)  # said as the executor's notes are, not left to --json's summary alone
    return replace(summary, seconds=time.monotonic() - started, notes=[note, *summary.notes])


class _OnCluster(Computation):
    """The job's pending rows computed on the cluster, shard by shard, each merged into the driver's database as it
    is published; `work`: what the cluster did for each job this driver ran (a content-free calibration's side job
    runs here too)."""

    def __init__(self, cluster: RaySettings):
        self.cluster = cluster
        self.work: dict[str, _ClusterWork] = {}

    @contextlib.contextmanager
    def connected(self) -> Iterator[None]:
        connected = pool.connect(self.cluster.address)
        try:
            yield
        finally:
            if connected:
                pool.disconnect()

    def merge_earlier(self, run: JobRun) -> None:
        layout = SharedLayout.of(self.cluster.shared, run.job_id)
        record_shared_dir(run.store.path, run.job_id, layout, self.cluster.address)
        merged = _merge_published(run.store, run.job_id, layout, run.prepared.fingerprint)
        self.work[run.job_id] = _ClusterWork(published_before=merged)

    def compute(self, run: JobRun, rows: list[EncodedRow], partial: dict) -> None:
        prepared, cluster = run.prepared, self.cluster
        plan = plan_rows(prepared.model, rows, prepared.options, prepared.device, held=prepared.rows)
        if run.on_plan is not None:
            run.on_plan(plan)
        layout = SharedLayout.of(cluster.shared, run.job_id)
        width = _range_width(layout, prepared, cluster, len(rows), plan.batching.batch_size)
        shards = cut_shards(rows, prepared.row_keys, prepared.fingerprint, width)
        _write_shards(layout, shards, rows)
        log.info("%d shard(s) of up to %d rows; each node plans its own batches from its own memory", len(shards),
                 width)
        work = self.work[run.job_id]
        _run_on_cluster(run, layout, cluster, shards, work)
        pending = set(run.store.pending_indices(run.job_id))
        left = [row.request.index for row in rows if row.request.index in pending]
        if left:
            raise pool.ShardFailed(f"{len(left)} row(s) of job {run.job_id} have no answer after every shard was "
                                   f"merged (the first: row {left[0] + 1}); run the same command again")
        run.summary.rows_computed_now, run.summary.passes_now = work.rows, work.passes
        run.summary.mode = "/".join(sorted(work.modes)) or None


def _run_on_cluster(run: JobRun, layout: SharedLayout, cluster: RaySettings, shards: list[Shard],
                    work: _ClusterWork) -> None:
    """Run the shards, merging each as it is published; the bar counts the rows merged and those the workers report
    finished in the shards they run."""
    prepared, store, job_id = run.prepared, run.store, run.job_id
    options = shard_options(prepared.options, prepared.compute_dtype)
    tasks = [ShardTask(job_id, prepared.fingerprint, str(layout.root), shard, options, cluster.snapshot_every_s,
                       cluster.report_every_s) for shard in shards]
    status = store.status(job_id)
    finished_before = status["rows_done"] + status["rows_errored"]
    bar = tqdm(total=status["rows_total"], initial=finished_before, unit="row", disable=run.quiet, dynamic_ncols=True,
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
    store.commit_batch(job_id, [RowResult(**{**row, "rationale": row.get("rationale") and Rationale.from_json(
        row["rationale"])}) for row in record["rows"]], passes=int(record["passes"]))


def _reported_rows(layout: SharedLayout, shard_id: str) -> int:
    try:
        return int(read_json(layout.progress(shard_id)).get("finished", 0))
    except (OSError, ValueError):
        return 0
