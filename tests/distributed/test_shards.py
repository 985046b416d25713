"""The parts of a cluster run that need no cluster: shard specs that encode as the job's rows, shard ranges and
sizes, a shard's progress database copied and restored across nodes, the shards `status` counts, the options."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from batchrun.distributed.layout import SharedLayout, job_shards, record_shared_dir, shards_line, write_json
from batchrun.distributed.settings import default_shard_rows
from batchrun.distributed.shards import cut_shards, shard_id, shard_options, write_shard_spec
from batchrun.distributed import worker
from batchrun.distributed.worker import (ShardRefused, ShardTask, local_db_path, publish_snapshot, restore_progress,
                                         run_shard)
from batchrun.job import JobOptions, prepare_job
from batchrun.store import Store
from tests.distributed.conftest import write_rows
from tests.support import answer, invoke, make_job

FINGERPRINT = "f" * 64


def shard_keys(tmp_path, prepared):
    """The row keys of the job's rows as a worker encodes them from one shard spec holding them all."""
    spec = tmp_path / "shard.jsonl"
    write_shard_spec(spec, prepared.rows)
    on_node = prepare_job(spec, shard_options(prepared.options, prepared.compute_dtype))
    return [on_node.row_keys[position] for position in range(len(prepared.rows))]


@pytest.mark.parametrize("shape", ["requests", "corpus", "openai", "raw", "reasons", "structured"])
def test_a_shard_spec_encodes_as_the_jobs_rows(tiny_checkpoint, tmp_path, shape):
    model = str(tiny_checkpoint("llama"))
    options = JobOptions(model=model, system="Answer briefly.", stop=("\n",), max_new_tokens=5)
    if shape == "corpus":
        rows = [{"doc": 7, "text": "Great value."}, {"doc": 8, "text": "Cold soup, slow staff."}]
        options = replace(options, template="Review: {text}\nSentiment?", id_column="doc",
                          choices=("positive", "negative"))
    elif shape == "openai":
        rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "m", "max_tokens": 3, "stop": ["."],
                          "messages": [{"role": "developer", "content": "Be terse."},
                                       {"role": "user", "content": [{"type": "text", "text": "Name a fruit"}]}]}}]
    elif shape == "reasons":  # a rationale before the verdict, and an assistant message continued
        rows = [{"id": "v", "prompt": "Happy? Say why.", "choices": [" yes", " no"], "max_new_tokens": 4},
                {"id": "m", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
                 "continue_final_message": True}]
        options = replace(options, then="Verdict:")
    elif shape == "structured":  # the schema or pattern is part of a row's key: a shard row must carry it
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        rows = [{"id": "j", "prompt": "Count", "json_schema": schema}, {"id": "r", "prompt": "PIN?", "regex": "[0-9]{4}"},
                {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "Any object"}],
                          "response_format": {"type": "json_object"}}}]
    else:
        rows = [{"id": "c", "prompt": "Happy?", "choices": [" yes", " no"]},
                {"id": "g", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                         {"role": "user", "content": "Count to three"}]}]
        options = replace(options, raw=shape == "raw")
    prepared = prepare_job(write_rows(tmp_path / "jobs.jsonl", rows), options)
    assert shard_keys(tmp_path, prepared) == [prepared.row_keys[row.request.index] for row in prepared.rows]


def test_shards_are_fixed_ranges_named_by_the_job_and_the_range(tiny_checkpoint, tmp_path):
    rows = [{"id": i, "prompt": f"Note {i}", "max_new_tokens": 2} for i in range(10)]
    prepared = prepare_job(write_rows(tmp_path / "jobs.jsonl", rows), JobOptions(model=str(tiny_checkpoint("llama"))))
    kept = [row for row in prepared.rows if row.request.index not in (1, 2, 3)]  # done before, say
    shards = cut_shards(kept, prepared.row_keys, FINGERPRINT, 4)
    assert [(shard.start, shard.end, shard.indices) for shard in shards] == [(0, 4, (0,)), (4, 8, (4, 5, 6, 7)),
                                                                             (8, 12, (8, 9))]
    assert shards[1].id == shard_id(FINGERPRINT, 4, 8) == cut_shards(prepared.rows, prepared.row_keys, FINGERPRINT,
                                                                      4)[1].id
    assert shard_id(FINGERPRINT, 4, 8) != shard_id("e" * 64, 4, 8)
    assert len({shard.keys_digest for shard in shards}) == 3


def test_shard_size_takes_whole_batches_and_spreads_a_small_job_over_the_nodes():
    assert default_shard_rows(5_000_000, 64, 10) == 78_144  # 1/64 of the job, whole batches of 64
    assert default_shard_rows(200, 256, 2) == 50  # a small job: two shards a node
    assert default_shard_rows(3, 8, 4) == 1


