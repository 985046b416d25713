"""A job on a two-node local Ray cluster: the answers of one machine, every row exactly once, a killed driver or a
lost node costing no published shard and at most the shard in flight."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import batchrun
from tests.distributed.conftest import write_rows
from tests.procs import batchrun_env, finish, process_state, run, start, submit_args
from tests.support import invoke

pytest.importorskip("ray")

from batchrun.distributed import RaySettings  # noqa: E402 - needs Ray
from batchrun.distributed.pool import ShardFailed  # noqa: E402

TOLERANCE = 1e-5
WAIT_S = 120.0  # only stops a hung test: each wait below ends on an event, not on time
TOPICS = ("parcel", "invoice", "meeting", "delivery", "contract", "support")


def mixed_rows(count: int, max_new_tokens: int = 8) -> list[dict]:
    """Choice rows (two or three choices) and generation rows alternating, on varied prompts."""
    rows = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2 == 0:
            choices = ["positive", "negative", "neutral"] if i % 4 == 0 else ["yes", "no"]
            rows.append({"id": f"c{i}", "prompt": f"Review {i}: the {topic} was late but fine. Happy?",
                         "choices": choices})
        else:
            rows.append({"id": f"g{i}", "prompt": f"Write a short note number {i} about the {topic}",
                         "max_new_tokens": max_new_tokens})
    return rows


def assert_same_answers(got: list[dict], want: list[dict], relative: float | None = None) -> None:
    """Every row once, in spec order, answered as on one machine: probabilities, scores and log-probabilities to
    TOLERANCE (or `relative` of their size, where larger), every other column exactly."""
    assert [row["id"] for row in got] == [row["id"] for row in want]
    for mine, theirs in zip(got, want):
        for column, expected in theirs.items():
            found = mine[column]
            if column in ("choice_probs", "calibrated_probs") and expected is not None:
                assert [choice for choice, _ in found] == [choice for choice, _ in expected], (theirs["id"], column)
                assert [p for _, p in found] == pytest.approx([p for _, p in expected], abs=TOLERANCE), theirs["id"]
            elif column in ("score", "logprob") and expected is not None:
                assert found == pytest.approx(expected, abs=TOLERANCE, rel=relative), (theirs["id"], column)
            else:
                assert found == expected, (theirs["id"], column)


def job_dir(shared: Path) -> Path:
    (folder,) = [path for path in shared.iterdir() if path.is_dir()]
    return folder


def published(shared: Path) -> set[str]:
    return {path.stem for path in shared.glob("*/results/*.json")}


def attempts(shared: Path) -> dict[str, list[dict]]:
    """Each shard's starts, in order: one record a start, naming its node and what it resumed from."""
    return {folder.name: [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
            for folder in (job_dir(shared) / "attempts").iterdir()}


def wait_for(condition, driver, what: str):
    """condition()'s first truthy value, while the driver runs."""
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        if driver.poll() is not None:
            pytest.fail(f"the driver exited ({driver.returncode}) before {what}: {driver.stderr.read()}")
        if time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"no {what} within {WAIT_S} s")
        time.sleep(0.02)
    return value


def one_machine(spec: Path, tmp_path: Path, model: Path, **settings) -> list[dict]:
    return batchrun.submit(spec, db=tmp_path / "one-machine.db", model=str(model), **settings).to_pylist()


def ray_args(spec: Path, model: Path, tmp_path: Path, cluster, *extra: str) -> list[str]:
    return submit_args(spec, model, tmp_path / "ray.db", tmp_path / "ray.parquet", "--ray", cluster.address,
                       "--shared", str(cluster.shared), *extra)


