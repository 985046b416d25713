"""One shard on one node: batchrun's own executor on the shard's spec, its progress database on the node's local
disk, its progress reported and its database copied to the shared directory as it runs, its answers published
there once it ends. Plain Python (the Ray actor that calls it is in pool.py).

A shard resumes from whichever holds more of its progress: this node's database (a restarted worker) or the last
snapshot another node published (a node that died). Either way the executor resumes as after any crash: finished
answers kept, generated tokens restored with one prefill pass.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import BatchrunError
from batchrun.host import HOST, state_dir
from batchrun.job import JobOptions, RunSetup, prepare_job
from batchrun.output import atomic_write
from batchrun.store import JobNotFound, Store, StoreError

from batchrun.distributed.layout import SharedLayout, now_iso, read_json, wait_for_file, write_json
from batchrun.distributed.shards import Shard, keys_digest

LOCAL_DIR = "ray-shards"  # under each node's state directory: the shards' progress databases
SHARED_VISIBLE_WAIT_S = 30.0  # a network file system may show the driver's new files to other nodes late
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


class ShardRefused(BatchrunError, RuntimeError):
    """A node cannot run a shard as the driver planned it: it does not see the shared directory, or the shard's rows
    encode differently there (another checkpoint, tokenizer, batchrun or dtype)."""


@dataclass(frozen=True)
class ShardTask:
    """What a worker is sent for one shard: small, so the object store carries almost nothing."""
    job_id: str
    fingerprint: str
    shared_root: str  # SHARED/JOB_ID
    shard: Shard
    options: JobOptions
    snapshot_every_s: float
    report_every_s: float


@dataclass
class ShardOutcome:
    shard_id: str
    rows: int
    node: str
    passes: int = 0
    seconds: float = 0.0
    mode: str | None = None
    resumed_from: str | None = None  # "local", "snapshot", or None for a start from nothing
    already_published: bool = False
    model_opened: bool = False  # the shard opened the model; False: it ran on the one its worker kept open


def local_db_path(job_id: str, shard_id: str) -> Path:
    return state_dir() / LOCAL_DIR / job_id / f"{shard_id}.db"


def run_shard(task: ShardTask, node: str) -> ShardOutcome:
    """Run (or resume) one shard to its end and publish its answers; `node` names this node in reports."""
    from batchrun.job import run_prepared  # the executor: torch loads here

    layout = SharedLayout(Path(task.shared_root))
    _check_shared_dir(layout, task.fingerprint, node)
    shard = task.shard
    if layout.result(shard.id).exists():
        return ShardOutcome(shard.id, len(shard.indices), node, already_published=True)
    spec = layout.spec(shard.id)
    prepared = prepare_job(spec, task.options)
    found = keys_digest([prepared.row_keys[index] for index in range(len(shard.indices))])
    if found != shard.keys_digest:
        raise ShardRefused(f"shard {shard.id}'s rows encode differently on {node} than on the driver: run the same "
                           "checkpoint, batchrun and transformers versions on every node")
    shard_job = prepared.fingerprint[:16]
    db_path = local_db_path(task.job_id, shard.id)
    db_path.parent.mkdir(parents=True, exist_ok=True)
    resumed_from = restore_progress(db_path, layout.snapshot(shard.id), shard_job)
    write_json(layout.attempts(shard.id) / f"{time.time_ns()}-{HOST}-{os.getpid()}.json",
               {"node": node, "host": HOST, "pid": os.getpid(), "started_at": now_iso(),
                "resumed_from": resumed_from, "rows_finished_at_start": _progress(db_path, shard_job)[0]})
    started = time.monotonic()
    monitor = _Monitor(task, node, db_path, shard_job)
    with monitor:
        summary = run_prepared(prepared, RunSetup(db_path))
    _publish(layout, task, db_path, shard_job, node)
    _remove_database(db_path)
    layout.snapshot(shard.id).unlink(missing_ok=True)
    return ShardOutcome(shard.id, len(shard.indices), node, summary.passes_now, time.monotonic() - started,
                        summary.mode, resumed_from, model_opened=bool(summary.passes_now) and not summary.model_reused)


def _check_shared_dir(layout: SharedLayout, fingerprint: str, node: str) -> None:
    if not wait_for_file(layout.manifest, SHARED_VISIBLE_WAIT_S):
        raise ShardRefused(f"{node} does not see the shared directory {layout.root.parent} (no {layout.manifest}): "
                           "--shared must be one directory every node mounts at the same path")
    if read_json(layout.manifest).get("fingerprint") != fingerprint:
        raise ShardRefused(f"{layout.manifest} belongs to another job")


def _publish(layout: SharedLayout, task: ShardTask, db_path: Path, shard_job: str, node: str) -> None:
    """The shard's answers to the shared directory, by rename: a shard computed twice is published once, whole.
    Each row is named by its place in the whole job (its id in the shard's spec)."""
    with Store(db_path) as store:
        results = store.results(shard_job)
        passes = store.status(shard_job)["passes"]
    rows = [{**{name: value for name, value in vars(result).items() if name not in ("label", "carried")},
             "idx": result.id,  # the shard's row ids are their places in the job
             "rationale": result.rationale and result.rationale.to_json()} for result in results]
    if len(rows) != len(task.shard.indices):
        raise RuntimeError(f"shard {task.shard.id} ended with {len(rows)} of its {len(task.shard.indices)} rows")
    write_json(layout.result(task.shard.id),
               {"fingerprint": task.fingerprint, "shard": task.shard.id, "node": node, "passes": passes,
                "published_at": now_iso(), "rows": rows})
    write_json(layout.progress(task.shard.id), {"node": node, "host": HOST, "pid": os.getpid(), "rows": len(rows),
                                                 "finished": len(rows), "updated_at": now_iso(), "published": True})


def _progress(db_path: Path, shard_job: str) -> tuple[int, int]:
    """(rows finished, tokens generated for unfinished rows) of the shard's job in a database; (0, 0) where none."""
    if not db_path.exists():
        return 0, 0
    try:
        with Store(db_path) as store:
            status = store.status(shard_job)
    except JobNotFound:
        return 0, 0
    return status["rows_done"] + status["rows_errored"], status["partial_tokens"]


def restore_progress(db_path: Path, snapshot: Path, shard_job: str) -> str | None:
    """Make `db_path` the shard's most advanced progress database: this node's own, or the published snapshot.
    Returns where the shard resumes from ("local", "snapshot"), None when from nothing."""
    local = _progress(db_path, shard_job)
    if snapshot.is_file():
        copy = db_path.with_name(f".{db_path.name}.restoring")
        _remove_database(copy)
        shutil.copyfile(snapshot, copy)
        if _progress(copy, shard_job) > local:
            _remove_database(db_path)  # its log must not be replayed into the snapshot
            os.replace(copy, db_path)
            return "snapshot"
        _remove_database(copy)
    return "local" if local > (0, 0) else None


def _remove_database(path: Path) -> None:
    for suffix in SQLITE_SIDE_FILES:
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    path.unlink(missing_ok=True)


def publish_snapshot(db_path: Path, shard_job: str, target: Path) -> None:
    """A consistent copy of the live database (SQLite's backup, between the executor's commits), its lock released
    (the copy resumes on another host, where this process's lock would count as live for hours), published whole."""
    copy = db_path.with_name(f".{db_path.name}.snapshot")
    _remove_database(copy)
    source, destination = sqlite3.connect(str(db_path), timeout=30.0), sqlite3.connect(str(copy))
    try:
        source.backup(destination)
    finally:
        destination.close()
        source.close()
    try:
        with Store(copy) as store:
            store.release(shard_job, "interrupted")
        atomic_write(target, lambda temp: shutil.copyfile(copy, temp), force=True)
    finally:
        _remove_database(copy)


class _Monitor:
    """While the executor runs: every report_every_s the shard's rows finished to the shared directory (the driver's
    bar, `batchrun status`), and every snapshot_every_s, where it moved on, a snapshot of its database."""

    def __init__(self, task: ShardTask, node: str, db_path: Path, shard_job: str):
        self.task, self.node, self.db_path, self.shard_job = task, node, db_path, shard_job
        self.layout = SharedLayout(Path(task.shared_root))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="batchrun-shard-monitor", daemon=True)

    def __enter__(self) -> _Monitor:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        task = self.task
        now = time.monotonic()
        report_due, snapshot_due = now + task.report_every_s, now + task.snapshot_every_s
        snapshotted = _progress(self.db_path, self.shard_job)
        while not self._stop.wait(max(0.0, min(report_due, snapshot_due) - time.monotonic())):
            try:
                progress = _progress(self.db_path, self.shard_job)
                if time.monotonic() >= report_due:
                    report_due = time.monotonic() + task.report_every_s
                    write_json(self.layout.progress(task.shard.id),
                               {"node": self.node, "host": HOST, "pid": os.getpid(), "rows": len(task.shard.indices),
                                "finished": progress[0], "updated_at": now_iso()})
                if time.monotonic() >= snapshot_due:
                    snapshot_due = time.monotonic() + task.snapshot_every_s
                    if progress != snapshotted:
                        publish_snapshot(self.db_path, self.shard_job, self.layout.snapshot(task.shard.id))
                        snapshotted = progress
            except (OSError, sqlite3.Error, StoreError, BatchrunError):
                continue  # a report or snapshot missed costs nothing the next one does not make up
