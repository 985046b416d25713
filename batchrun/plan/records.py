"""The two records a plan is asked with: what the user asked of the job (PlanRequest) and what the plan learns from
the machine (Rates). No torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float | None
    basis: str  # "measured" | "declared" | "assumed"
    how: str


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked that the plan needs.

    streaming: the policy word (planner.parse_streaming). prefetch_depth: layers a streamed prefill reads ahead.
    batch_size: most sequences in a batch (None: as many as memory holds). context_length: the longest sequence the
    model takes (None: the checkpoint's own). checkpoint_is_local: read in place, so no download needs disk.
    pass_seconds: the longest a pass may be planned to take, so a crash loses at most that (None: no bound).
    token_matrices: where a streamed run keeps the embedding and head: "auto" (the plan weighs them by the budget),
    "held", "gathered" (embedding rows read by token id), "streamed" (the head read each pass besides)."""
    model: str
    device: str
    compute_dtype: str
    memory_budget_bytes: int
    streaming: str = "auto"
    prefetch: bool = True
    prefetch_depth: int = 1
    batch_size: int | None = None
    context_length: int | None = None
    checkpoint_is_local: bool = True
    pass_seconds: float | None = None
    token_matrices: str = "auto"


@dataclass(frozen=True)
class Rates:
    """What the plan learns from the machine (batchrun.measure), as measured, before a pass's own slowdowns
    (rates.effective_rates).

    memory_bytes_per_s: how fast a decode-shaped matmul streams weights from RAM (measure.memory_read_rate); without
    it a pass is timed by its FLOPs alone, which undercounts decode passes several times over on a CPU.
    decode_rates: {rows: weight bytes/s} of the checkpoint's own layer matrices (measure.decode_rates), which price
    each decode pass's weights at its row count instead of the memory rate.
    layer_call_seconds: the fixed cost of one forward call through a decoder layer (measure.layer_call_seconds),
    paid per layer by every call of a pass besides its roofline.
    compute_threads: the threads the rates were measured with; a host streaming with prefetch decodes on one fewer
    (rates.decode_cores_share).
    packs_weights: a streamed run's long prefills multiply packed weights (measure.packs_weights), one layer more.
    runtime_overhead_bytes: what the runtime (and the tokenizer, and the job's rows) hold before any weight is read.
    disk_free_bytes: free disk where a download would go (None: unknown)."""
    bandwidth: Bandwidth
    compute_flops_per_s: float | None
    runtime_overhead_bytes: int
    memory_bytes_per_s: float | None = None
    decode_rates: Mapping[int, float] | None = None
    layer_call_seconds: float = 0.0
    compute_threads: int = 1
    packs_weights: bool = False
    disk_free_bytes: int | None = None
    tokenizer_bytes: int = 0  # the tokenizer's part of runtime_overhead_bytes
    rows_bytes: int = 0  # the job's read and encoded rows' part of runtime_overhead_bytes
    # A GGUF model's weights decoded per second into the compute dtype, by ggml type (measure.dequantize_rates)
    dequantize_weights_per_s: Mapping[str, float] = field(default_factory=dict)
