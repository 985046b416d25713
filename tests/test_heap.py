"""Resident memory follows what is live: a layer turn's freed activations go back to the kernel (glibc only)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from batchrun.passes import glibc

SCRIPT = """
import sys, torch
from batchrun.passes import keep_heap_flat, return_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

keep_heap_flat()
trim = sys.argv[1] == "trim"
kv_cache = []
start = rss()
for layer in range(24):
    activations = [torch.ones(4_000_000) for _ in range(4)]  # 16 MB each: from the heap, under the threshold
    kv_cache.append(torch.ones(100_000))  # 400 KB that stays, allocated among them like a KV slice
    del activations
    if trim:
        return_freed_memory()
live = sum(t.numel() * t.element_size() for t in kv_cache)
print(rss() - start - live)
"""


def _extra_resident_bytes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(glibc() is None, reason="glibc's malloc only")
def test_memory_freed_by_a_layer_turn_does_not_stay_resident():
    from batchrun.passes import TRIM_AFTER_GROWTH_BYTES

    kept = _extra_resident_bytes("keep")  # without the trim the freed activations stay resident
    trimmed = _extra_resident_bytes("trim")
    assert kept > 48e6, "the heap did not keep the freed activations: the check below proves nothing"
    assert trimmed < TRIM_AFTER_GROWTH_BYTES + 4e6  # a trim is skipped only below that much growth


def test_a_turn_that_grew_the_process_little_skips_the_trim(monkeypatch):
    """The trim walks the whole heap; after a decode step's small turn there is next to nothing to hand back."""
    from batchrun import measure, passes

    trims = []
    resident = [100 << 20]

    class FakeLibc:
        def malloc_trim(self, pad):
            trims.append(resident[0])
            resident[0] -= 4 << 20  # what the trim handed back

    monkeypatch.setattr(passes, "glibc", lambda: FakeLibc())
    monkeypatch.setattr(measure, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(passes, "_resident_after_trim", 0)
    passes.return_freed_memory()  # the first turn: trimmed, 96 MB held after it
    for _ in range(3):
        resident[0] += 5 << 20  # small turns: 101, 106, 111 MB, under 96 + 16
        passes.return_freed_memory()
    assert trims == [100 << 20]
    resident[0] += 5 << 20  # 116 MB: 20 MB above what the last trim left
    passes.return_freed_memory()
    assert trims == [100 << 20, 116 << 20]
    assert passes._resident_after_trim == 112 << 20
