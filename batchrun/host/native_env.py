"""Settings of torch's native libraries that keep a long run's memory bounded, applied when batchrun is imported.

Every micro-batch and decode group of a pass multiplies a matmul of a new shape. Two things then grow that the plan
cannot size, measured on a 400 MB Llama streamed at `--memory 1.0` (96 rows, ~24 micro-batches a pass): peak RSS
1,088 MiB against a 853 MiB plan, rising by ~35 MiB with every batch.
- oneDNN keeps every primitive it creates (its primitive cache, 1,024 by default) and torch's ideep layer keeps its
  own cache of them (LRU_CACHE_CAPACITY, 1,024): ~0.57 MB a row count for the two, whatever the weight's size. Capped
  at 64 each they hold ~30 MB (the runtime probe in batchrun.measure fills them, so the plan counts it): the run above
  peaked at 882-921 MiB with caps of 32-128, in 114.7-117.2 s against 111.6-113.9 s uncapped. A decode pass reuses
  a handful of shapes per layer, which stay cached; a prefill's micro-batches, each a shape of its own, recreate
  theirs (tenths of a millisecond against matmuls of milliseconds).
- MKL's fast memory manager keeps ~9 MiB of sgemm buffers per thread that ever called it (aten linears): 24
  threads would hold ~216 MB. With it off, its buffers come from malloc and go back after each call: 0.36 MiB a
  thread. A pass's micro-batches share one thread (runtime.turns.run_interleaved); it stays off for any thread a
  caller multiplies on. MKL reads this when torch loads it, so it takes effect only if batchrun
  is imported before torch.

A variable the user has set is kept as it is.
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
