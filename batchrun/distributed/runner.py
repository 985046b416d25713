"""Where a submit runs: on this machine, or on a Ray cluster where its settings name one. The CLI and the Python API
both choose here, and check here that the cluster's settings go together. Nothing here imports Ray or torch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from batchrun.distributed.settings import RaySettings


@dataclass(frozen=True)
class RayRefusals:
    """How a surface refuses cluster settings that do not go together, in its own words: `error` is what it raises
    (a usage error on the command line, a TypeError in Python); `no_address`, a shared directory (or a shard size)
    given without a cluster's address; `no_shared`, an address without the shared directory."""
    error: type[Exception]
    no_address: str
    no_shared: str


def cluster_settings(address: str | None, shared: str | os.PathLike | None, refusals: RayRefusals,
                     **settings) -> RaySettings | None:
    """The cluster a submit runs on, None for this machine. `settings`: RaySettings' other fields (None: the
    default); a shard size, like the shared directory, means nothing without an address."""
    given = {name: value for name, value in settings.items() if value is not None}
    if address is None:
        if shared is not None or "shard_rows" in given:
            raise refusals.error(refusals.no_address)
        return None
    if shared is None:
        raise refusals.error(refusals.no_shared)
    return RaySettings(address, Path(shared), **given)


def submit_job(spec_path: str | Path, cluster: RaySettings | None, **run):
    """Run a job (batchrun.job.submit's keywords, `run`) on this machine, or on the cluster `cluster` sets; returns
    its RunSummary."""
    if cluster is None:
        from batchrun.job import submit  # the executor: torch loads here

        return submit(spec_path, **run)
    from batchrun.distributed.driver import submit_on_ray  # Ray loads here

    return submit_on_ray(spec_path, cluster, **run)
