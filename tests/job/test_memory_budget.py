"""The memory budget a run plans in, counted once: `submit` inside a real memory cgroup plans in about the cgroup's
limit, not the limit less the runtime it has already imported (which the plan then counts again)."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import choice_spec

CGROUP_ROOT = Path("/sys/fs/cgroup")
LIMIT_BYTES = 2 << 30
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _own_cgroup(version: str) -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if version == "v1" and "memory" in controllers.split(","):
            return CGROUP_ROOT / "memory" / path.lstrip("/")
        if version == "v2" and controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            return CGROUP_ROOT / path.lstrip("/")
    return None


@contextlib.contextmanager
def memory_limited_cgroup(limit: int):
    """A fresh child of this process's memory cgroup (v1, else v2) limited to `limit`; skips where neither can be
    made (no controller, not root)."""
    for version, limit_file in (("v1", "memory.limit_in_bytes"), ("v2", "memory.max")):
        parent = _own_cgroup(version)
        if parent is None:
            continue
        child = parent / f"batchrun-test-{os.getpid()}-{time.monotonic_ns()}"
        try:
            child.mkdir()
            (child / limit_file).write_text(str(limit))
        except OSError:
            with contextlib.suppress(OSError):
                child.rmdir()
            continue
        try:
            yield child
        finally:
            for _ in range(50):  # removable once its last task has exited
                try:
                    child.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        return
    pytest.skip("no memory cgroup can be made here (neither a v1 memory controller nor a v2 one, or not root)")


def planned_budget(stderr: str) -> int:
    """The budget from the plan table submit prints: "memory  peak 38.2 MiB of a 1.99 GiB budget"."""
    found = re.search(r"of a ([\d.,]+) (B|KiB|MiB|GiB|TiB) budget", stderr)
    assert found, stderr[-3000:]
    return int(float(found.group(1).replace(",", "")) * UNITS[found.group(2)])


def test_submit_in_a_memory_cgroup_plans_in_its_limit_counting_the_runtime_once(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path)
    with memory_limited_cgroup(LIMIT_BYTES) as cgroup:
        procs = cgroup / "cgroup.procs"
        run = subprocess.run(
            [sys.executable, "-m", "batchrun", "submit", str(spec), "--model", str(tiny_checkpoint("llama")),
             "--db", str(tmp_path / "j.db"), "-o", str(tmp_path / "out.parquet")],
            capture_output=True, text=True, preexec_fn=lambda: procs.write_text(str(os.getpid())), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    budget = planned_budget(run.stderr)
    # The process has imported torch and transformers (~400 MB here) before it plans: a budget of the limit less
    # that would lose it twice, once here and once as the plan's runtime.
    assert LIMIT_BYTES - (128 << 20) <= budget <= LIMIT_BYTES * 1.005  # the table rounds to three figures


def test_the_budget_gives_back_what_the_plan_counts_of_this_process_and_no_more(monkeypatch):
    """What the process holds is out of the available memory already: the runtime the plan counts (and the weights of
    a model a Ray worker keeps open) is given back, the rest (a large spec's encoded rows) is not. --memory wins."""
    from batchrun.job import JobOptions, models, prepare

    monkeypatch.setattr(prepare, "available_memory_bytes", lambda device: 1000 << 20)
    monkeypatch.setattr(prepare, "anonymous_resident_bytes", lambda: 900 << 20)
    monkeypatch.setattr(models, "_kept", None)
    assert prepare.memory_budget(JobOptions(), "cpu", 500 << 20) == 1500 << 20  # 400 MiB of rows stay taken
    assert prepare.memory_budget(JobOptions(), "cpu", 2000 << 20) == 1900 << 20  # no more than the process holds
    assert prepare.memory_budget(JobOptions(), "cuda:0", 500 << 20) == 1000 << 20  # the card's memory: not ours
    assert prepare.memory_budget(JobOptions(memory_gb=2.5), "cpu", 500 << 20) == 2_500_000_000
    kept = models.keep_models_open()
    kept.held_bytes = 300 << 20  # a resident model kept from the last shard
    assert prepare.memory_budget(JobOptions(), "cpu", 500 << 20) == 1800 << 20
