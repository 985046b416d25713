"""Offload arithmetic as named steps: memory, batch, passes and time, and the auto/always/never policy. No torch.

Each intermediate is named and says where its number comes from; the activation coefficients below are first
estimates, kept at the top so measurement can calibrate them.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from batchrun.checkpoint import (
    CheckpointSizes,
    kv_bytes_for_sequence,
    kv_bytes_per_token_per_layer,
)
from batchrun.plan.batching import (
    RowCost,
    batch_shape,
    inside_windows,
    lower_bound_passes,
    pack_batches,
    passes_for,
    without_prefix,
)
from batchrun.plan.formatting import format_bytes, format_duration, format_rate
from batchrun.plan.memory import (  # noqa: F401 (re-exported)
    ATTENTION_SCORE_BYTES,
    HEAP_RETAINED_ACTIVATION_COPIES,
    HELD_HIDDEN_COPIES,
    LOGIT_BYTES,
    PREFILL_CALL_BYTES,
    activation_bytes_for_sequence,
    attention_scratch_bytes,
    batch_bytes,
    decode_group_size,
    decode_pass_bytes,
    heap_factor,
    largest_turn_bytes,
    linear_activation_bytes_per_token,
    scores_materialised,
)
from batchrun.plan.rates import (  # noqa: F401 (re-exported)
    HOST_FRESH_PAGE_SLOWDOWN,
    decode_cores_share,
    effective_rates,
    streaming_traffic,
)
from batchrun.plan.refill import refill_schedule, shares_prefix
from batchrun.plan.timing import (  # noqa: F401 (re-exported)
    KV_COPIES_PER_DECODE,
    Timeline,
    host_streaming_bytes,
    job_timeline,
    pass_bound,
)
from batchrun.plan.weights import (  # noqa: F401 (re-exported)
    COMPUTE_BYTES,
    layer_slot_bytes,
    on_host,
    resident_weights,
    streamed_weights,
)

__all__ = [
    "Bandwidth", "Candidate", "RowCost", "compare_modes", "format_duration", "lower_bound_passes", "make_plan",
    "pack_batches", "parse_streaming", "passes_for",
]

STREAMING_ENV = "BATCHRUN_STREAMING"
# People type booleans too; an unknown word is refused (a typo must not silently change the policy).
STREAMING_WORDS = {
    "auto": "auto", "always": "always", "never": "never",
    "yes": "always", "on": "always", "true": "always", "1": "always",
    "no": "never", "off": "never", "false": "never", "0": "never",
}
# Share of the measured cold read bandwidth a streamed pass achieves. `batchrun disk` measures reads made the way the
# streamer makes them, and with a prefetch thread the disk never idles during an I/O-bound pass, so nothing is lost
# (the published design's 0.85 would overstate pass times). Without prefetch each layer's compute waits for its read
# (published: 0.70).
IO_EFFICIENCY = {True: 1.0, False: 0.70}
MICRO_BATCH_MEMORY_SHARE = 0.25  # of the free memory given to one micro-batch's activations; the rest buys sequences
# Batches are sized to leave this share of the budget unused: allocator fragmentation and transient copies are not
# in the arithmetic, and under a hard cap (cgroup) being a little short means an out-of-memory kill.
MEMORY_HEADROOM_SHARE = 0.10
# With no rows to size, memory is reported for one sequence of this many tokens (or the context, if shorter).
DEFAULT_SIZING_TOKENS = 4096


def parse_streaming(value: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The streaming policy: the flag's word first, then $BATCHRUN_STREAMING, default "auto"."""
    source = "--streaming"
    if value is None:
        value, source = env.get(STREAMING_ENV) or "auto", STREAMING_ENV
    word = value.strip().lower()
    if word not in STREAMING_WORDS:
        raise ValueError(f"{source}: unknown streaming policy {value!r}; accepted: auto, always, never, "
                         "yes/no, on/off, true/false, 1/0")
    return STREAMING_WORDS[word]


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float | None
    basis: str  # "measured" | "declared" | "assumed"
    how: str


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
    turn_bytes: int  # the most one forward call's turn at a layer allocates (plan_memory.largest_turn_bytes)
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
    prefetch_depth: int = 0  # layers a prefill reads ahead of the one computing; 0: none (resident, no prefetch)
    decode_prefetch_depth: int = 0  # the same in decode passes (one more where memory allows)
    # decode calls were sized reading keys and values where they lie (plan_memory.decode_call_bytes_per_sequence)
    decode_in_place: bool = False
    pass_seconds: list[float | None] = field(default_factory=list)  # every pass in run order
    linear_kernel: str = "aten"  # what computes the nn.Linear layers (measure.linear_kernel; a CPU choice)
    packs_weights: bool = False  # long streamed prefills multiply packed weights (measure.packs_weights)
    compute_dtype_reason: str | None = None  # why --dtype auto chose compute_dtype (compute_dtype.py; the CPU)

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


