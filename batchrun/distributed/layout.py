"""The shared directory of a job run on a cluster, and the files the driver and the workers keep there.

    SHARED/JOB_ID/
      job.json                 the job's fingerprint and rows per shard (so a rerun cuts the same shards)
      plan.json                the shards of the driver's current run (for `batchrun status`)
      specs/SHARD.jsonl        a shard's rows as its worker runs them
      results/SHARD.json       a finished shard's answers, published once by rename: the exactly-once unit
      snapshots/SHARD.db       a running shard's progress database, copied every few minutes
      progress/SHARD.json      a running shard's last report: node, rows finished, when
      attempts/SHARD/*.json    one file per start of a shard: where, and what it resumed from

Every file is written to a temporary name beside it and renamed, so a reader on any node sees a whole file or none.
A worker's own progress database stays on its node's local disk (SQLite's write-ahead log needs local locking).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from batchrun.output import atomic_write

STALE_REPORT_S = 60.0  # a shard whose worker has not reported for this long is no longer counted as running


@dataclass(frozen=True)
class SharedLayout:
    root: Path  # SHARED/JOB_ID

    @classmethod
    def of(cls, shared: Path, job_id: str) -> SharedLayout:
        return cls(Path(shared) / job_id)

    @property
    def manifest(self) -> Path:
        return self.root / "job.json"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def spec(self, shard_id: str) -> Path:
        return self.root / "specs" / f"{shard_id}.jsonl"

    def result(self, shard_id: str) -> Path:
        return self.results_dir / f"{shard_id}.json"

    def snapshot(self, shard_id: str) -> Path:
        return self.root / "snapshots" / f"{shard_id}.db"

    def progress(self, shard_id: str) -> Path:
        return self.root / "progress" / f"{shard_id}.json"

    def attempts(self, shard_id: str) -> Path:
        return self.root / "attempts" / shard_id

    def published(self) -> list[str]:
        """The ids of the shards whose answers are published."""
        if not self.results_dir.is_dir():
            return []
        return sorted(path.stem for path in self.results_dir.glob("*.json"))

    def attempt_records(self, shard_id: str) -> list[dict]:
        folder = self.attempts(shard_id)
        return [read_json(path) for path in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def write_json(path: Path, value: object) -> Path:
    """`value` as JSON at `path`, written whole (temporary file, fsync, rename)."""
    data = json.dumps(value, ensure_ascii=False).encode("utf-8")  # key order kept: choice_probs lists choices in order
    return atomic_write(path, lambda temp: temp.write_bytes(data), force=True)


def read_json(path: Path):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def seconds_since(moment: str) -> float:
    return (datetime.now(timezone.utc) - datetime.fromisoformat(moment)).total_seconds()


def shard_counts(layout: SharedLayout) -> dict | None:
    """The driver's current shards as done, running (a worker reported lately) and pending; None when no run on a
    cluster has planned this job."""
    if not layout.plan.is_file():
        return None
    planned = read_json(layout.plan)["shards"]
    published = set(layout.published())
    done = running = 0
    for shard in planned:
        if shard["id"] in published:
            done += 1
            continue
        report = layout.progress(shard["id"])
        try:
            fresh = seconds_since(read_json(report)["updated_at"]) < STALE_REPORT_S
        except (OSError, ValueError, KeyError):
            fresh = False
        running += fresh
    return {"done": done, "running": running, "pending": len(planned) - done - running, "shared": str(layout.root)}


# ---- where a job's shared directory is recorded, beside the driver's database ---------------------------------


def pointer_path(db_path: Path, job_id: str) -> Path:
    """`batchrun.db` -> `batchrun.db.ray/JOB_ID.json`: which shared directory a job run on a cluster uses, so
    `batchrun status` finds its shards from the database alone."""
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".ray") / f"{job_id}.json"


def record_shared_dir(db_path: Path, job_id: str, layout: SharedLayout, address: str) -> None:
    write_json(pointer_path(db_path, job_id), {"shared": str(layout.root), "address": address})


def recorded_layout(db_path: Path, job_id: str) -> SharedLayout | None:
    path = pointer_path(db_path, job_id)
    try:
        return SharedLayout(Path(read_json(path)["shared"]))
    except (OSError, ValueError, KeyError):
        return None


def job_shards(db_path: Path, job_id: str) -> dict | None:
    """A job's shards on its cluster (done, running, pending, and the shared directory), for `batchrun status`;
    None for a job never run on one, or whose shared directory this machine does not see."""
    layout = recorded_layout(db_path, job_id)
    if layout is None:
        return None
    try:
        return shard_counts(layout)
    except (OSError, ValueError, KeyError):
        return None


def shards_line(counts: dict) -> str:
    return (f"{counts['done']} done, {counts['running']} running, {counts['pending']} pending "
            f"(Ray; shared {counts['shared']})")


def wait_for_file(path: Path, timeout_s: float, every_s: float = 0.1) -> bool:
    """Whether `path` appears within `timeout_s` (a shared file system may show a new file to other nodes late)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
