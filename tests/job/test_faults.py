"""`batchrun submit` killed at any moment, or by the kernel for lack of memory, resumes to the same answers.

Real processes: a SIGKILL (BATCHRUN_KILL_AT, see batchrun/host/faults.py) and the OOM killer act on the process, so
these tests run the command line in subprocesses. Each start costs a few seconds of torch import, so the jobs
are tiny.
"""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchrun.host import CGROUP_ROOT, HOST, memory_cgroup_dir, oom_kill_count
from batchrun.output import read_parquet_results, write_parquet
from tests.procs import (
    Reference, assert_same_answers, batchrun_env, done_answers, finish, fresh_home, mixed_job, reference_run, run,
    start, submit_args, write_jsonl,
)
from tests.support import integrity_ok

CHAIN_OPTIONS = ("--streaming", "always", "--batch-size", "4", "--force", "--quiet")
# Two chains of kills, each on its own job, run side by side. A run is killed at its point; the next run resumes
# (and is itself killed at the next point). Points are ordered so each run still has work left to reach its point:
# a kill at `committed:n` lets that run keep n passes, the others keep at most the passes before the one in flight.
# The job has 19 passes (3 choice passes, two generation batches of 8 steps) of 2 layers each.
# 24 kills in all.
CHAIN_A = ("planned:1",     # fresh database: schema, job, lock and plan committed, then killed before the model loads
           "commit:2",      # inside the transaction taking over the dead holder's lock
           "layer:1",       # mid-pass, after the first decoder layer
           "commit:4",      # inside the first pass's commit
           "committed:1",   # right after the first pass's commit
           "layer:3",       # inside the second pass
           "pass:2",        # second pass computed, not yet committed
           "committed:2",
           "commit:5",      # inside the second pass's commit
           "layer:5",
           "output:1",      # every answer committed, Parquet temp file written, not yet renamed
           "commit:3")      # nothing left to compute: inside the release, after the output was renamed into place
CHAIN_B = ("commit:1",      # fresh database: inside the schema creation
           "commit:2",      # inside recording the job and its rows
           "commit:3",      # inside recording the run's plan, with the lock already taken
           "layer:2",       # the first pass's last layer ran
           "committed:3",   # all choice passes committed
           "pass:1",
           "committed:2",   # generation passes: the partial tokens of unfinished rows are committed
           "commit:6",
           "layer:6",
           "planned:1",
           "committed:3",
           "output:1")
LAYERS = 2  # the tiny llama's decoder layers


@dataclass
class ChainResult:
    kills: list[str]
    final: dict
    answers: list[dict]
    trace: Counter  # fault points reached over all the chain's runs


def run_kill_chain(tmp: Path, home_source: Path, spec: Path, model: Path, points: tuple[str, ...]) -> ChainResult:
    """Run the job once per kill point (each killed there), then once to the end; check the store after each kill."""
    tmp.mkdir(parents=True)
    home, db, out_dir, trace = fresh_home(tmp, home_source), tmp / "progress.db", tmp / "out", tmp / "trace.txt"
    output = out_dir / "answers.parquet"
    args = submit_args(spec, model, db, output, *CHAIN_OPTIONS)
    answered: dict[int, tuple] = {}
    for point in points:
        result = run(args, batchrun_env(home, BATCHRUN_KILL_AT=point, BATCHRUN_FAULT_TRACE=str(trace)))
        assert result.returncode == -signal.SIGKILL, f"the run was to be killed at {point}:\n{result.describe()}"
        assert integrity_ok(db), f"integrity_check failed after a kill at {point}"
        now = done_answers(db)
        lost = {idx: answer for idx, answer in answered.items() if now.get(idx) != answer}
        assert not lost, f"answers committed before the kill at {point} were lost or changed: {lost}"
        answered = now
    result = run(args, batchrun_env(home, BATCHRUN_FAULT_TRACE=str(trace)))
    assert result.returncode == 0, result.describe()
    assert integrity_ok(db)
    # temp files of killed writers are gone: the answers and the job's report are all there is
    assert sorted(p.name for p in out_dir.iterdir()) == [output.name, "answers.report.html"]
    final = done_answers(db)
    assert all(final[idx] == answer for idx, answer in answered.items())  # nor by the final run
    return ChainResult(list(points), result.summary, read_parquet_results(output), Counter(trace.read_text().split()))


@pytest.fixture
def reference(tmp_path, tiny_checkpoint) -> Reference:
    return reference_run(tmp_path, tiny_checkpoint("llama"), mixed_job(tmp_path / "job.jsonl"),
                         dict(streaming="always", batch_size=4))


@pytest.mark.slow
def test_killed_anywhere_the_job_resumes_to_the_uninterrupted_answers(tmp_path, reference, isolated_state):
    spec, model, expected, reference_work = reference.spec, reference.model, reference.answers, reference.work
    # The chains are sized for this job's 19 passes: with far fewer, a late kill point would never be reached.
    assert reference_work["pass"] >= 17 and reference_work["layer"] == reference_work["pass"] * LAYERS
    with ThreadPoolExecutor(max_workers=2) as pool:
        chains = [pool.submit(run_kill_chain, tmp_path / name, isolated_state, spec, model, points)
                  for name, points in (("a", CHAIN_A), ("b", CHAIN_B))]
        results = [chain.result() for chain in chains]

    kills = sum(len(chain.kills) for chain in results)
    for chain in results:
        assert chain.final["state"] == "done" and chain.final["rows_done"] == 12, chain.final
        assert chain.final["rows_computed_now"] == 0  # the last kill (output/release) came after every answer
        assert_same_answers(chain.answers, expected)
    # Work lost to the kills: layers computed in all runs beyond what one uninterrupted run computes. A kill loses
    # at most the pass in flight, never a committed one.
    redone_layers = sum(chain.trace["layer"] for chain in results) - len(results) * reference_work["layer"]
    redone_passes = sum(chain.trace["pass"] for chain in results) - len(results) * reference_work["pass"]
    print(f"\n{kills} kills survived; redone work: {redone_layers} layer computations "
          f"({redone_layers / LAYERS:.1f} passes of {len(results) * reference_work['pass']}), "
          f"{redone_passes} completed passes recomputed")
    assert kills >= 20
    assert 0 <= redone_layers <= kills * LAYERS