# ---------------------------------------------------------------------------------------------------------------
# Memory, as named steps (what the weights hold: plan_weights.py)


def batch_limits(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                 free_bytes: int, batch_size: int | None) -> tuple[int, int, int | None]:
    """(max sequences, max padded tokens, sequences per micro-batch or None) such that any batch packed under them
    fits in free_bytes.

    Bound: every token costs at most its KV (no window cap; none in a job of choice rows only), its linear
    activations and one row of attention scores at the longest prefill; every sequence adds its kept logits.
    Sequences are sized so typical (median-length) rows fill the budget; the token budget then keeps longer rows from
    overflowing it. When the job's sequences do not all fit with their activations live at once (padded to the
    longest row), the pass is split into micro-batches: activations are bought for one micro-batch (a share of the
    budget, or what holding a smaller job's every row leaves), KV and held hidden states for every sequence of the
    pass."""
    longest_prefill = max(row.prefill_length() for row in rows)
    kv_per_token = (kv_bytes_per_token_per_layer(sizes, compute_bytes) * sizes.num_layers
                    if any(row.holds_cache for row in rows) else 0)
    activation_per_token = (linear_activation_bytes_per_token(sizes, compute_bytes, device)
                            + (sizes.num_attention_heads * longest_prefill * ATTENTION_SCORE_BYTES
                               * heap_factor(device) if scores_materialised(device) else 0))
    per_sequence = max(row.logit_positions() for row in rows) * sizes.vocab_size * LOGIT_BYTES
    typical_length = statistics.median_low(row.sequence_length() for row in rows)
    wanted = min(sum(row.sequences() for row in rows), batch_size or math.inf)
    free_bytes = max(free_bytes, 0)

    per_token = kv_per_token + activation_per_token
    all_live = free_bytes // (typical_length * per_token + per_sequence)
    longest = max(row.sequence_length() for row in rows)
    if all_live >= wanted and wanted * (longest * per_token + per_sequence) <= free_bytes:
        # every sequence's activations fit at once, even all padded to the longest: one forward call per pass
        max_sequences = max(int(wanted), 1)
        return max_sequences, int(max((free_bytes - max_sequences * per_sequence) // per_token, 1)), None

    # A micro-batch is cut from sequences sorted by length, so the last one holds the longest rows: its activations
    # are bought at the longest prefill, as the peak counts them (batch_bytes), not at the median length.
    micro_per_sequence = longest_prefill * activation_per_token + per_sequence
    micro_sequences = max(int(free_bytes * MICRO_BATCH_MEMORY_SHARE // micro_per_sequence), 1)
    held_per_token = kv_per_token + sizes.hidden_size * compute_bytes * HELD_HIDDEN_COPIES
    # Each forward call (micro-batch) is held suspended (PREFILL_CALL_BYTES), shared by its sequences.
    max_sequences = ((free_bytes - micro_sequences * micro_per_sequence)
                     // (typical_length * held_per_token + PREFILL_CALL_BYTES / micro_sequences))
    if max_sequences > wanted:
        # The job needs fewer sequences than memory holds. Every row is held at the longest row's length, so the
        # token budget packs them all into one batch, and the micro-batch gets what that leaves (at least one
        # sequence, fewer than all), each of its sequences at the longest row's activations like the batch's peak:
        # usually more than the fixed share, and larger micro-batches run faster (float32 on 2 cores, one layer
        # over 3,100 tokens: 186 GFLOP/s in micro-batches of 485 tokens, 214 of 1,067, 233 in one).
        max_sequences = wanted
        leftover = free_bytes - wanted * longest * held_per_token

        def micro_fitting(room: float) -> int:
            return max(1, min(int(wanted) - 1, int(room // (longest * activation_per_token + per_sequence))))

        micro_sequences = micro_fitting(leftover)
        micro_sequences = micro_fitting(leftover - _calls_bytes(wanted, micro_sequences))  # room for its calls
    max_sequences = max(int(max_sequences), 1)
    if max_sequences <= micro_sequences:  # no room to gain: the old single-forward bound
        max_sequences = max(int(min(all_live, wanted)), 1)
        return max_sequences, int(max((free_bytes - max_sequences * per_sequence) // per_token, 1)), None
    max_tokens = max(int((free_bytes - micro_sequences * micro_per_sequence
                          - _calls_bytes(max_sequences, micro_sequences)) // held_per_token), 1)
    return max_sequences, max_tokens, micro_sequences


def _calls_bytes(sequences: int, micro_sequences: int) -> int:
    """The suspended forward calls of a pass, one per micro-batch (the plan's peak counts the executor's cut)."""
    return math.ceil(sequences / micro_sequences) * PREFILL_CALL_BYTES


# ---------------------------------------------------------------------------------------------------------------
# The plan


def make_plan(sizes: CheckpointSizes, rows: Sequence[RowCost], *, model: str, device: str, compute_dtype: str,
              memory_budget_bytes: int, streaming: str, prefetch: bool = True, prefetch_depth: int = 1,
              bandwidth: Bandwidth,
              compute_flops_per_s: float | None, disk_free_bytes: int | None, checkpoint_is_local: bool,
              runtime_overhead_bytes: int, batch_size: int | None = None,
              context_length: int | None = None, memory_bytes_per_s: float | None = None,
              shared_prefix_tokens: int = 0, decode_rates: Mapping[int, float] | None = None,
              decode_in_place: bool = False, packs_weights: bool = False,
              layer_call_seconds: float = 0.0, compute_threads: int = 1) -> Candidate:
    """How to run `rows` through the model within a memory budget, and how long it will take.

    memory_bytes_per_s: how fast a decode-shaped matmul streams weights from RAM (measure.memory_read_rate); without
    it a pass is timed by its FLOPs alone, which undercounts decode passes several times over on a CPU.
    decode_rates: {rows: weight bytes/s} of the checkpoint's own layer matrices (measure.decode_rates), which price
    each decode pass's weights at its row count instead of the memory rate.
    shared_prefix_tokens: prompt tokens all rows start with (batching.shared_prefix_tokens). A batch computes them
    once and keeps their KV once, so its sequences are sized, packed and timed by their own tokens.
    decode_in_place: the model's decode steps read each layer's keys and values where they lie, not copied once per
    query head (prepare.plan_rows asks transformers): a decode call then holds far less, so more share it.
    packs_weights: a streamed run's long prefills multiply packed weights (measure.packs_weights), one layer more.
    layer_call_seconds: the fixed cost of one forward call through a decoder layer (measure.layer_call_seconds),
    paid per layer by every call of a pass besides its roofline.
    compute_threads: the threads the rates were measured with; a host streaming with prefetch decodes on one fewer
    (decode_cores_share)."""
    if compute_dtype not in COMPUTE_BYTES:
        raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_BYTES)}, got {compute_dtype!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    policy = parse_streaming(streaming)
    compute_bytes = COMPUTE_BYTES[compute_dtype]
    budget = memory_budget_bytes
    blockers: list[str] = []
    caveats = list(sizes.assumptions)
    if sizes.estimated:
        caveats.append("sizes estimated from config.json, not read from the safetensors headers")

    # Rows: those longer than the context fail on their own (prompts are never truncated) and are not planned.
    planned, sizing_rows = _plannable_rows(rows, context_length or sizes.max_position_embeddings, caveats, blockers)

    # Memory: the weights the mode keeps and the runtime, with at least the largest row beside them.
    row_bytes = [batch_bytes(sizes, compute_bytes, device, sizing_rows, [i]) for i in range(len(sizing_rows))]
    largest_row = max(range(len(sizing_rows)), key=row_bytes.__getitem__)
    largest_row_bytes = row_bytes[largest_row]
    resident = resident_weights(sizes, compute_dtype)
    resident_need = resident.bytes + runtime_overhead_bytes + largest_row_bytes
    resident_sum = (f"{resident.what} + runtime {format_bytes(runtime_overhead_bytes)} + largest row "
                    f"{format_bytes(largest_row_bytes)} = {format_bytes(resident_need)}")
    mode, reason = _choose_mode(policy, resident_need <= budget, resident_sum, budget)
    weights = (resident if mode == "resident"
               else streamed_weights(sizes, compute_dtype, prefetch, device, prefetch_depth, packs_weights))
    fixed_bytes = weights.bytes + runtime_overhead_bytes
    if mode == "streamed" and sizes.quantization:
        blockers.append(f"the checkpoint is quantized ({sizes.quantization}): streaming reads unquantized safetensors "
                        "only (packed weights need their scales); run it resident (--streaming never) if it fits, or "
                        "use an unquantized checkpoint")
    if mode == "resident" and resident_need > budget:
        blockers.append(f"resident run does not fit: {resident_sum}, over the {format_bytes(budget)} budget; "
                        "allow streaming (auto or always)")
    elif fixed_bytes > budget:
        blockers.append(f"does not fit even one layer: {weights.what} + runtime {format_bytes(runtime_overhead_bytes)}"
                        f" = {format_bytes(fixed_bytes)}, over the {format_bytes(budget)} budget")
    elif fixed_bytes + largest_row_bytes > budget:
        blockers.append(f"does not fit even one sequence: the largest row ({sizing_rows[largest_row].tokens():,} "
                        f"tokens) needs {format_bytes(largest_row_bytes)} of KV cache and activations beside "
                        f"{format_bytes(fixed_bytes)} of weights and runtime; budget {format_bytes(budget)}")

    # Batches: the largest that fit beside the weights, packed by the rule the executor uses. A shared prefix is
    # held once per batch (its KV, its activations while it computes); each sequence is sized by its own tokens.
    shared = shared_prefix_tokens
    own_rows = [without_prefix(row, shared) for row in rows]
    prefix_bytes = (kv_bytes_for_sequence(sizes, compute_bytes, shared)
                    + activation_bytes_for_sequence(sizes, compute_bytes, device, shared, 0)
                    + PREFILL_CALL_BYTES  # the prefix's forward call is held too
                    + attention_scratch_bytes(device, compute_bytes, shared)) if shared else 0
    sizing_budget = int(budget * (1 - MEMORY_HEADROOM_SHARE))
    batch_free_bytes = sizing_budget - fixed_bytes - prefix_bytes  # what a batch's sequences may hold
    max_sequences, max_tokens, micro_sequences = batch_limits(
        sizes, compute_bytes, device, [without_prefix(row, shared) for row in sizing_rows], batch_free_bytes,
        batch_size)
    packed = pack_batches([own_rows[i] for i in planned], max_sequences, max_tokens) if planned else []
    batches = [[planned[i] for i in batch] for batch in packed]
    oversize = sum(1 for batch in batches if _padded_tokens(own_rows, batch) > max_tokens)
    if oversize:
        caveats.append(f"{oversize} row(s) larger than the {max_tokens:,}-token batch budget run in a batch of "
                       f"their own (the budget less {MEMORY_HEADROOM_SHARE:.0%} headroom leaves "
                       f"{format_bytes(max(batch_free_bytes, 0))} for sequences beside the weights and runtime; a "
                       "larger --memory batches more rows a pass)")
    # Generation rows run as one queue whose passes refill the places of finished rows (refill.py); choice rows as
    # their batches, one pass each. A pass holds its decoding rows and the rows it admits at once: sized as one batch.
    # Only passes that admit rows need sizing: between admissions rows only leave, and the decode passes' own needs
    # (the whole batch's cache at its longest) are counted below.
    choice_batches = [batch for batch in batches if rows[batch[0]].is_choice]
    generation = [i for batch in batches if not rows[batch[0]].is_choice for i in batch]
    schedule_prefix = shared if shares_prefix(len(generation), max_sequences) else 0
    # Every row, answered in full, inside the smallest window: windowed layers cache as full ones and decode
    # micro-batches merge, as a shared prefix's do (score.GreedyPool.refills)
    decode_merges = bool(schedule_prefix) or inside_windows(
        sizes.sliding_windows, sizes.unplaced_window, max((rows[i].sequence_length() for i in generation), default=0))
    schedule = refill_schedule(own_rows, generation, max_sequences, max_tokens, refill_while_live=decode_merges)
    # (rows held, rows prefilled) of each pass that admits: its prefill calls are the admitted rows' alone
    held_together = [([*p.decoding, *p.admitted], p.admitted) for p in schedule if p.admitted]
    peak_batch_bytes = max([_batch_peak_bytes(sizes, compute_bytes, device, rows, own_rows, b, micro_sequences,
                                              prefix_bytes) for b in choice_batches]
                           + [_batch_peak_bytes(sizes, compute_bytes, device, rows, own_rows, held, micro_sequences,
                                                prefix_bytes, shares=bool(schedule_prefix), prefilling=admitted)
                              for held, admitted in held_together],
                           default=largest_row_bytes)
    passes = len(choice_batches) + len(schedule)

    # Time: load what stays resident once, then each pass takes the slower of reading the layers and computing.
    bytes_per_s = bandwidth.bytes_per_s
    if mode == "streamed" and bytes_per_s is None:
        blockers.append("read bandwidth unknown: measure it (`batchrun disk`) or declare it (--bandwidth)")
    if bandwidth.basis == "assumed" and bytes_per_s is not None:
        caveats.append(f"ETA uses an assumed read bandwidth of {format_rate(bytes_per_s)} ({bandwidth.how})")
    load_bytes = sizes.checkpoint_bytes if mode == "resident" else sizes.non_decoder_bytes
    load_seconds = load_bytes / bytes_per_s if bytes_per_s else None
    io_seconds = 0.0 if mode == "resident" else (
        sizes.decoder_bytes / bytes_per_s / IO_EFFICIENCY[prefetch] if bytes_per_s else None)
    if compute_flops_per_s is None:
        caveats.append("compute rate unknown: " + ("pass times count reads only" if mode == "streamed"
                                                   else "no ETA for a resident run"))
    decode_micro = decode_group_size(sizes, compute_bytes, device, own_rows, planned, shared, micro_sequences,
                                     max_sequences, batch_free_bytes, decode_in_place)
    # A decode pass computes little per layer, so it is read-bound; with the planned depth the reader idles whenever a
    # layer's compute outlasts the next layer's read (they share the cores). Where the memory the prefill's
    # activations held fits another layer slot beside the KV cache, decode passes read one layer further ahead.
    # Measured on 2 cores (3 GB bf16 Llama under a 1.55 GB cap, 32 sequences, 12 new tokens, page cache dropped):
    # median decode pass 2.27 s reading one layer ahead, 2.03 s reading two (3 runs each); as planned, 1.98 -> 1.88 s
    # (3 alternating pairs, each pair faster reading two), peak RSS 1.05 -> 1.17 GB.
    read_ahead = prefetch_depth if mode == "streamed" and prefetch else 0
    decode_depth = read_ahead
    decode_bytes = decode_pass_bytes(sizes, compute_bytes, device, own_rows, planned, shared, decode_micro,
                                     max_sequences, decode_in_place)
    slot_bytes = layer_slot_bytes(sizes, compute_dtype)
    if read_ahead and decode_bytes and decode_bytes + slot_bytes <= batch_free_bytes:
        decode_depth += 1
        peak_batch_bytes = max(peak_batch_bytes, prefix_bytes + decode_bytes + slot_bytes)
    turn_bytes = max([largest_turn_bytes(sizes, compute_bytes, device, rows, own_rows, b, micro_sequences,
                                         decode_micro, shared, decode_in_place) for b in choice_batches]
                     + [largest_turn_bytes(sizes, compute_bytes, device, rows, own_rows, held, micro_sequences,
                                           decode_micro, shared, decode_in_place, prefilling=admitted)
                        for held, admitted in held_together], default=0)
    flops_rate, memory_rate = effective_rates(device, compute_flops_per_s, memory_bytes_per_s)
    weight_rates = ({count: effective_rates(device, None, rate)[1] for count, rate in decode_rates.items()}
                    if decode_rates and memory_rate else None)
    host_traffic = streaming_traffic(sizes, compute_bytes, device, mode)
    timeline = job_timeline(sizes, rows, choice_batches, io_seconds, flops_rate, compute_bytes, memory_rate,
                            shared, (micro_sequences, decode_micro), host_traffic, device, weight_rates,
                            schedule, schedule_prefix, layer_call_seconds,
                            decode_cores_share(sizes, compute_bytes, device, mode, prefetch, compute_threads),
                            decode_merges=decode_merges)
    if mode == "streamed" and timeline.compute_bound_passes:
        caveats.append(f"{timeline.compute_bound_passes} of {passes} passes are compute-bound (long prefills): "
                       "faster reads would not speed those up")
    if sizes.moe and mode == "streamed":
        caveats.append(f"mixture of experts: every layer is read whole ({sizes.moe['num_experts']} experts) though "
                       f"only {sizes.moe['experts_per_token']} run per token; compute counts every expert")
    eta = first_answer = None
    if timeline.known:
        eta = (load_seconds or 0.0) + sum(timeline.pass_seconds)
        first_answer = ((load_seconds or 0.0) + sum(timeline.pass_seconds[:timeline.first_answer_passes])
                        if batches else None)
        if load_seconds is None:
            caveats.append("the time to load the model is not counted (read bandwidth unknown)")

    # Disk: the checkpoint is read in place, so only a download needs room.
    disk_needed = 0 if checkpoint_is_local else sizes.checkpoint_bytes
    if disk_free_bytes is not None and disk_needed > disk_free_bytes:
        blockers.append(f"not enough disk: the checkpoint needs {format_bytes(disk_needed)} downloaded but "
                        f"{format_bytes(disk_free_bytes)} is free")
    return Candidate(
        model=model, mode=mode, reason=reason, device=device, prefetch=prefetch,
        checkpoint_bytes=sizes.checkpoint_bytes, layers=sizes.num_layers,
        largest_layer_bytes=sizes.largest_layer_bytes, non_decoder_bytes=sizes.non_decoder_bytes,
        kv_bytes_per_token=kv_bytes_per_token_per_layer(sizes, compute_bytes) * sizes.num_layers,
        compute_dtype=compute_dtype, memory_budget_bytes=budget, weights_bytes=weights.bytes,
        runtime_overhead_bytes=runtime_overhead_bytes, peak_memory_bytes=fixed_bytes + peak_batch_bytes,
        turn_bytes=turn_bytes,
        batch_size=max_sequences, micro_batch_size=micro_sequences, batch_tokens=max_tokens, batches=batches,
        rows=len(rows), passes=passes,
        lower_bound_passes=lower_bound_passes([rows[i] for i in planned], max_sequences),
        read_bandwidth_bytes_per_s=bytes_per_s, bandwidth_basis=bandwidth.basis, bandwidth_how=bandwidth.how,
        load_seconds=load_seconds, seconds_per_pass=_median(timeline.pass_seconds), io_seconds_per_pass=io_seconds,
        compute_seconds_per_pass=_median(timeline.compute_seconds), memory_bytes_per_s=memory_bytes_per_s,
        eta_seconds=eta,
        first_answer_seconds=first_answer,
        answers_per_hour=len(planned) / eta * 3600 if eta and planned else None,
        disk_needed_bytes=disk_needed, disk_free_bytes=disk_free_bytes, estimated=sizes.estimated,
        blockers=blockers, caveats=caveats, shared_prefix_tokens=shared,
        decode_micro_batch_size=decode_micro, prefetch_depth=read_ahead, decode_in_place=decode_in_place,
        decode_prefetch_depth=decode_depth, pass_seconds=timeline.pass_seconds,
        packs_weights=packs_weights and mode == "streamed",
    )


def _plannable_rows(rows: Sequence[RowCost], context: int | None, caveats: list[str],
                    blockers: list[str]) -> tuple[list[int], list[RowCost]]:
    """(indices of rows within the context, the rows to size memory for). With no such rows, memory is sized
    for one sequence of DEFAULT_SIZING_TOKENS (or the context, if shorter)."""
    planned = [i for i, row in enumerate(rows) if not context or row.sequence_length() <= context]
    if len(planned) < len(rows):
        caveats.append(f"{len(rows) - len(planned)} row(s) longer than the {context:,}-token context will fail "
                       "(prompts are never truncated)")
        if not planned:
            blockers.append(f"every row is longer than the {context:,}-token context")
    if planned:
        return planned, [rows[i] for i in planned]
    stand_in = RowCost(min(context or DEFAULT_SIZING_TOKENS, DEFAULT_SIZING_TOKENS), 1)
    caveats.append(f"no rows to run: memory sized for one sequence of {stand_in.prompt_tokens:,} tokens")
    return planned, [stand_in]


def _choose_mode(policy: str, resident_fits: bool, resident_sum: str, budget: int) -> tuple[str, str]:
    """(mode, reason) for the policy: auto streams only when the resident footprint exceeds the budget."""
    if policy == "always":
        return "streamed", "streaming forced (policy always)"
    if policy == "never":
        return "resident", "streaming off (policy never)"
    if resident_fits:
        return "resident", f"auto: the model fits: {resident_sum}, within the {format_bytes(budget)} budget"
    return "streamed", f"auto: resident needs {resident_sum}, over the {format_bytes(budget)} budget"


def compare_modes(sizes: CheckpointSizes, rows: Sequence[RowCost], **options) -> list[Candidate]:
    """The candidates a user chooses between: resident, streamed with prefetch, streamed without."""
    options = {key: value for key, value in options.items() if key not in ("streaming", "prefetch")}
    return [make_plan(sizes, rows, streaming="never", **options),
            make_plan(sizes, rows, streaming="always", prefetch=True, **options),
            make_plan(sizes, rows, streaming="always", prefetch=False, **options)]


def _batch_peak_bytes(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                      own_rows: Sequence[RowCost], batch: Sequence[int], micro_sequences: int | None,
                      prefix_bytes: int, shares: bool | None = None, prefilling: Sequence[int] | None = None) -> int:
    """A batch of several sequences shares the prefix (own tokens + the prefix once); one sequence has it all.
    `shares`: whether these rows share it whatever their number (a refilled pass, score.GreedyPool).
    `prefilling`: the rows whose prompts the pass prefills (plan_memory.batch_bytes)."""
    if prefix_bytes and (batch_shape(rows, batch)[0] > 1 if shares is None else shares):
        return batch_bytes(sizes, compute_bytes, device, own_rows, batch, micro_sequences, prefilling) + prefix_bytes
    return batch_bytes(sizes, compute_bytes, device, rows, batch, micro_sequences, prefilling)


def _padded_tokens(rows: Sequence[RowCost], batch: Sequence[int]) -> int:
    sequences, longest, _, _ = batch_shape(rows, batch)
    return sequences * longest


def _median(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None
