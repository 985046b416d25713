"""What every step of a plan reads (PlanInputs), and what each step says of the job besides its result (Notes).
No torch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from batchrun.checkpoint import CheckpointSizes, kv_bytes_for_sequence
from batchrun.plan.batching import RowCost
from batchrun.plan.memory import PREFILL_CALL_BYTES, activation_bytes_for_sequence, attention_scratch_bytes
from batchrun.plan.records import PlanRequest, Rates

# Batches are sized to leave this share of the budget unused: allocator fragmentation and transient copies are not
# in the arithmetic, and under a hard cap (cgroup) being a little short means an out-of-memory kill.
MEMORY_HEADROOM_SHARE = 0.10


@dataclass(frozen=True)
class PlanInputs:
    """The job as every step of a plan reads it."""
    sizes: CheckpointSizes
    rows: Sequence[RowCost]
    own_rows: list[RowCost]  # the rows without the shared prefix
    request: PlanRequest
    rates: Rates
    policy: str  # the streaming policy (mode.parse_streaming)
    compute_bytes: int
    shared: int  # prompt tokens every row starts with
    decode_in_place: bool

    @property
    def device(self) -> str:
        return self.request.device

    @property
    def sizing_budget(self) -> int:
        """The memory budget less the headroom batches leave unused."""
        return int(self.request.memory_budget_bytes * (1 - MEMORY_HEADROOM_SHARE))

    def prefix_bytes(self) -> int:
        """A shared prefix is held once per batch: its KV, its activations while it computes, its forward call."""
        if not self.shared:
            return 0
        return (kv_bytes_for_sequence(self.sizes, self.compute_bytes, self.shared)
                + activation_bytes_for_sequence(self.sizes, self.compute_bytes, self.device, self.shared, 0)
                + PREFILL_CALL_BYTES  # the prefix's forward call is held too
                + attention_scratch_bytes(self.device, self.compute_bytes, self.shared))


@dataclass(frozen=True)
class Notes:
    """What a step of the plan says of the job, in the order it found them: caveats (the job runs, with this said)
    and blockers (it cannot run)."""
    caveats: tuple[str, ...] = ()
    blockers: tuple[str, ...] = ()

    def __add__(self, other: Notes) -> Notes:
        return Notes(self.caveats + other.caveats, self.blockers + other.blockers)