# ---------------------------------------------------------------------------------------------------------------
# Out of memory: the kernel kills the run; the next run says so and halves the batch.

OOM_CAP_BYTES = 512 * 2**20  # importing torch and loading the tiny model stays under ~350 MB; the big batch ~700 MB


def own_memory_cgroup_v1() -> Path:
    own = memory_cgroup_dir()
    if own is None or CGROUP_ROOT / "memory" not in own.parents and own != CGROUP_ROOT / "memory":
        pytest.skip("needs a cgroup v1 memory controller (this machine has none, or cgroup v2 only)")
    if oom_kill_count(own) is None:
        pytest.skip(f"{own} reports no oom_kill counter (kernel older than 4.13?)")
    return own


@pytest.fixture
def capped_cgroup():
    """A child memory cgroup of our own, limited to OOM_CAP_BYTES; removed after the test."""
    child = own_memory_cgroup_v1() / f"batchrun-test-{os.getpid()}-{random.randrange(10**6)}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a memory cgroup under {child.parent} ({error}): needs root or a delegated cgroup")
    try:
        (child / "memory.limit_in_bytes").write_text(str(OOM_CAP_BYTES))
        try:
            (child / "memory.swappiness").write_text("0")  # with swap, the capped run would crawl instead of dying
        except OSError:
            pass
        yield child
    finally:
        for _ in range(50):  # the killed process leaves the cgroup as the kernel reaps it
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def long_choice_job(path: Path, rows: int = 256) -> Path:
    """Rows of 150-word prompts: one pass over all of them needs far more memory than one row. They start with
    different words (no shared prefix), differ throughout (rows that repeat another are computed once) and are all
    one token length (151 with the tiny tokenizer), so no cut by length pays and the pass is one forward call
    (batching.prefill_groups)."""
    rng = random.Random(1)
    words = "the report review customer product service order invoice contract meeting summary letter".split()
    openers = "the report review customer service order meeting summary letter".split()  # one token each
    return write_jsonl(path, [{"id": i, "prompt": f"{openers[i % len(openers)]} "
                                                  + " ".join(rng.choice(words) for _ in range(149)),
                               "choices": ["positive", "negative"]} for i in range(rows)])


@pytest.mark.slow
def test_after_an_out_of_memory_kill_the_resumed_run_says_so_and_halves_the_batch(
        tmp_path, tiny_checkpoint, isolated_state, capped_cgroup):
    spec = long_choice_job(tmp_path / "long.jsonl")
    db, output = tmp_path / "progress.db", tmp_path / "answers.parquet"
    # A declared 20 GB budget lets the planner put every row in one pass, here in one forward call (two choices of
    # many tokens: 512 sequences); the cgroup has 512 MiB.
    args = submit_args(spec, tiny_checkpoint("llama"), db, output, "--memory", "20", "--micro-batch", "512")
    env = batchrun_env(isolated_state)
    enter_cgroup = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(capped_cgroup / "cgroup.procs")]
    capped = finish(start(args, env, wrapper=enter_cgroup), args)

    assert capped.returncode == -signal.SIGKILL, (
        f"the run was to exceed the {OOM_CAP_BYTES >> 20} MiB cap and be killed:\n{capped.describe()}")
    assert oom_kill_count(capped_cgroup) >= 1, "the capped run died, but not by the OOM killer"
    assert not output.exists()
    with sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True) as conn:
        (capped_pid, capped_batch), = conn.execute("select pid, batch_size from runs")
    assert capped_batch >= 256

    resumed = run(args, env)  # without the cap
    assert resumed.returncode == 0, resumed.describe()
    note = (f"the previous run (pid {capped_pid}) was killed for lack of memory with {capped_batch} sequences per "
            f"pass; resuming with at most {capped_batch // 2}")
    assert note in resumed.stderr  # told while it runs, not only in the summary
    summary = resumed.summary
    assert note in summary["notes"]
    assert summary["batch_size"] <= capped_batch // 2
    assert summary["rows_done"] == 256 and summary["state"] == "done"
    assert len(read_parquet_results(output)) == 256


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process: a writer killed mid-write
    output = tmp_path / "answers.parquet"
    abandoned = tmp_path / f".answers.parquet.tmp-{HOST}-{dead.pid}"
    live = tmp_path / f".answers.parquet.tmp-{HOST}-{os.getppid()}"  # a writer still at work
    elsewhere = tmp_path / f".answers.parquet.tmp-other-host-{dead.pid}"  # cannot tell from here: kept
    for temp in (abandoned, live, elsewhere):
        temp.write_bytes(b"half a file")
    write_parquet(output, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([output.name, live.name, elsewhere.name])