def test_a_snapshot_restores_the_shards_progress_on_another_node(tmp_path):
    node_a, shared, node_b = tmp_path / "a" / "shard.db", tmp_path / "shared" / "shard.db", tmp_path / "b" / "shard.db"
    node_a.parent.mkdir()
    node_b.parent.mkdir()
    with Store(node_a) as store:
        job = make_job(store, 4)
        store.acquire(job)
        store.commit_pass(job, [answer(0)], {1: ([5, 6], -0.5)})
        publish_snapshot(node_a, job, shared)
        assert restore_progress(node_b, shared, job) == "snapshot"
        store.commit_pass(job, [answer(1), answer(2)], {})  # node a moved on past the snapshot
        assert restore_progress(node_a, shared, job) == "local"
    with Store(node_b) as store:
        status = store.status(job)
        assert (status["rows_done"], status["partial_tokens"]) == (1, 2)
        store.acquire(job)  # the copy holds no live lock: another host would otherwise wait hours for it
    with Store(node_a) as store:
        assert store.status(job)["rows_done"] == 3  # kept: it holds more than the snapshot


def test_status_counts_the_shards_done_running_and_pending(tmp_path):
    layout = SharedLayout.of(tmp_path / "shared", "0123456789abcdef")
    db = tmp_path / "batchrun.db"
    assert job_shards(db, "0123456789abcdef") is None
    record_shared_dir(db, "0123456789abcdef", layout, "auto")
    write_json(layout.plan, {"shards": [{"id": name, "start": 0, "end": 1, "rows": 1} for name in "abcd"]})
    write_json(layout.result("a"), {"rows": []})
    write_json(layout.progress("b"), {"updated_at": "2999-01-01T00:00:00+00:00"})
    write_json(layout.progress("c"), {"updated_at": "2001-01-01T00:00:00+00:00"})  # its worker went silent
    counts = job_shards(db, "0123456789abcdef")
    assert shards_line(counts) == f"1 done, 1 running, 2 pending (Ray; shared {layout.root})"


def test_a_model_given_as_a_relative_path_reaches_the_workers_as_an_absolute_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"GGUF")
    sent = shard_options(JobOptions(model="models/tiny.gguf"), "float32")
    assert sent.model == str(tmp_path / "models" / "tiny.gguf")
    # a name each node resolves itself (its own state directory's registry model, its hub cache) goes as it is
    for name in (None, "smollm2-135m", "gemma3-270m:converted", "org/model"):
        assert shard_options(JobOptions(model=name), "float32").model == name


def test_the_ray_options_go_together(tmp_path):
    spec = write_rows(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "Hi"}])
    alone = invoke("submit", spec, "--shared", tmp_path)
    assert alone.exit_code == 2 and "add --ray ADDRESS" in alone.output
    without = invoke("submit", spec, "--ray", "auto")
    assert without.exit_code == 2 and "--ray needs --shared DIR" in without.output


def test_the_api_asks_for_both_the_address_and_the_shared_directory(tmp_path):
    import batchrun

    with pytest.raises(TypeError, match="needs shared="):
        batchrun.submit([{"id": 1, "prompt": "Hi"}], ray_address="auto")
    with pytest.raises(TypeError, match="give ray_address too"):
        batchrun.submit([{"id": 1, "prompt": "Hi"}], shared=os.fspath(tmp_path))


def test_the_published_answers_keep_the_choices_in_order(tmp_path):
    path = write_json(tmp_path / "result.json", {"rows": [{"choice_probs": {"yes": 0.25, "no": 0.75}}]})
    assert list(json.loads(path.read_text())["rows"][0]["choice_probs"]) == ["yes", "no"]


def test_a_worker_runs_its_shard_through_the_executor_and_publishes_it_once(tiny_checkpoint, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"Note {i}", **({"choices": ["a", "b"]} if i % 2 else {"max_new_tokens": 3})}
            for i in range(6)] + [{"id": "why", "prompt": "Note 6", "choices": ["a", "b"], "then": "So:",
                                   "max_new_tokens": 3}]
    prepared = prepare_job(write_rows(tmp_path / "jobs.jsonl", rows), JobOptions(model=str(tiny_checkpoint("llama"))))
    job_id = prepared.fingerprint[:16]
    layout = SharedLayout.of(tmp_path / "shared", job_id)
    write_json(layout.manifest, {"fingerprint": prepared.fingerprint})
    (shard,) = cut_shards(prepared.rows, prepared.row_keys, prepared.fingerprint, 100)
    write_shard_spec(layout.spec(shard.id), prepared.rows)
    task = ShardTask(job_id, prepared.fingerprint, str(layout.root), shard,
                     shard_options(prepared.options, prepared.compute_dtype), snapshot_every_s=0.05,
                     report_every_s=0.05)
    outcome = run_shard(task, "node-a")
    record = json.loads(layout.result(shard.id).read_text())
    assert [row["idx"] for row in record["rows"]] == list(range(7)) and outcome.rows == 7
    assert [row["finish_reason"] == "choice" for row in record["rows"]] == [i % 2 == 1 for i in range(6)] + [True]
    assert [row["rationale"] is not None for row in record["rows"]] == [False] * 6 + [True]  # with its verdict
    assert not local_db_path(job_id, shard.id).exists()  # the node's copy goes once the answers are published
    assert run_shard(task, "node-b").already_published
    (start,) = layout.attempt_records(shard.id)
    assert (start["node"], start["resumed_from"]) == ("node-a", None)


