"""The plan as the CLI prints it and the executor runs it: one way to run a job, its memory, batches, passes and
time, and what (if anything) stops it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from batchrun.plan.formatting import format_duration


@dataclass(frozen=True)
class PlanCheckpoint:
    """The checkpoint as the plan counts it, and the disk a download of it needs."""
    checkpoint_bytes: int
    layers: int
    largest_layer_bytes: int
    non_decoder_bytes: int
    kv_bytes_per_token: int  # all layers at the compute dtype, before any sliding-window cap
    estimated: bool  # sizes from config.json, not from the safetensors headers
    disk_needed_bytes: int
    disk_free_bytes: int | None


@dataclass(frozen=True)
class PlanMemory:
    """What a run holds: the weights where its mode keeps them, the runtime, the passes at their peak, and the layers
    it reads ahead."""
    memory_budget_bytes: int
    weights_bytes: int
    runtime_overhead_bytes: int
    peak_memory_bytes: int
    turn_bytes: int  # the most one forward call's turn at a layer allocates (plan.memory.largest_turn_bytes)
    # What a run holds before any sequence, part by part: [part, bytes] (the runtime, token matrices, layer slots...)
    memory_floor: list[list]
    token_matrices: str = "held"  # a streamed run's embedding and head: held, gathered or streamed (plan/weights.py)
    token_matrices_reason: str = ""
    packs_weights: bool = False  # long streamed prefills multiply packed weights (measure.packs_weights)
    prefetch_depth: int = 0  # layers a prefill reads ahead of the one computing; 0: none (resident, no prefetch)
    decode_prefetch_depth: int = 0  # the same in decode passes (one more where memory allows)


@dataclass(frozen=True)
class PlanBatching:
    """The batches and passes, and how a pass is cut into forward calls."""
    batch_size: int  # most sequences in a batch
    micro_batch_size: int | None  # sequences per forward call within a pass; None: the whole batch at once
    batch_tokens: int  # padded-token budget used for packing
    batches: list[list[int]]
    rows: int
    passes: int
    lower_bound_passes: int
    shared_prefix_tokens: int = 0  # prompt tokens every row starts with: computed once per choice batch, once for the
    # generation rows
    decode_micro_batch_size: int | None = None  # sequences per forward call in decode passes; None: all at once
    # Every generation row, answered in full, fits inside the model's smallest sliding window (or it has none):
    # windowed layers cache as full ones, so the decode micro-batches of rows admitted in different passes merge.
    windows_as_full: bool = True
    # decode calls were sized reading keys and values where they lie (plan.memory.decode_call_bytes_per_sequence)
    decode_in_place: bool = False


@dataclass(frozen=True)
class PlanTime:
    """How long the job takes, and the rates the times come from."""
    read_bandwidth_bytes_per_s: float | None
    bandwidth_basis: str
    bandwidth_how: str
    memory_bytes_per_s: float | None  # how fast a decode pass streams weights from RAM; None: FLOPs alone
    load_seconds: float | None
    seconds_per_pass: float | None  # median pass of the job
    io_seconds_per_pass: float | None
    compute_seconds_per_pass: float | None  # median
    eta_seconds: float | None
    first_answer_seconds: float | None
    answers_per_hour: float | None
    pass_seconds: list[float | None] = field(default_factory=list)  # every pass in run order


@dataclass(frozen=True)
class PlanBound:
    """The pass bound: the longest a pass may be planned to take, and what holding passes to it costs."""
    pass_bound_seconds: float | None = None  # None: no bound
    longest_pass_seconds: float | None = None
    unbounded_passes: int | None = None  # passes without the bound (None: no bound applied)
    bound_cost_seconds: float | None = None  # what the bound adds to the passes' time: more passes, more weight reads


# The keys of `plan --json`, every group flattened, in the order it prints them.
JSON_KEYS = (
    "model", "mode", "reason", "device", "prefetch", "checkpoint_bytes", "layers", "largest_layer_bytes",
    "non_decoder_bytes", "kv_bytes_per_token", "compute_dtype", "memory_budget_bytes", "weights_bytes",
    "runtime_overhead_bytes", "peak_memory_bytes", "turn_bytes", "batch_size", "micro_batch_size", "batch_tokens",
    "rows", "passes", "lower_bound_passes", "read_bandwidth_bytes_per_s", "bandwidth_basis", "bandwidth_how",
    "load_seconds", "seconds_per_pass", "io_seconds_per_pass", "compute_seconds_per_pass", "memory_bytes_per_s",
    "eta_seconds", "first_answer_seconds", "answers_per_hour", "disk_needed_bytes", "disk_free_bytes", "estimated",
    "blockers", "caveats", "shared_prefix_tokens", "decode_micro_batch_size", "windows_as_full", "prefetch_depth",
    "decode_prefetch_depth", "decode_in_place", "linear_kernel", "packs_weights", "compute_dtype_reason",
    "pass_bound_seconds", "longest_pass_seconds", "unbounded_passes", "bound_cost_seconds", "memory_floor",
    "token_matrices", "token_matrices_reason", "batch_count", "fits", "eta_human",
)


@dataclass
class Candidate:
    """One way to run a job: what runs it and how, its checkpoint, memory, batches, time and pass bound, and what (if
    anything) stops it."""
    model: str
    mode: str  # "resident" | "streamed"
    reason: str
    device: str
    prefetch: bool
    compute_dtype: str
    checkpoint: PlanCheckpoint
    memory: PlanMemory
    batching: PlanBatching
    time: PlanTime
    bound: PlanBound = field(default_factory=PlanBound)
    blockers: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    linear_kernel: str = "aten"  # what computes the nn.Linear layers (measure.linear_kernel; a CPU choice)
    compute_dtype_reason: str | None = None  # why --dtype auto chose compute_dtype (host/compute_dtype.py; the CPU)

    @property
    def fits(self) -> bool:
        return not self.blockers

    @property
    def eta_human(self) -> str:
        return format_duration(self.time.eta_seconds)

    def to_json(self) -> dict:
        """Every group flattened into one record; the batches and pass times are summarised (batch_count and the
        medians), not listed."""
        flat = asdict(self)
        for group in ("checkpoint", "memory", "batching", "time", "bound"):
            flat.update(flat.pop(group))
        flat.update(batch_count=len(self.batching.batches), fits=self.fits, eta_human=self.eta_human)
        return {key: flat[key] for key in JSON_KEYS}
