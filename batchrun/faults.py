"""Named fault points, so the reliability tests can kill the process at an exact moment.

`BATCHRUN_KILL_AT=point:n` makes the process SIGKILL itself the n-th time it reaches `point`
(1-based). Unset (always, outside the tests) it costs one dictionary lookup. Points:
  planned        after the plan, before the model loads
  layer          inside a pass, after a decoder layer ran (streamed mode)
  pass           after a pass computed, before its results are committed
  commit         inside the database transaction, before COMMIT
  committed      right after a commit
  output         while the Parquet file is written, before the rename
"""
from __future__ import annotations

import os
import signal

ENV = "BATCHRUN_KILL_AT"
_counts: dict[str, int] = {}


def reached(point: str) -> None:
    target = os.environ.get(ENV)
    if not target:
        return
    name, _, nth = target.partition(":")
    if name != point:
        return
    _counts[point] = _counts.get(point, 0) + 1
    if _counts[point] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
