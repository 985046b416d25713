"""Resident memory follows what is live: a layer turn's freed activations go back to the kernel (glibc only)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchrun.host import glibc

SCRIPT = """
import contextlib, resource, sys, torch
from batchrun.host import keep_freed_pages_below, keep_heap_flat, return_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

keep_heap_flat()
trim = sys.argv[1] != "keep"
kv_cache = []
start = rss()
room = {"room": start + 200_000_000, "no-room": start}.get(sys.argv[1])  # under the limit, trims are skipped
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
with keep_freed_pages_below(room) if room else contextlib.nullcontext():
    for layer in range(24):
        activations = [torch.ones(4_000_000) for _ in range(4)]  # 16 MB each: from the heap, under the threshold
        if "no-kv" not in sys.argv:
            kv_cache.append(torch.ones(100_000))  # 400 KB that stays, allocated among them like a KV slice
        del activations
        if trim:
            return_freed_memory()
live = sum(t.numel() * t.element_size() for t in kv_cache)
print(rss() - start - live, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def _run(*mode: str) -> tuple[int, int]:
    """(bytes resident beyond what is live, page faults) after 24 layer turns."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, *mode], capture_output=True, text=True, check=True)
    extra, faults = out.stdout.strip().splitlines()[-1].split()
    return int(extra), int(faults)


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
def test_memory_freed_by_a_layer_turn_does_not_stay_resident():
    from batchrun.host.heap import TRIM_AFTER_GROWTH_BYTES

    kept = _run("keep")[0]  # without the trim the freed activations stay resident
    trimmed = _run("trim")[0]
    assert kept > 48e6, "the heap did not keep the freed activations: the check below proves nothing"
    assert trimmed < TRIM_AFTER_GROWTH_BYTES + 4e6  # a trim is skipped only below that much growth


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
def test_with_room_under_the_plan_a_turn_reuses_the_pages_the_last_one_freed():
    """Under the limit the executor gives (the plan's peak less the largest turn) the freed activations stay for the
    next turn instead of being faulted in again, glibc's own trim of the heap's top included; with no room the
    trims go on as before. (Allocations that stay, landing among the freed ones, grow the heap turn by turn: the
    limit then brings the trims back, as test_trims_resume_once_the_process_nears_the_plans_peak checks.)"""
    from batchrun.host.heap import TRIM_AFTER_GROWTH_BYTES

    kept, faults_kept = _run("room", "no-kv")
    trimmed, faults_trimmed = _run("no-room", "no-kv")
    assert 48e6 < kept < 200e6  # one turn's 64 MB of activations held for the next, under the limit
    assert trimmed < TRIM_AFTER_GROWTH_BYTES + 4e6
    assert faults_kept * 4 < faults_trimmed  # 16k pages a turn faulted in again when trimmed


class FakeHeap:
    """glibc and /proc stood in for: `resident` is what the process holds; each trim records it, then hands back
    `trim_frees` bytes."""

    def __init__(self, monkeypatch, resident: int, trim_frees: int):
        from batchrun.host import heap as passes

        self.resident, self.trim_frees, self.trims, self.settings = resident, trim_frees, [], []
        monkeypatch.setattr(passes, "glibc", lambda: self)
        monkeypatch.setattr(passes, "resident_bytes", lambda: self.resident)
        monkeypatch.setattr(passes, "_resident_after_trim", 0)

    def malloc_trim(self, pad):
        self.trims.append(self.resident)
        self.resident -= self.trim_frees

    def mallopt(self, parameter, value):
        self.settings.append((parameter, value))


def test_a_turn_that_grew_the_process_little_skips_the_trim(monkeypatch):
    """The trim walks the whole heap; after a decode step's small turn there is next to nothing to hand back."""
    from batchrun.host import heap as passes

    heap = FakeHeap(monkeypatch, 100 << 20, 4 << 20)
    passes.return_freed_memory()  # the first turn: trimmed, 96 MB held after it
    for _ in range(3):
        heap.resident += 5 << 20  # small turns: 101, 106, 111 MB, under 96 + 16
        passes.return_freed_memory()
    assert heap.trims == [100 << 20]
    heap.resident += 5 << 20  # 116 MB: 20 MB above what the last trim left
    passes.return_freed_memory()
    assert heap.trims == [100 << 20, 116 << 20]
    assert passes._resident_after_trim == 112 << 20


def test_trims_resume_once_the_process_nears_the_plans_peak(monkeypatch):
    """Under the limit no trim, however much the process grew since the last one; over it, trimmed again."""
    from batchrun.host import heap as passes

    heap = FakeHeap(monkeypatch, 100 << 20, 30 << 20)
    with passes.keep_freed_pages_below(200 << 20):
        for _ in range(3):
            heap.resident += 40 << 20  # 140, 180, 220 MB
            passes.return_freed_memory()
    assert heap.trims == [220 << 20]  # only the turn that left the process over the limit
    heap.resident += 40 << 20  # 230 MB, outside the run: 40 MB above what the trim left, trimmed as before
    passes.return_freed_memory()
    assert heap.trims == [220 << 20, 230 << 20] and passes._keep_below is None


def test_a_run_puts_back_the_trim_threshold_the_user_gave_glibc(monkeypatch):
    """A job's pages are kept by raising glibc's trim threshold; afterwards the process trims as its user set it."""
    from batchrun.host import heap as passes

    heap = FakeHeap(monkeypatch, 100 << 20, 0)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with passes.keep_freed_pages_below(200 << 20):
        assert heap.settings == [(passes.M_TRIM_THRESHOLD, passes.NEVER_TRIM_ON_FREE_BYTES)]
    assert heap.settings[-1] == (passes.M_TRIM_THRESHOLD, 1 << 20)


def test_the_start_up_trim_threshold_is_read_as_glibc_reads_it():
    from batchrun.host.heap import DEFAULT_TRIM_THRESHOLD_BYTES, NEVER_TRIM_ON_FREE_BYTES, trim_threshold_at_start

    assert trim_threshold_at_start({}) == DEFAULT_TRIM_THRESHOLD_BYTES
    assert trim_threshold_at_start({"MALLOC_TRIM_THRESHOLD_": "0x200000"}) == 2 << 20
    assert trim_threshold_at_start({"MALLOC_TRIM_THRESHOLD_": "010"}) == 8  # C's octal
    tunables = "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=65536"
    # GLIBC_TUNABLES wins over the older variable, as in glibc
    assert trim_threshold_at_start({"GLIBC_TUNABLES": tunables, "MALLOC_TRIM_THRESHOLD_": "4096"}) == 65536
    assert trim_threshold_at_start({"MALLOC_TRIM_THRESHOLD_": "-1"}) == DEFAULT_TRIM_THRESHOLD_BYTES
    assert trim_threshold_at_start({"MALLOC_TRIM_THRESHOLD_": "lots"}) == DEFAULT_TRIM_THRESHOLD_BYTES
    assert trim_threshold_at_start({"MALLOC_TRIM_THRESHOLD_": str(1 << 40)}) == NEVER_TRIM_ON_FREE_BYTES