def test_a_node_that_encodes_the_rows_otherwise_refuses_the_shard(tiny_checkpoint, tmp_path, monkeypatch):
    prepared = prepare_job(write_rows(tmp_path / "jobs.jsonl", [{"id": 1, "prompt": "Hi", "max_new_tokens": 2}]),
                           JobOptions(model=str(tiny_checkpoint("llama"))))
    layout = SharedLayout.of(tmp_path / "shared", prepared.fingerprint[:16])
    (shard,) = cut_shards(prepared.rows, prepared.row_keys, prepared.fingerprint, 10)
    write_shard_spec(layout.spec(shard.id), prepared.rows)
    task = ShardTask(prepared.fingerprint[:16], prepared.fingerprint, str(layout.root),
                     replace(shard, keys_digest="0" * 64), shard_options(prepared.options, "float32"), 1.0, 1.0)
    monkeypatch.setattr(worker, "SHARED_VISIBLE_WAIT_S", 0.1)
    with pytest.raises(ShardRefused, match="does not see the shared directory"):
        run_shard(task, "node-a")
    write_json(layout.manifest, {"fingerprint": prepared.fingerprint})
    with pytest.raises(ShardRefused, match="encode differently on node-a than on the driver"):
        run_shard(task, "node-a")
    assert not layout.result(shard.id).exists()


def test_a_worker_opens_the_model_once_for_all_its_shards(tiny_checkpoint, tmp_path, monkeypatch):
    """A Ray worker keeps the model its first shard opened (job.models): the next shard runs on it, with the same
    answers as a process that opens the model afresh."""
    from batchrun.job import keep_models_open
    from batchrun.runtime import open_model

    rows = [{"id": f"r{i}", "prompt": f"Note {i} about the order", "choices": ["yes", "no"]} for i in range(8)]
    prepared = prepare_job(write_rows(tmp_path / "jobs.jsonl", rows), JobOptions(model=str(tiny_checkpoint("llama"))))
    job_id = prepared.fingerprint[:16]
    layout = SharedLayout.of(tmp_path / "shared", job_id)
    write_json(layout.manifest, {"fingerprint": prepared.fingerprint})
    shards = cut_shards(prepared.rows, prepared.row_keys, prepared.fingerprint, 4)
    assert len(shards) == 2
    by_index = {row.request.index: row for row in prepared.rows}
    for shard in shards:
        write_shard_spec(layout.spec(shard.id), [by_index[index] for index in shard.indices])
    tasks = [ShardTask(job_id, prepared.fingerprint, str(layout.root), shard,
                       shard_options(prepared.options, prepared.compute_dtype), 60.0, 60.0) for shard in shards]
    opened = []
    real_open = open_model
    monkeypatch.setattr("batchrun.job.execute.open_model", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    monkeypatch.setattr("batchrun.job.models._kept", None)
    kept = keep_models_open()
    try:
        outcomes = [run_shard(task, "node-a") for task in tasks]
    finally:
        kept.close()
    assert [outcome.model_opened for outcome in outcomes] == [True, False] and len(opened) == 1
    kept_answers = [json.loads(layout.result(shard.id).read_text())["rows"] for shard in shards]
    for shard in shards:
        layout.result(shard.id).unlink()
    monkeypatch.setattr("batchrun.job.models._kept", None)  # a plain process: each shard opens and closes its own
    assert all(run_shard(task, "node-b").model_opened for task in tasks) and len(opened) == 3
    fresh_answers = [json.loads(layout.result(shard.id).read_text())["rows"] for shard in shards]
    assert [[(row["idx"], row["answer"], row["choice_probs"]) for row in rows] for rows in kept_answers] == [
        [(row["idx"], row["answer"], row["choice_probs"]) for row in rows] for rows in fresh_answers]


def test_a_published_rationale_is_merged_with_its_verdict(tmp_path):
    from batchrun.distributed.driver import _commit
    from batchrun.store import Rationale

    rationale = Rationale("It is short.", (5, 6, 7), -1.5, "stop")
    published = json.loads(json.dumps({"passes": 2, "rows": [
        {**vars(answer(0, "doc-0")), "rationale": rationale.to_json()}, {**vars(answer(1, "doc-1")), "rationale": None}]}))
    with Store(tmp_path / "job.db") as store:
        job_id = make_job(store, n=2)
        _commit(store, job_id, published)
        merged = store.results(job_id)
    assert merged[0].rationale == rationale and merged[1].rationale is None
