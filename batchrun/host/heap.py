"""The process heap under glibc: one arena, activation-sized blocks from the heap, freed pages handed back after
each layer turn (or kept while the process is under the plan's peak). A no-op where libc is not glibc.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os

from batchrun.host.memory import resident_bytes

M_ARENA_MAX = -8  # glibc mallopt parameters
M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
DEFAULT_TRIM_THRESHOLD_BYTES = 128 << 10  # glibc's
TRIM_THRESHOLD_TUNABLE = "glibc.malloc.trim_threshold"
NEVER_TRIM_ON_FREE_BYTES = (1 << 31) - 1  # mallopt takes an int
# Blocks this large or larger get their own mapping, returned to the kernel when freed; smaller ones (every
# activation of a micro-batch of a few thousand tokens) come from the heap, so a layer's later ops reuse the pages its
# earlier ops freed instead of faulting in fresh ones.
MMAP_THRESHOLD_BYTES = 32 << 20


@functools.cache  # once per process: find_library may spawn ldconfig, far too slow for every pass
def glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@functools.cache
def keep_heap_flat() -> None:
    """Serve activations from one heap whose freed pages go back to the kernel after every layer turn.

    Activation-sized blocks come from the heap, not a fresh mapping each, whose pages the kernel would zero again
    every time; and `return_freed_memory` runs after each micro-batch's turn at a layer, since an untrimmed heap
    cannot shrink around the KV cache and held hidden states allocated among the activations. Micro-batch threads
    would also each get an arena keeping its own high-water mark; one arena keeps the retention of a single
    micro-batch, which is what the plan sizes. No-op where libc is not glibc. Time and memory of each rule:
    docs/performance.md#mechanisms-and-what-they-are-worth."""
    libc = glibc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 1)
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


# A trim walks every hole of the heap and hands each back to the kernel again, even when the turn freed next to
# nothing, as a decode step's turn does (docs/streaming.md#flat-memory). So it is skipped while the process holds
# less than this much more than right after the last trim. After a skip the process still holds no more than this
# above what it held after some trim, which is what the per-turn trim keeps it to; the plan's 10% headroom covers the
# difference.
TRIM_AFTER_GROWTH_BYTES = 16 << 20
_resident_after_trim = 0  # process-wide: layer turns run one at a time
_keep_below: int | None = None  # see keep_freed_pages_below


def return_freed_memory(always: bool = False) -> None:
    """Give the heap's free pages back to the kernel (glibc's malloc_trim walks the holes too, not just the top):
    what one layer turn freed does not stay resident beside the next one. Skipped while the process has grown by
    less than TRIM_AFTER_GROWTH_BYTES since the last trim, or holds no more than keep_freed_pages_below allows, unless
    `always` (a one-off that freed much: loading a tokenizer)."""
    global _resident_after_trim
    libc = glibc()
    if libc is None:
        return
    resident = resident_bytes()
    if not always and resident is not None and (resident < _resident_after_trim + TRIM_AFTER_GROWTH_BYTES
                                                or (_keep_below is not None and resident <= _keep_below)):
        return
    libc.malloc_trim(0)
    _resident_after_trim = resident_bytes() or 0


def trim_threshold_at_start(environ=os.environ) -> int:
    """The trim threshold glibc took at start-up (GLIBC_TUNABLES' glibc.malloc.trim_threshold, else
    MALLOC_TRIM_THRESHOLD_, else its default): what keep_freed_pages_below puts back. glibc has no call that reads
    it, so a threshold the program itself set with mallopt is not known here."""
    tunables = dict(entry.partition("=")[::2] for entry in environ.get("GLIBC_TUNABLES", "").split(":") if entry)
    for text in (tunables.get(TRIM_THRESHOLD_TUNABLE), environ.get("MALLOC_TRIM_THRESHOLD_")):
        value = _c_integer(text)
        if value is not None:
            return min(value, NEVER_TRIM_ON_FREE_BYTES)
    return DEFAULT_TRIM_THRESHOLD_BYTES


def _c_integer(text: str | None) -> int | None:
    """An unsigned integer as glibc reads one (decimal, 0x hex, leading-0 octal); None if it is not one."""
    text = (text or "").strip().lower()
    if not text.isalnum():  # signs, spaces inside: not a number glibc would take either
        return None
    try:
        if text.startswith("0x"):
            return int(text[2:], 16)
        return int(text[1:] or "0", 8) if text.startswith("0") else int(text, 10)
    except ValueError:
        return None


@contextlib.contextmanager
def keep_freed_pages_below(limit_bytes: int | None):
    """While the process holds at most `limit_bytes`, a layer turn's freed pages stay in the heap for the next turn.

    The executor passes the plan's peak less the largest turn's activations (plan.memory.largest_turn_bytes): a turn
    that finds none of its pages free still ends under the plan's peak. glibc's own trim of the heap's top on free()
    is off meanwhile: it would hand back the same pages. The trims cost what faulting the pages in again costs, in
    page faults and system time (docs/performance.md#mechanisms-and-what-they-are-worth). None: trim after every
    turn. Afterwards glibc's trim threshold is the one it started with."""
    global _keep_below
    previous, _keep_below = _keep_below, limit_bytes
    libc = glibc()
    if libc is not None and limit_bytes is not None:
        libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_ON_FREE_BYTES)
    try:
        yield
    finally:
        _keep_below = previous
        if libc is not None and limit_bytes is not None:
            libc.mallopt(M_TRIM_THRESHOLD, trim_threshold_at_start())
