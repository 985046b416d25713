"""The Ray side: one actor per node with CPUs, each running shards one at a time, and the driver's loop that hands
them out, notices lost nodes and hands their shards to the others. The only module that imports Ray.

Plain actors rather than `Dataset.map_batches`: a shard here is a resumable job of its own (its progress database
on the node, snapshots, a report every few seconds), published by the worker itself, so the driver needs to know
each shard's fate as it happens (to merge it, to count its rows, to start it again elsewhere when its node dies).
Ray Data would recompute a lost block from its start, pack small inputs into one block, and cost its import.
"""
from __future__ import annotations

import logging
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import ray
from ray.exceptions import ActorUnschedulableError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from batchrun.errors import BatchrunError, SettingRefused
from batchrun.host import HOST
from batchrun.job import keep_models_open
from batchrun.store import JobLocked

from batchrun.distributed.settings import RaySettings
from batchrun.distributed.worker import ShardOutcome, ShardRefused, ShardTask, run_shard

log = logging.getLogger("batchrun")

LOCAL_OBJECT_STORE_BYTES = 100 << 20  # "local": shards carry no data through the object store
LOCKED_RETRY_S = 5.0  # a shard still held by a worker of a dead driver: Ray ends that worker within seconds
LOCKED_RETRIES = 60
PROBE_TIMEOUT_S = 10.0
NO_NODE_WAIT_S = 120.0  # how long the driver waits for a node with CPUs to join before it gives up
ACTOR_FAILURES_PER_NODE = 2  # a node whose workers die this often (not the node itself) gets no more


class ShardFailed(BatchrunError, RuntimeError):
    """A shard could not be run: it failed on a node, or its nodes kept dying under it."""


def connect(address: str) -> bool:
    """Connect this process to the cluster (no-op where it already is); True when this call connected it."""
    if ray.is_initialized():
        return False
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False}
    _probe(address)
    try:
        if address == "local":
            ray.init(object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False, **quiet)
        else:
            ray.init(address=address, **quiet)
    except (ConnectionError, ValueError, RuntimeError) as error:
        raise SettingRefused(f"cannot connect to the Ray cluster at {address}: {_first_line(error)} (start one with "
                             "`ray start --head`, or give --ray local)") from None
    return True


def _probe(address: str) -> None:
    """Refuse a HOST:PORT nobody listens on at once: ray.init retries such an address for minutes."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # auto or local: ray.init finds (or starts) the cluster, or says at once that there is none
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as error:
        raise SettingRefused(f"cannot connect to the Ray cluster at {address} ({error.strerror or error}); start one "
                             "with `ray start --head`, or give --ray local") from None


def disconnect() -> None:
    ray.shutdown()


def cpu_nodes() -> dict[str, int]:
    """node id -> CPUs, for the live nodes that offer CPUs (a head started with --num-cpus=0 runs no shard)."""
    return {node["NodeID"]: int(node["Resources"].get("CPU", 0)) for node in ray.nodes()
            if node.get("Alive") and node["Resources"].get("CPU", 0) >= 1}


@ray.remote(max_restarts=0, max_concurrency=1)
class ShardWorker:
    """A node's worker: shards one at a time, each a job of batchrun's own executor. Its constructor does nothing
    that can fail, so a failure reaches the driver as the shard's exception, not as a dead actor."""

    def __init__(self):
        self.node = f"{HOST}/{ray.get_runtime_context().get_node_id()[:8]}"
        keep_models_open()  # the model is opened by the first shard and kept for the next ones

    def ready(self) -> str:
        return self.node

    def run(self, task: ShardTask) -> ShardOutcome:
        return run_shard(task, self.node)


@dataclass
class _Pool:
    """The actors (one per node) and the shards in flight on them. A shard goes only to an actor that is up: one
    still waiting for its node's CPUs (held by another Ray job, or by a dead driver's worker) holds none."""
    actors: dict[str, object] = field(default_factory=dict)  # node id -> actor handle
    starting: dict[object, str] = field(default_factory=dict)  # ready() ref -> node id, for actors not up yet
    up: set[str] = field(default_factory=set)  # nodes whose actor answered ready()
    in_flight: dict[object, tuple[ShardTask, str]] = field(default_factory=dict)  # ref -> (task, node id)
    failures: dict[str, int] = field(default_factory=dict)  # node id -> workers that died on a live node
    lost: set[str] = field(default_factory=set)  # nodes that died, or whose workers keep dying

    def staff(self) -> None:
        """An actor on every live node with CPUs that has none; each takes the node's CPUs, the node being its."""
        for node_id, cpus in cpu_nodes().items():
            if node_id in self.actors or node_id in self.lost:
                continue
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            actor = ShardWorker.options(num_cpus=cpus, scheduling_strategy=strategy).remote()
            self.actors[node_id] = actor
            self.starting[actor.ready.remote()] = node_id

    def started(self, ref) -> None:
        """An actor answered ready(), or failed to start (its node went, it could not be placed)."""
        node_id = self.starting.pop(ref)
        try:
            ray.get(ref)
        except RayError:
            self.drop(node_id)
            return
        self.up.add(node_id)

    def idle(self) -> list[str]:
        busy = {node_id for _, node_id in self.in_flight.values()}
        return [node_id for node_id in self.actors if node_id in self.up and node_id not in busy]

    def start(self, task: ShardTask, node_id: str) -> None:
        self.in_flight[self.actors[node_id].run.remote(task)] = (task, node_id)

    def drop(self, node_id: str) -> None:
        """Forget a node's actor after it died; a node still alive whose workers keep dying is given up."""
        actor = self.actors.pop(node_id, None)
        self.up.discard(node_id)
        self.starting = {ref: node for ref, node in self.starting.items() if node != node_id}
        if actor is not None:
            ray.kill(actor)
        if node_id in cpu_nodes():
            self.failures[node_id] = self.failures.get(node_id, 0) + 1
            if self.failures[node_id] >= ACTOR_FAILURES_PER_NODE:
                self.lost.add(node_id)
        else:
            self.lost.add(node_id)

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()


