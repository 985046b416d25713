"""The plan as the CLI prints it and the executor runs it: one way to run a job, its memory, batches, passes and
time, and what (if anything) stops it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from batchrun.plan.formatting import format_duration

@dataclass
class Candidate:
    """One way to run a job: its memory, batches, passes and time, and what (if anything) stops it."""
    model: str
    mode: str  # "resident" | "streamed"
    reason: str
    device: str
    prefetch: bool
    checkpoint_bytes: int
    layers: int
    largest_layer_bytes: int
    non_decoder_bytes: int
    kv_bytes_per_token: int  # all layers at the compute dtype, before any sliding-window cap
    compute_dtype: str
    memory_budget_bytes: int
    weights_bytes: int
    runtime_overhead_bytes: int
    peak_memory_bytes: int
    turn_bytes: int  # the most one forward call's turn at a layer allocates (plan.memory.largest_turn_bytes)
    batch_size: int  # most sequences in a batch
    micro_batch_size: int | None  # sequences per forward call within a pass; None: the whole batch at once
    batch_tokens: int  # padded-token budget used for packing
    batches: list[list[int]]
    rows: int
    passes: int
    lower_bound_passes: int
    read_bandwidth_bytes_per_s: float | None
    bandwidth_basis: str
    bandwidth_how: str
    load_seconds: float | None
    seconds_per_pass: float | None  # median pass of the job
    io_seconds_per_pass: float | None
    compute_seconds_per_pass: float | None  # median
    memory_bytes_per_s: float | None  # how fast a decode pass streams weights from RAM; None: FLOPs alone
    eta_seconds: float | None
    first_answer_seconds: float | None
    answers_per_hour: float | None
    disk_needed_bytes: int
    disk_free_bytes: int | None
    estimated: bool
    blockers: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    shared_prefix_tokens: int = 0  # prompt tokens every row starts with: computed once per choice batch, once for the
    # generation rows
    decode_micro_batch_size: int | None = None  # sequences per forward call in decode passes; None: all at once
    # Every generation row, answered in full, fits inside the model's smallest sliding window (or it has none):
    # windowed layers cache as full ones, so the decode micro-batches of rows admitted in different passes merge.
    windows_as_full: bool = True
    prefetch_depth: int = 0  # layers a prefill reads ahead of the one computing; 0: none (resident, no prefetch)
    decode_prefetch_depth: int = 0  # the same in decode passes (one more where memory allows)
    # decode calls were sized reading keys and values where they lie (plan.memory.decode_call_bytes_per_sequence)
    decode_in_place: bool = False
    pass_seconds: list[float | None] = field(default_factory=list)  # every pass in run order
    linear_kernel: str = "aten"  # what computes the nn.Linear layers (measure.linear_kernel; a CPU choice)
    packs_weights: bool = False  # long streamed prefills multiply packed weights (measure.packs_weights)
    compute_dtype_reason: str | None = None  # why --dtype auto chose compute_dtype (host/compute_dtype.py; the CPU)
    pass_bound_seconds: float | None = None  # the longest a pass may be planned to take; None: no bound
    longest_pass_seconds: float | None = None
    unbounded_passes: int | None = None  # passes without the bound (None: no bound applied)
    bound_cost_seconds: float | None = None  # what the bound adds to the passes' time: more passes, more weight reads
    # What a run holds before any sequence, part by part: [part, bytes] (the runtime, token matrices, layer slots...)
    memory_floor: list[list] = field(default_factory=list)
    token_matrices: str = "held"  # a streamed run's embedding and head: held, gathered or streamed (plan/weights.py)
    token_matrices_reason: str = ""

    @property
    def fits(self) -> bool:
        return not self.blockers

    @property
    def eta_human(self) -> str:
        return format_duration(self.eta_seconds)

    def to_json(self) -> dict:
        report = asdict(self)
        del report["batches"], report["pass_seconds"]  # per batch and per pass: the medians above summarise them
        report.update(batch_count=len(self.batches), fits=self.fits, eta_human=self.eta_human)
        return report