def test_a_job_on_two_nodes_answers_as_one_machine_does(start_cluster, tiny_checkpoint, tmp_path, caplog):
    cluster = start_cluster()
    model = tiny_checkpoint("llama")
    spec = write_rows(tmp_path / "jobs.jsonl", mixed_rows(200))
    want = one_machine(spec, tmp_path, model)
    settings = RaySettings(cluster.address, cluster.shared, shard_rows=25, report_every_s=0.2)
    got = batchrun.submit(spec, db=tmp_path / "ray.db", model=str(model), ray_address=settings).to_pylist()
    assert_same_answers(got, want)
    # the run says what the cluster did, the model's openings among it (docs/distributed.md), not only in --json
    said = re.search(r"8 shard\(s\) computed on (\d) node\(s\) of the Ray cluster \(.+\), the model opened (\d) time",
                     caplog.text)
    assert said and said[1] == said[2], caplog.text  # once a node: each keeps the model its first shard opened
    starts = attempts(cluster.shared)
    assert len(starts) == 8 and all(len(records) == 1 for records in starts.values())
    status = invoke("status", "--db", tmp_path / "ray.db")
    assert status.exit_code == 0, status.output
    assert "rows     200 done, 0 errored, 0 pending" in status.output
    assert f"shards   8 done, 0 running, 0 pending (Ray; shared {job_dir(cluster.shared)})" in status.output


def test_the_default_model_runs_from_its_gguf_on_every_node(start_cluster, default_by_name, tmp_path):
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL

    cluster = start_cluster()
    for home in cluster.homes.values():  # each node finds the default's GGUF in its own state directory
        (home / "models").mkdir()
        (home / "models" / DEFAULT_REGISTRY_MODEL.gguf_directory).symlink_to(default_by_name.parent.resolve(),
                                                                            target_is_directory=True)
    spec = write_rows(tmp_path / "jobs.jsonl", [row for row in mixed_rows(16) if "choices" in row])
    want = batchrun.submit(spec, db=tmp_path / "one-machine.db").to_pylist()  # no model: the default
    settings = RaySettings(cluster.address, cluster.shared, shard_rows=4, report_every_s=0.2)
    got = batchrun.submit(spec, db=tmp_path / "ray.db", ray_address=settings).to_pylist()
    # a node computes on its one thread, this process on two: a trained model's sums round otherwise, a millionth
    assert_same_answers(got, want, relative=1e-5)
    assert len(attempts(cluster.shared)) == 2
    job = json.loads(invoke("jobs", "--db", tmp_path / "ray.db", "--json").stdout)[0]
    assert job["model"] == "default (SmolLM2-135M-Instruct, Q4_1 GGUF)" and job["rows_done"] == 8


def test_a_bad_row_errors_only_its_own_row(start_cluster, tiny_checkpoint, tmp_path):
    cluster = start_cluster()
    model = tiny_checkpoint("llama")
    rows = mixed_rows(24)
    rows[5] = {"id": "bad", "prompt": 5}
    rows[10] = {"id": "long", "prompt": "word " * 400, "max_new_tokens": 4}  # longer than the 256-token context
    spec = write_rows(tmp_path / "jobs.jsonl", rows)
    want = one_machine(spec, tmp_path, model, skip_invalid=True)
    settings = RaySettings(cluster.address, cluster.shared, shard_rows=6, report_every_s=0.2)
    got = batchrun.submit(spec, db=tmp_path / "ray.db", model=str(model), ray_address=settings,
                          skip_invalid=True).to_pylist()
    assert_same_answers(got, want)
    errors = {row["id"]: row["error"] for row in got if row["error"]}
    assert set(errors) == {"bad", "long"}
    assert "prompt must be a string" in errors["bad"] and "context is 256 tokens" in errors["long"]
    plan = json.loads((job_dir(cluster.shared) / "plan.json").read_text())
    assert sum(shard["rows"] for shard in plan["shards"]) == 22  # no shard carries a row that cannot run


