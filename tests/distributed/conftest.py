"""A local Ray cluster for the distributed tests: a head and one added node, each with one CPU, a small object store,
no dashboard, and its own BATCHRUN_HOME (the node's local disk: its shards' progress databases), seeded with the
session's measurements. Each test starts its own and shuts down only that one."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

OBJECT_STORE_BYTES = 80 << 20


@dataclass
class LocalCluster:
    cluster: object  # ray.cluster_utils.Cluster
    worker: object  # the added node (ray._private.node.Node)
    homes: dict[str, Path]  # node name -> its BATCHRUN_HOME
    shared: Path  # the directory every node sees

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def worker_node_id(self) -> str:
        return self.worker.node_id


def _node_home(root: Path, name: str, measurements: Path) -> Path:
    home = root / f"node-{name}"
    home.mkdir(parents=True)
    shutil.copy(measurements, home / measurements.name)
    return home


@pytest.fixture
def start_cluster(tmp_path, machine_measurements):
    """start_cluster(worker_env={}) -> LocalCluster: a head and one added node, `worker_env` set on the added node's
    processes only. Shut down when the test ends, with this process's connection to it."""
    import ray
    from ray.cluster_utils import Cluster

    started = []

    def start(worker_env: dict[str, str] | None = None) -> LocalCluster:
        homes = {name: _node_home(tmp_path, name, machine_measurements) for name in ("head", "worker")}
        node_args = {"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES}
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False,
                                                                 "env_vars": {"BATCHRUN_HOME": str(homes["head"])}})
        started.append(cluster)
        worker = cluster.add_node(**node_args, env_vars={"BATCHRUN_HOME": str(homes["worker"]), **(worker_env or {})})
        shared = tmp_path / "shared"
        shared.mkdir()
        return LocalCluster(cluster, worker, homes, shared)

    try:
        yield start
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for cluster in started:
            cluster.shutdown()


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path
