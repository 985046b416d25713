"""Named fault points, so the reliability tests can stop the process at an exact moment.

`BATCHRUN_KILL_AT=point:n` makes the process SIGKILL itself the n-th time it reaches `point`
(1-based). `BATCHRUN_STOP_AT=point:n` sends SIGSTOP instead: the process freezes there, still
holding its job lock, until the test continues or kills it. `BATCHRUN_FAULT_TRACE=file` appends
every point reached to `file`, one name a line, so a test can count the work a killed run did.
Unset (always, outside the tests) each costs one environment lookup. Points:
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
STOP_ENV = "BATCHRUN_STOP_AT"
TRACE_ENV = "BATCHRUN_FAULT_TRACE"
_counts: dict[str, int] = {}


def reached(point: str) -> None:
    kill_at, stop_at, trace = os.environ.get(ENV), os.environ.get(STOP_ENV), os.environ.get(TRACE_ENV)
    if not (kill_at or stop_at or trace):
        return
    _counts[point] = _counts.get(point, 0) + 1
    if trace:
        # Written and closed before any kill below, so the trace holds the point the process died at.
        with open(trace, "a", encoding="utf-8") as handle:
            handle.write(point + "\n")
    if _is_target(kill_at, point):
        os.kill(os.getpid(), signal.SIGKILL)
    if _is_target(stop_at, point):
        os.kill(os.getpid(), signal.SIGSTOP)


def _is_target(target: str | None, point: str) -> bool:
    if not target:
        return False
    name, _, nth = target.partition(":")
    return name == point and _counts[point] == int(nth or 1)