@dataclass
class _Retries:
    """Shards to run again: each one's starts on nodes that died, and those waiting for a lock to clear."""
    max_attempts: int
    lost_starts: dict[str, int] = field(default_factory=dict)
    locked: dict[str, int] = field(default_factory=dict)
    waiting: list[tuple[float, ShardTask]] = field(default_factory=list)

    def node_lost(self, task: ShardTask, node_id: str, error: RayError) -> None:
        shard_id = task.shard.id
        self.lost_starts[shard_id] = self.lost_starts.get(shard_id, 0) + 1
        if self.lost_starts[shard_id] >= self.max_attempts:
            raise ShardFailed(f"shard {shard_id} lost its worker {self.lost_starts[shard_id]} times (last on node "
                              f"{node_id[:8]}: {_first_line(error)}); its progress is kept: run the same command "
                              "again to resume") from None
        log.warning("node %s lost shard %s (%s); it resumes on another node", node_id[:8], shard_id,
                    _first_line(error))

    def held_elsewhere(self, task: ShardTask) -> None:
        shard_id = task.shard.id
        self.locked[shard_id] = self.locked.get(shard_id, 0) + 1
        if self.locked[shard_id] > LOCKED_RETRIES:
            raise ShardFailed(f"shard {shard_id} stays locked by another process on its node") from None
        self.waiting.append((time.monotonic() + LOCKED_RETRY_S, task))

    def due(self) -> list[ShardTask]:
        now = time.monotonic()
        ready = [task for at, task in self.waiting if at <= now]
        self.waiting = [(at, task) for at, task in self.waiting if at > now]
        return ready


def run_shards(tasks: list[ShardTask], settings: RaySettings,
               on_done: Callable[[ShardTask, ShardOutcome], None], on_tick: Callable[[list[ShardTask]], None]) -> None:
    """Run every task to its end on the cluster, one shard per node at a time: `on_done` as each one is published,
    `on_tick(shards in flight)` between. A shard whose node dies starts again on another node (from its snapshot);
    a failure inside a shard fails the run, as it would fail a run on one machine."""
    pool, retries = _Pool(), _Retries(settings.max_attempts)
    queue = deque(tasks)
    waited_since = None
    tick = min(settings.report_every_s, 1.0)
    try:
        while queue or pool.in_flight or retries.waiting:
            queue.extend(retries.due())
            pool.staff()
            for node_id in pool.idle():
                if not queue:
                    break
                pool.start(queue.popleft(), node_id)
            if not pool.actors:
                waited_since = waited_since or time.monotonic()
                if time.monotonic() - waited_since > NO_NODE_WAIT_S:
                    raise ShardFailed(f"no node of the cluster offers CPUs to run shards on (waited "
                                      f"{NO_NODE_WAIT_S:.0f} s); {len(queue)} shard(s) are left")
            else:
                waited_since = None
            waiting = [*pool.in_flight, *pool.starting]
            ready = ray.wait(waiting, num_returns=1, timeout=tick)[0] if waiting else []
            if not waiting:
                time.sleep(tick)
            for ref in ready:
                if ref in pool.starting:
                    pool.started(ref)
                    continue
                task, node_id = pool.in_flight.pop(ref)
                _settle(ref, task, node_id, pool, retries, queue, on_done)
            on_tick([task for task, _ in pool.in_flight.values()])
    finally:
        pool.close()


def _settle(ref, task: ShardTask, node_id: str, pool: _Pool, retries: _Retries, queue: deque,
            on_done: Callable[[ShardTask, ShardOutcome], None]) -> None:
    """One shard's end: published, its node lost (started again elsewhere), or failed."""
    try:
        outcome = ray.get(ref)
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, JobLocked):
            retries.held_elsewhere(task)
            return
        if isinstance(cause, ShardRefused):  # it names the node already
            raise cause from None
        what = str(cause) if isinstance(cause, BatchrunError) else f"{type(cause).__name__}: {cause}"
        raise ShardFailed(f"shard {task.shard.id} failed on node {node_id[:8]}: {what}") from None
    except ActorUnschedulableError:  # the node went before the actor started: nothing of the shard ran
        pool.drop(node_id)
        queue.appendleft(task)
        return
    except (RayActorError, RayError) as error:
        pool.drop(node_id)
        retries.node_lost(task, node_id, error)
        queue.appendleft(task)
        return
    on_done(task, outcome)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
