"""What a run on a Ray cluster is asked with besides the job: where the cluster is, the directory every node sees, and
how the job is cut and checkpointed there."""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import SettingRefused

DEFAULT_SNAPSHOT_EVERY_S = 300.0  # a lost node costs at most this much of its shard's work
DEFAULT_REPORT_EVERY_S = 2.0  # how often a worker reports its shard's rows (the driver's bar, `status`)
DEFAULT_MAX_ATTEMPTS = 3  # starts of one shard on nodes that died under it before the job gives up
SHARDS_PER_JOB = 64  # a large job's shards: each a small share of the job, the tail at the end short
SHARDS_PER_NODE = 2  # at least this many per node, so a small job still spreads over the cluster


@dataclass(frozen=True)
class RaySettings:
    """`address`: a Ray cluster's address as `ray.init` takes it ("auto", "HOST:6379"), or "local" for a
    one-machine Ray started for the run. `shared`: a directory every node and the driver see at the
    same path (NFS, a cluster file system); answers are published there. `shard_rows`: rows per shard (default:
    from the job's size, its planned batch and the nodes). `snapshot_every_s`: how often a running shard's progress
    database is copied to `shared`. `report_every_s`: how often a worker reports its rows. `max_attempts`: how many
    times one shard may lose its node before the job fails."""

    address: str
    shared: Path
    shard_rows: int | None = None
    snapshot_every_s: float = DEFAULT_SNAPSHOT_EVERY_S
    report_every_s: float = DEFAULT_REPORT_EVERY_S
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    def __post_init__(self):
        if importlib.util.find_spec("ray") is None:
            raise SettingRefused("running on a Ray cluster needs Ray: pip install 'batchrun[ray]'")
        if not isinstance(self.address, str) or not self.address.strip():
            raise SettingRefused("ray address must be a Ray cluster address: auto, HOST:PORT or local")
        object.__setattr__(self, "shared", Path(self.shared).expanduser().absolute())
        if self.shard_rows is not None and (isinstance(self.shard_rows, bool) or not isinstance(self.shard_rows, int)
                                            or self.shard_rows < 1):
            raise SettingRefused(f"shard_rows must be a positive integer, got {self.shard_rows!r}")
        for name in ("snapshot_every_s", "report_every_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SettingRefused(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise SettingRefused(f"max_attempts must be a positive integer, got {self.max_attempts!r}")


def default_shard_rows(rows: int, batch_size: int, nodes: int) -> int:
    """Rows per shard: whole planned batches, about 1/SHARDS_PER_JOB of the job, yet small enough that every node
    gets SHARDS_PER_NODE shards. A pass in a shard holds rows of that shard only, so a shard of whole batches wastes
    no pass; the driver's plan stands in for the nodes' (each plans its own from its own memory)."""
    batch = max(1, batch_size)
    by_job = math.ceil(max(rows, 1) / SHARDS_PER_JOB / batch) * batch
    spread = math.ceil(max(rows, 1) / (SHARDS_PER_NODE * max(nodes, 1)))
    return max(1, min(by_job, spread))
