"""The same job on a Ray cluster: the driver cuts the rows into shards, a worker on each node runs them through
batchrun's own executor (its progress database on the node's local disk), each finished shard is published once to
a directory every node sees, and the driver merges them into the job's database and writes the usual output.

Nothing here imports Ray until a job runs on a cluster (`submit_on_ray`), so `batchrun status` can show a job's
shards (`job_shards`) without it, and the CLI and the API choose where a job runs (`submit_job`) without it.
"""
from batchrun.distributed.layout import job_shards, shards_line
from batchrun.distributed.runner import RayRefusals, cluster_settings, submit_job
from batchrun.distributed.settings import RaySettings

__all__ = ["RayRefusals", "RaySettings", "cluster_settings", "job_shards", "shards_line", "submit_job",
           "submit_on_ray"]


def __getattr__(name: str):
    if name == "submit_on_ray":
        from batchrun.distributed.driver import submit_on_ray

        return submit_on_ray
    raise AttributeError(f"module 'batchrun.distributed' has no attribute {name!r}")
