"""Settings of torch's native libraries that keep a long run's memory bounded, applied when batchrun is imported.

Every micro-batch and decode group of a pass multiplies a matmul of a new shape, and two things then grow with every
batch, beyond what the plan can size:
- oneDNN keeps every primitive it creates (its primitive cache, 1,024 by default) and torch's ideep layer keeps its
  own cache of them (LRU_CACHE_CAPACITY, 1,024), every row count a new entry whatever the weight's size. Capped at
  KERNEL_CACHE_CAPACITY each they stay small (the runtime probe in batchrun.measure fills them, so the plan counts
  them). A decode pass reuses a handful of shapes per layer, which stay cached; a prefill's micro-batches, each a
  shape of its own, recreate theirs, which costs little beside their matmuls.
- MKL's fast memory manager keeps sgemm buffers for every thread that ever called it (aten linears). With it off,
  its buffers come from malloc and go back after each call. A pass's micro-batches share one thread
  (runtime.turns.run_interleaved); it stays off for any thread a caller multiplies on. MKL reads this when torch
  loads it, so it takes effect only if batchrun is imported before torch.

A variable the user has set is kept as it is. What each setting holds and costs:
docs/performance.md#native-library-caches.
"""
from __future__ import annotations

import os

KERNEL_CACHE_CAPACITY = 64
NATIVE_DEFAULTS = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),
    "LRU_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),  # ideep's; 0 crashes torch 2.13, so never 0
    "MKL_DISABLE_FAST_MM": "1",
}


def apply_native_defaults(environ=os.environ) -> None:
    for name, value in NATIVE_DEFAULTS.items():
        environ.setdefault(name, value)