def test_a_shard_that_fails_on_its_node_fails_the_run_and_names_the_node(start_cluster, tiny_checkpoint, tmp_path):
    cluster = start_cluster()
    spec = write_rows(tmp_path / "jobs.jsonl", mixed_rows(8))
    settings = RaySettings(cluster.address, cluster.shared, shard_rows=4, report_every_s=0.2)
    with pytest.raises(ShardFailed, match=r"failed on node \w{8}: the plan refuses this job"):
        batchrun.submit(spec, db=tmp_path / "ray.db", model=str(tiny_checkpoint("llama")), ray_address=settings,
                        memory_gb=0.001)  # no node can hold the model in a megabyte
    status = invoke("status", "--db", tmp_path / "ray.db")
    assert "failed   ShardFailed: shard" in status.output and "0 done, 0 errored, 8 pending" in status.output


def test_a_killed_driver_reruns_without_computing_a_published_shard_again(start_cluster, tiny_checkpoint, tmp_path,
                                                                         isolated_state):
    cluster = start_cluster()
    model = tiny_checkpoint("llama")
    spec = write_rows(tmp_path / "jobs.jsonl", mixed_rows(200, max_new_tokens=24))
    want = one_machine(spec, tmp_path, model)
    args = ray_args(spec, model, tmp_path, cluster, "--shard-rows", "25", "--snapshot-every", "0.2")
    env = batchrun_env(isolated_state)
    driver = start(args, env)
    wait_for(lambda: published(cluster.shared), driver, "a published shard")
    driver.kill()  # SIGKILL: no word to the database, the shared directory or the cluster
    driver.communicate()
    before = published(cluster.shared)
    assert len(before) < 8  # the driver died with shards to go
    rerun = run(args, env)
    assert rerun.returncode == 0, rerun.describe()
    assert_same_answers(pq.read_table(tmp_path / "ray.parquet").to_pylist(), want)
    starts = attempts(cluster.shared)
    assert len(starts) == 8
    assert all(len(starts[shard]) == 1 for shard in before), {shard: starts[shard] for shard in before}
    merged_rows = sum(len(json.loads(path.read_text())["rows"])
                      for path in job_dir(cluster.shared).glob("results/*.json") if path.stem in before)
    assert rerun.summary["rows_computed_now"] <= 200 - merged_rows


def test_a_node_lost_mid_shard_costs_that_shard_alone(start_cluster, tiny_checkpoint, tmp_path, isolated_state):
    # The added node's worker freezes (SIGSTOP) at its 20th committed pass, mid-shard; the node is then removed.
    cluster = start_cluster(worker_env={"BATCHRUN_STOP_AT": "committed:20"})
    model = tiny_checkpoint("llama")
    spec = write_rows(tmp_path / "jobs.jsonl", mixed_rows(200, max_new_tokens=30))
    want = one_machine(spec, tmp_path, model)
    args = ray_args(spec, model, tmp_path, cluster, "--shard-rows", "25", "--snapshot-every", "0.02")
    driver = start(args, batchrun_env(isolated_state))
    worker_node = cluster.worker_node_id[:8]

    def frozen_shard() -> str | None:
        if not any(cluster.shared.glob("*/attempts/*")):
            return None
        for shard, records in attempts(cluster.shared).items():
            for record in records:
                if record["node"].endswith(worker_node) and process_state(record["pid"]) == "T":
                    return shard
        return None

    lost = wait_for(frozen_shard, driver, "a frozen worker")
    snapshot = job_dir(cluster.shared) / "snapshots" / f"{lost}.db"
    assert snapshot.is_file()  # copied while the shard ran
    wait_for(lambda: published(cluster.shared), driver, "a published shard")
    cluster.cluster.remove_node(cluster.worker)
    result = finish(driver, args)
    assert result.returncode == 0, result.describe()
    assert_same_answers(pq.read_table(tmp_path / "ray.parquet").to_pylist(), want)
    starts = attempts(cluster.shared)
    assert sum(len(records) - 1 for records in starts.values()) == 1  # only the lost shard started twice
    first, second = starts[lost]
    assert first["node"].endswith(worker_node) and not second["node"].endswith(worker_node)
    assert second["resumed_from"] == "snapshot" and second["rows_finished_at_start"] > 0
