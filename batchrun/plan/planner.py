"""Offload arithmetic as named steps: memory, batch, passes and time, and the auto/always/never policy. No torch.

Each intermediate is named and says where its number comes from; the activation coefficients are first estimates,
kept at the top of plan/memory.py so measurement can calibrate them.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from batchrun.checkpoint import CheckpointSizes, kv_bytes_for_sequence, kv_bytes_per_token_per_layer
from batchrun.plan.batching import (RowCost, batch_shape, inside_windows, lower_bound_passes, pack_batches, without_prefix)
from batchrun.plan.formatting import format_bytes, format_duration, format_rate
from batchrun.plan.candidate import Candidate
from batchrun.plan.memory import (batch_limits, PREFILL_CALL_BYTES, Calls, activation_bytes_for_sequence,
                                  attention_scratch_bytes, batch_bytes, decode_group_size, decode_pass_bytes,
                                  largest_turn_bytes)
from batchrun.plan.rates import decode_cores_share, effective_rates, streaming_traffic
from batchrun.plan.records import PlanRequest, Rates
from batchrun.plan.refill import ScheduledPass, refill_schedule, shares_prefix
from batchrun.plan.timing import PassPricing, Timeline, job_timeline
from batchrun.plan.weights import (COMPUTE_BYTES, HELD, TokenMatrices, Weights, head_read_bytes, layer_slot_bytes,
                                   resident_weights, streamed_weights, token_matrix_bytes, token_matrix_placements)

__all__ = ["compare_modes", "make_plan", "parse_streaming"]

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
# Batches are sized to leave this share of the budget unused: allocator fragmentation and transient copies are not
# in the arithmetic, and under a hard cap (cgroup) being a little short means an out-of-memory kill.
MEMORY_HEADROOM_SHARE = 0.10
# With no rows to size, memory is reported for one sequence of this many tokens (or the context, if shorter).
DEFAULT_SIZING_TOKENS = 4096
# Passes over the bound are cut by the share the bound is of the longest, a little more (a pass's fixed costs do not
# shrink with its rows), and timed again, at most this many times (a pass's time is about linear in its tokens: two
# rounds usually).
BOUND_MARGIN = 0.95
BOUND_ROUNDS = 12
# Past this share of the job's time the bound's extra passes are called out: a larger bound would cost less.
BOUND_COST_NOTED = 0.10


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


# ---------------------------------------------------------------------------------------------------------------
# The plan, as named steps: the rows it can run, the memory fixed by the mode, the batches, the schedule, what a
# pass holds at its peak, the time, the disk, the candidate


@dataclass(frozen=True)
class _Job:
    """What every step of a plan reads, and the notes (caveats, blockers) the steps add in order."""
    sizes: CheckpointSizes
    rows: Sequence[RowCost]
    own_rows: list[RowCost]  # the rows without the shared prefix
    request: PlanRequest
    rates: Rates
    policy: str  # the streaming policy (parse_streaming)
    compute_bytes: int
    shared: int  # prompt tokens every row starts with
    decode_in_place: bool
    caveats: list[str]
    blockers: list[str]

    @property
    def device(self) -> str:
        return self.request.device


@dataclass(frozen=True)
class _Fixed:
    """The memory a run holds whatever its batches: the weights its mode keeps and the runtime."""
    mode: str  # "resident" | "streamed"
    reason: str
    weights: Weights
    bytes: int  # weights + runtime
    largest_row_bytes: int  # the sizing row that needs the most, alone
    placement: TokenMatrices = HELD  # where a streamed run keeps the embedding and head
    placement_reason: str = ""
    packs_weights: bool = False  # a streamed run's long prefills multiply a packed copy of the layer


@dataclass(frozen=True)
class _Batching:
    """The batches, packed by the rule the executor uses, and the limits they were packed under."""
    planned: list[int]  # rows within the context
    prefix_bytes: int  # the shared prefix, held once per batch
    free_bytes: int  # what a batch's sequences may hold beside the weights, the runtime and the prefix
    max_sequences: int
    max_tokens: int
    micro_sequences: int | None
    batches: list[list[int]]


@dataclass(frozen=True)
class _Schedule:
    """Choice rows run as their batches, one pass each; generation rows as one refilled queue (refill.py)."""
    choice_batches: list[list[int]]
    passes: list[ScheduledPass]
    prefix: int  # prompt tokens the scheduled passes share (0 where a pass holds one row)
    decode_merges: bool  # decode micro-batches merge (job_timeline)
    windows_as_full: bool  # the generation rows fit inside the smallest sliding window (Candidate.windows_as_full)
    held_together: list[tuple[list[int], list[int]]]  # (rows held, rows prefilled) of each pass that admits


@dataclass(frozen=True)
class _Peak:
    """What the passes hold at most beside the fixed memory, and the decode calls and read-ahead sized in it."""
    batch_bytes: int
    calls: Calls
    read_ahead: int  # layers a prefill reads ahead
    decode_depth: int  # layers a decode pass reads ahead
    turn_bytes: int


@dataclass(frozen=True)
class _Bound:
    """The pass bound: what was asked, what passes are held to, and the passes and their time without it."""
    seconds: float
    target: float  # the bound, or what a pass cannot be shorter than where that is longer
    held_by: str | None  # why the target is longer: "read" (a streamed pass reads every layer), "row" (one row a pass)
    unbounded_passes: int
    unbounded_seconds: float


@dataclass(frozen=True)
class _Time:
    """How long the job takes: loading what stays resident, reading the layers a pass, every pass, the ETA."""
    load_seconds: float | None
    io_seconds: float | None
    timeline: Timeline
    eta: float | None
    first_answer: float | None


def make_plan(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates, *,
              shared_prefix_tokens: int = 0, decode_in_place: bool = False) -> Candidate:
    """How to run `rows` through the model within request's memory budget, and how long it will take at `rates`.

    shared_prefix_tokens: prompt tokens all rows start with (batching.shared_prefix_tokens). A batch computes them
    once and keeps their KV once, so its sequences are sized, packed and timed by their own tokens.
    decode_in_place: the model's decode steps read each layer's keys and values where they lie, not copied once per
    query head (prepare.plan_rows asks transformers): a decode call then holds far less, so more share it."""
    job = _start(sizes, rows, request, rates, shared_prefix_tokens, decode_in_place)
    # Rows: those longer than the context fail on their own (prompts are never truncated) and are not planned.
    planned, sizing_rows = _plannable_rows(rows, request.context_length or sizes.max_position_embeddings,
                                           job.caveats, job.blockers)
    fixed = _fixed_memory(job, sizing_rows)
    batching, bound, timed = _bound_passes(job, fixed, _batches(job, fixed, planned, sizing_rows))
    schedule = _schedule(job, batching)
    peak = _peak(job, fixed, batching, schedule)
    time = _time(job, fixed, batching, schedule, peak, timed)
    _bound_notes(job, fixed.mode, bound, time)
    _check_disk(job)
    return _candidate(job, fixed, batching, schedule, peak, time, bound)


def compare_modes(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates,
                  **job) -> list[Candidate]:
    """The candidates a user chooses between: resident, streamed with prefetch, streamed without."""
    return [make_plan(sizes, rows, replace(request, streaming="never"), rates, **job),
            make_plan(sizes, rows, replace(request, streaming="always", prefetch=True), rates, **job),
            make_plan(sizes, rows, replace(request, streaming="always", prefetch=False), rates, **job)]


def _start(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates,
           shared: int, decode_in_place: bool) -> _Job:
    """The request checked, and the notes every plan starts with (what the checkpoint's sizes assume)."""
    if request.compute_dtype not in COMPUTE_BYTES:
        raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_BYTES)}, got {request.compute_dtype!r}")
    if request.batch_size is not None and request.batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {request.batch_size}")
    policy = parse_streaming(request.streaming)
    caveats = list(sizes.assumptions)
    if sizes.estimated:
        caveats.append("sizes estimated from config.json, not read from the safetensors headers")
    return _Job(sizes, rows, [without_prefix(row, shared) for row in rows], request, rates, policy,
                COMPUTE_BYTES[request.compute_dtype], shared, decode_in_place, caveats, [])


def _fixed_memory(job: _Job, sizing_rows: Sequence[RowCost]) -> _Fixed:
    """The mode and the memory it fixes: the weights it keeps and the runtime, with at least the largest row beside
    them."""
    sizes, request, overhead = job.sizes, job.request, job.rates.runtime_overhead_bytes
    budget = request.memory_budget_bytes
    row_bytes = [batch_bytes(sizes, job.compute_bytes, job.device, sizing_rows, [i]) for i in range(len(sizing_rows))]
    largest_row = max(range(len(sizing_rows)), key=row_bytes.__getitem__)
    largest_row_bytes = row_bytes[largest_row]
    resident = resident_weights(sizes, request.compute_dtype)
    resident_need = resident.bytes + overhead + largest_row_bytes
    resident_sum = (f"{resident.what} + runtime {format_bytes(overhead)} + largest row "
                    f"{format_bytes(largest_row_bytes)} = {format_bytes(resident_need)}")
    mode, reason = _choose_mode(job.policy, resident_need <= budget, resident_sum, budget)
    if mode == "streamed":
        placed, why = _placed_weights(job, sizing_rows, largest_row_bytes)
        fixed = _Fixed(mode, reason, placed.weights, placed.weights.bytes + overhead, largest_row_bytes,
                       placed.matrices, why, placed.packs)
    else:
        fixed = _Fixed(mode, reason, resident, resident.bytes + overhead, largest_row_bytes)
    _fit_blockers(job, fixed, resident_need, resident_sum, sizing_rows[largest_row].tokens())
    return fixed


@dataclass(frozen=True)
class _Placement:
    """One way a streamed run may hold its weights, as _placed_weights weighs it."""
    weights: Weights
    matrices: TokenMatrices
    packs: bool  # long prefills multiply a packed copy of the layer (one layer more)
    sequences: int  # what a pass carries beside it; 0: not even one fits
    read: int  # bytes a pass reads

    @property
    def read_per_sequence(self) -> float:
        return self.read / self.sequences if self.sequences else math.inf

    @property
    def word(self) -> str:
        return self.matrices.word + (" + packed layer" if self.packs else "")


def _placed_weights(job: _Job, sizing_rows: Sequence[RowCost], largest_row_bytes: int) -> tuple[_Placement, str]:
    """A streamed run's weights: where the embedding and head stay (weights.token_matrix_placements) and whether long
    prefills pack a copy of the layer (measure.packs_weights). Of the ways asked, the one whose passes read the
    fewest bytes per sequence they carry, the sequences a pass holds being what the budget leaves beside those
    weights (batch_limits, as _batches sizes them): a head held reads nothing a pass but takes its matrix from the
    sequences, streamed every pass reads it once more; a packed layer speeds long prefills where it costs no
    sequence. Equals go to the fewer reads, then to packing."""
    sizes, request = job.sizes, job.request
    overhead = job.rates.runtime_overhead_bytes
    sizing_budget = int(request.memory_budget_bytes * (1 - MEMORY_HEADROOM_SHARE)) - _prefix_bytes(job)
    own_rows = [without_prefix(row, job.shared) for row in sizing_rows]
    weighed: list[_Placement] = []
    for matrices in token_matrix_placements(sizes, request.token_matrices):
        for packs in ((True, False) if job.rates.packs_weights else (False,)):
            weights = streamed_weights(sizes, request.compute_dtype, request.prefetch, job.device,
                                       request.prefetch_depth, packs, matrices)
            fits = weights.bytes + overhead + largest_row_bytes <= request.memory_budget_bytes
            sequences = batch_limits(sizes, job.compute_bytes, job.device, own_rows,
                                     sizing_budget - weights.bytes - overhead, request.batch_size)[0] if fits else 0
            weighed.append(_Placement(weights, matrices, packs, sequences,
                                      sizes.decoder_bytes + head_read_bytes(sizes, matrices)))
    fitting = [w for w in weighed if w.sequences]
    # min keeps the first of equals; where nothing fits, the leanest (the blocker shows the smallest floor)
    chosen = min(fitting, key=lambda w: w.read_per_sequence) if fitting else weighed[-1]
    if len(weighed) == 1:
        return chosen, f"{chosen.word} (asked)"
    others = "; ".join(f"{w.word}: {w.sequences} a pass reading {format_bytes(w.read)}" for w in weighed
                       if w is not chosen)
    return chosen, (f"{chosen.word}: {chosen.sequences} sequence(s) a pass reading {format_bytes(chosen.read)} "
                    f"({others})")


def _fit_blockers(job: _Job, fixed: _Fixed, resident_need: int, resident_sum: str, largest_row_tokens: int) -> None:
    """What stops the mode before any batch: a quantized checkpoint streamed, or memory short of one sequence."""
    budget, overhead = job.request.memory_budget_bytes, job.rates.runtime_overhead_bytes
    if fixed.mode == "streamed" and job.sizes.quantization:
        job.blockers.append(f"the checkpoint is quantized ({job.sizes.quantization}): streaming reads unquantized "
                            "safetensors only (packed weights need their scales); run it resident (--streaming "
                            "never) if it fits, or use an unquantized checkpoint")
    if fixed.mode == "resident" and resident_need > budget:
        job.blockers.append(f"resident run does not fit: {resident_sum}, over the {format_bytes(budget)} budget; "
                            "allow streaming (auto or always)")
    elif fixed.bytes > budget:
        job.blockers.append(f"does not fit even one layer: {fixed.weights.what} + runtime {format_bytes(overhead)}"
                            f" = {format_bytes(fixed.bytes)}, over the {format_bytes(budget)} budget")
    elif fixed.bytes + fixed.largest_row_bytes > budget:
        job.blockers.append(f"does not fit even one sequence: the largest row ({largest_row_tokens:,} "
                            f"tokens) needs {format_bytes(fixed.largest_row_bytes)} of KV cache and activations "
                            f"beside {format_bytes(fixed.bytes)} of weights and runtime; budget {format_bytes(budget)}")


def _prefix_bytes(job: _Job) -> int:
    """A shared prefix is held once per batch: its KV, its activations while it computes, its forward call."""
    shared, compute_bytes = job.shared, job.compute_bytes
    if not shared:
        return 0
    return (kv_bytes_for_sequence(job.sizes, compute_bytes, shared)
            + activation_bytes_for_sequence(job.sizes, compute_bytes, job.device, shared, 0)
            + PREFILL_CALL_BYTES  # the prefix's forward call is held too
            + attention_scratch_bytes(job.device, compute_bytes, shared))


def _batches(job: _Job, fixed: _Fixed, planned: list[int], sizing_rows: Sequence[RowCost]) -> _Batching:
    """The largest batches that fit beside the weights, packed by the rule the executor uses; each sequence is sized
    by its own tokens (a shared prefix is held once per batch)."""
    prefix_bytes = _prefix_bytes(job)
    sizing_budget = int(job.request.memory_budget_bytes * (1 - MEMORY_HEADROOM_SHARE))
    free_bytes = sizing_budget - fixed.bytes - prefix_bytes  # what a batch's sequences may hold
    max_sequences, max_tokens, micro_sequences = batch_limits(
        job.sizes, job.compute_bytes, job.device, [without_prefix(row, job.shared) for row in sizing_rows],
        free_bytes, job.request.batch_size)
    own_rows = job.own_rows
    packed = pack_batches([own_rows[i] for i in planned], max_sequences, max_tokens) if planned else []
    batches = [[planned[i] for i in batch] for batch in packed]
    oversize = sum(1 for batch in batches if _padded_tokens(own_rows, batch) > max_tokens)
    if oversize:
        job.caveats.append(f"{oversize} row(s) larger than the {max_tokens:,}-token batch budget run in a batch of "
                           f"their own (the budget less {MEMORY_HEADROOM_SHARE:.0%} headroom leaves "
                           f"{format_bytes(max(free_bytes, 0))} for sequences beside the weights and runtime; a "
                           "larger --memory batches more rows a pass)")
    return _Batching(planned, prefix_bytes, free_bytes, max_sequences, max_tokens, micro_sequences, batches)


def _bound_passes(job: _Job, fixed: _Fixed,
                  batching: _Batching) -> tuple[_Batching, _Bound | None, Timeline | None]:
    """Batches small enough that no pass is planned longer than the request's bound (a crash loses the pass in
    flight), with the bound and the timeline of those batches. A pass cannot be shorter than a streamed pass's read
    of every layer, nor than one row a pass takes: where the bound is shorter, passes are held to that instead (any
    smaller would cost more passes and save nothing)."""
    bound = job.request.pass_seconds
    if bound is None or not batching.batches:
        return batching, None, None
    io_seconds = _read_times(job, fixed.mode, fixed.placement)[1]
    unbounded = _trial_timeline(job, fixed.mode, batching, io_seconds)
    if not unbounded.known:
        job.caveats.append("pass times unknown: passes are not held to the pass bound")
        return batching, None, unbounded
    read = io_seconds or 0.0
    found = _Bound(bound, max(bound, read), "read" if read > bound else None, len(unbounded.pass_seconds),
                   sum(unbounded.pass_seconds))
    bounded, timeline = _shrunk_to(job, fixed.mode, (batching, unbounded), found.target, io_seconds)
    longest = max(timeline.pass_seconds)
    if longest > found.target and bounded.max_sequences == 1:
        found = replace(found, target=longest, held_by="row")
        bounded, timeline = _shrunk_to(job, fixed.mode, (batching, unbounded), longest, io_seconds)
    return bounded, found, timeline


def _shrunk_to(job: _Job, mode: str, start: tuple[_Batching, Timeline], target: float,
               io_seconds: float | None) -> tuple[_Batching, Timeline]:
    """From `start` (batches and their timeline), limits cut round by round by the share `target` is of the longest
    pass (a little more: a pass's fixed costs do not shrink with its rows) until no pass is longer, or one row a
    pass."""
    batching, timeline = start
    for _ in range(BOUND_ROUNDS):
        longest = max(timeline.pass_seconds)
        if longest <= target or batching.max_sequences == 1:
            break
        batching = _shrunk(job, batching, target / longest * BOUND_MARGIN)
        timeline = _trial_timeline(job, mode, batching, io_seconds)
    return batching, timeline


def _shrunk(job: _Job, batching: _Batching, scale: float) -> _Batching:
    """The batches repacked under limits `scale` times the current ones (at least one sequence fewer)."""
    max_sequences = max(1, min(batching.max_sequences - 1, int(batching.max_sequences * scale)))
    max_tokens = max(1, int(batching.max_tokens * scale))
    micro = batching.micro_sequences
    own_rows, planned = job.own_rows, batching.planned
    packed = pack_batches([own_rows[i] for i in planned], max_sequences, max_tokens)
    return replace(batching, max_sequences=max_sequences, max_tokens=max_tokens,
                   micro_sequences=micro if micro is not None and micro < max_sequences else None,
                   batches=[[planned[i] for i in batch] for batch in packed])


def _trial_timeline(job: _Job, mode: str, batching: _Batching, io_seconds: float | None) -> Timeline:
    """The job's passes timed as _time times them, for batches the plan weighs."""
    return _timeline(job, mode, _schedule(job, batching), _decode_calls(job, batching), io_seconds)


def _bound_notes(job: _Job, mode: str, bound: _Bound | None, time: _Time) -> None:
    """What the bound could not do, and what it costs where that is much."""
    if bound is None or not time.timeline.known:
        return
    passes = time.timeline.pass_seconds
    held = {"read": f"a streamed pass reads every layer ({format_duration(bound.target)})",
            "row": f"one row a pass takes up to {format_duration(bound.target)}"}.get(bound.held_by)
    if held:
        job.caveats.append(f"{held}, longer than the {format_duration(bound.seconds)} pass bound: passes are held "
                           "to that instead")
    over = [seconds for seconds in passes if seconds > bound.target]
    if over:
        job.caveats.append(f"{len(over)} pass(es) are planned longer than the {format_duration(bound.target)} bound "
                           f"(the longest {format_duration(max(over))})")
    extra = sum(passes) - bound.unbounded_seconds
    if bound.unbounded_seconds and extra > BOUND_COST_NOTED * bound.unbounded_seconds:
        reads = " reading every layer again" if mode == "streamed" else ""
        job.caveats.append(f"the pass bound adds {extra / bound.unbounded_seconds:.0%} to the job's time (passes "
                           f"{bound.unbounded_passes:,} -> {len(passes):,}{reads}): a larger --pass-minutes costs "
                           "less, and a crash loses more")


def _schedule(job: _Job, batching: _Batching) -> _Schedule:
    """Generation rows run as one queue whose passes refill the places of finished rows (refill.py); choice rows as
    their batches, one pass each. A pass holds its decoding rows and the rows it admits at once: sized as one batch.
    Only passes that admit rows need sizing: between admissions rows only leave, and the decode passes' own needs
    (the whole batch's cache at its longest) are counted apart (_peak)."""
    rows, max_sequences = job.rows, batching.max_sequences
    choice_batches = [batch for batch in batching.batches if rows[batch[0]].is_choice]
    generation = [i for batch in batching.batches if not rows[batch[0]].is_choice for i in batch]
    prefix = job.shared if shares_prefix(len(generation), max_sequences) else 0
    # Every row, answered in full, inside the smallest window: windowed layers cache as full ones and decode
    # micro-batches merge, as a shared prefix's do (score.GreedyPool.refills)
    windows_as_full = inside_windows(job.sizes.sliding_windows, job.sizes.unplaced_window,
                                     max((rows[i].sequence_length() for i in generation), default=0))
    decode_merges = bool(prefix) or windows_as_full
    passes = refill_schedule(job.own_rows, generation, max_sequences, batching.max_tokens,
                             refill_while_live=decode_merges)
    # (rows held, rows prefilled) of each pass that admits: its prefill calls are the admitted rows' alone
    held_together = [([*p.decoding, *p.admitted], p.admitted) for p in passes if p.admitted]
    return _Schedule(choice_batches, passes, prefix, decode_merges, windows_as_full, held_together)


def _peak(job: _Job, fixed: _Fixed, batching: _Batching, schedule: _Schedule) -> _Peak:
    """The most the passes hold beside the fixed memory: the largest batch or admitting pass, or a decode pass that
    reads one layer further ahead.

    A decode pass computes little per layer, so it is read-bound; with the planned depth the reader idles whenever a
    layer's compute outlasts the next layer's read (they share the cores). Where the memory the prefill's activations
    held fits another layer slot beside the KV cache, decode passes read one layer further ahead
    (docs/streaming.md#what-bounds-a-pass)."""
    peak_batch_bytes = _largest_batch_bytes(job, batching, schedule, default=fixed.largest_row_bytes,
                                            interleaved=fixed.mode == "streamed")
    calls = _decode_calls(job, batching)
    request = job.request
    read_ahead = request.prefetch_depth if fixed.mode == "streamed" and request.prefetch else 0
    decode_depth = read_ahead
    decode_bytes = decode_pass_bytes(job.sizes, job.compute_bytes, job.device, job.own_rows, batching.planned, calls)
    slot_bytes = layer_slot_bytes(job.sizes, request.compute_dtype)
    if read_ahead and decode_bytes and decode_bytes + slot_bytes <= batching.free_bytes:
        decode_depth += 1
        peak_batch_bytes = max(peak_batch_bytes, batching.prefix_bytes + decode_bytes + slot_bytes)
    return _Peak(peak_batch_bytes, calls, read_ahead, decode_depth,
                 _turn_bytes(job, schedule, replace(calls, interleaved=fixed.mode == "streamed")))


def _largest_batch_bytes(job: _Job, batching: _Batching, schedule: _Schedule, default: int,
                         interleaved: bool) -> int:
    """The most a choice batch or a pass that admits rows holds (its sequences, the shared prefix once);
    `interleaved`: its calls take turns at each layer (a streamed model: plan.memory.batch_bytes)."""
    micro, prefix_bytes = batching.micro_sequences, batching.prefix_bytes
    return max([_batch_peak_bytes(job, b, micro, prefix_bytes, interleaved=interleaved)
                for b in schedule.choice_batches]
               + [_batch_peak_bytes(job, held, micro, prefix_bytes, shares=bool(schedule.prefix), prefilling=admitted,
                                    interleaved=interleaved)
                  for held, admitted in schedule.held_together],
               default=default)


def _decode_calls(job: _Job, batching: _Batching) -> Calls:
    """How passes are cut into calls: the prefill's micro-batches, and decode calls as large as memory allows."""
    calls = Calls(batching.micro_sequences, batching.max_sequences, None, job.shared, job.decode_in_place)
    decode_group = decode_group_size(job.sizes, job.compute_bytes, job.device, job.own_rows, batching.planned, calls,
                                     batching.free_bytes)
    return replace(calls, decode_group=decode_group)


def _turn_bytes(job: _Job, schedule: _Schedule, calls: Calls) -> int:
    """The most one forward call's turn at a layer takes in any pass (plan.memory.largest_turn_bytes)."""
    def turn(batch: Sequence[int], prefilling: Sequence[int] | None = None) -> int:
        return largest_turn_bytes(job.sizes, job.compute_bytes, job.device, job.rows, job.own_rows, batch, calls,
                                  prefilling=prefilling)

    return max([turn(b) for b in schedule.choice_batches]
               + [turn(held, admitted) for held, admitted in schedule.held_together], default=0)


def _time(job: _Job, fixed: _Fixed, batching: _Batching, schedule: _Schedule, peak: _Peak,
          timed: Timeline | None = None) -> _Time:
    """Load what stays resident once, then each pass takes the slower of reading the layers and computing.
    `timed`: these batches' timeline, where the pass bound timed them already."""
    mode = fixed.mode
    load_seconds, io_seconds = _read_seconds(job, mode, fixed.placement)
    if job.rates.compute_flops_per_s is None:
        job.caveats.append("compute rate unknown: " + ("pass times count reads only" if mode == "streamed"
                                                       else "no ETA for a resident run"))
    timeline = timed or _timeline(job, mode, schedule, peak.calls, io_seconds)
    passes = len(schedule.choice_batches) + len(schedule.passes)
    if mode == "streamed":
        _compute_bound_caveat(job, timeline, passes)
    moe = job.sizes.moe
    if moe and mode == "streamed":
        job.caveats.append(f"mixture of experts: every layer is read whole ({moe['num_experts']} experts) though "
                           f"only {moe['experts_per_token']} run per token; compute counts every expert")
    eta = first_answer = None
    if timeline.known:
        eta = (load_seconds or 0.0) + sum(timeline.pass_seconds)
        first_answer = ((load_seconds or 0.0) + sum(timeline.pass_seconds[:timeline.first_answer_passes])
                        if batching.batches else None)
        if load_seconds is None:
            job.caveats.append("the time to load the model is not counted (read bandwidth unknown)")
    return _Time(load_seconds, io_seconds, timeline, eta, first_answer)


def _compute_bound_caveat(job: _Job, timeline: Timeline, passes: int) -> None:
    """A streamed pass that computes longer than it reads gains nothing from a faster disk: say how many do, and
    which kind, since a long prefill and a decode step of a small model are compute-bound for different reasons."""
    kinds = [(timeline.compute_bound_prefills, "with prefills"), (timeline.compute_bound_decodes, "decode only")]
    counted = [f"{count:,} {what}" for count, what in kinds if count]
    if counted:
        job.caveats.append(f"{sum(count for count, _ in kinds):,} of {passes:,} passes are compute-bound "
                           f"({', '.join(counted)}): faster reads would not speed those up")


def _timeline(job: _Job, mode: str, schedule: _Schedule, calls: Calls, io_seconds: float | None) -> Timeline:
    return job_timeline(_pricing(job, mode, calls), job.rows, schedule.choice_batches, io_seconds,
                        shared_prefix=job.shared, schedule=schedule.passes, schedule_prefix=schedule.prefix,
                        decode_merges=schedule.decode_merges, own_rows=job.own_rows)


def _read_seconds(job: _Job, mode: str, placement: TokenMatrices) -> tuple[float | None, float | None]:
    """(seconds to load what stays resident, seconds to read the streamed layers once a pass), with what the plan
    says of the bandwidth they assume."""
    bandwidth = job.rates.bandwidth
    bytes_per_s = bandwidth.bytes_per_s
    if mode == "streamed" and bytes_per_s is None:
        job.blockers.append("read bandwidth unknown: measure it (`batchrun disk`) or declare it (--bandwidth)")
    if bandwidth.basis == "assumed" and bytes_per_s is not None:
        job.caveats.append(f"ETA uses an assumed read bandwidth of {format_rate(bytes_per_s)} ({bandwidth.how})")
    return _read_times(job, mode, placement)


def _read_times(job: _Job, mode: str, placement: TokenMatrices = HELD) -> tuple[float | None, float | None]:
    """(seconds to load what stays resident, seconds a pass reads): its layers, and the head where it streams."""
    bytes_per_s = job.rates.bandwidth.bytes_per_s
    sizes = job.sizes
    not_loaded = head_read_bytes(sizes, placement) + (
        token_matrix_bytes(sizes) if placement.gather_embeddings and not sizes.tied_embeddings else 0)
    load_bytes = sizes.checkpoint_bytes if mode == "resident" else sizes.non_decoder_bytes - not_loaded
    load_seconds = load_bytes / bytes_per_s if bytes_per_s else None
    pass_bytes = sizes.decoder_bytes + head_read_bytes(sizes, placement)
    io_seconds = 0.0 if mode == "resident" else (
        pass_bytes / bytes_per_s / IO_EFFICIENCY[job.request.prefetch] if bytes_per_s else None)
    return load_seconds, io_seconds


def _pricing(job: _Job, mode: str, calls: Calls) -> PassPricing:
    """The rates a pass achieves on the device (effective_rates), and how the plan cuts it into calls."""
    sizes, compute_bytes, device, rates = job.sizes, job.compute_bytes, job.device, job.rates
    flops_rate, memory_rate = effective_rates(device, rates.compute_flops_per_s, rates.memory_bytes_per_s)
    weight_rates = ({count: effective_rates(device, None, rate)[1] for count, rate in rates.decode_rates.items()}
                    if rates.decode_rates and memory_rate else None)
    return PassPricing(
        sizes, compute_bytes, device, flops_rate, memory_rate, weight_rates, rates.layer_call_seconds,
        decode_cores_share(sizes, compute_bytes, device, mode, job.request.prefetch, rates.compute_threads),
        (calls.micro_sequences, calls.decode_group), streaming_traffic(sizes, compute_bytes, device, mode))


def _check_disk(job: _Job) -> None:
    """The checkpoint is read in place, so only a download needs room."""
    free = job.rates.disk_free_bytes
    needed = _disk_needed(job)
    if free is not None and needed > free:
        job.blockers.append(f"not enough disk: the checkpoint needs {format_bytes(needed)} downloaded but "
                            f"{format_bytes(free)} is free")


def _disk_needed(job: _Job) -> int:
    return 0 if job.request.checkpoint_is_local else job.sizes.checkpoint_bytes


def _candidate(job: _Job, fixed: _Fixed, batching: _Batching, schedule: _Schedule, peak: _Peak,
               time: _Time, bound: _Bound | None) -> Candidate:
    """The steps' results as the one record the CLI prints and the executor runs by."""
    sizes, request, rates = job.sizes, job.request, job.rates
    planned, eta, timeline = batching.planned, time.eta, time.timeline
    bounded = bound is not None and timeline.known
    return Candidate(
        model=request.model, mode=fixed.mode, reason=fixed.reason, device=request.device, prefetch=request.prefetch,
        checkpoint_bytes=sizes.checkpoint_bytes, layers=sizes.num_layers,
        largest_layer_bytes=sizes.largest_layer_bytes, non_decoder_bytes=sizes.non_decoder_bytes,
        kv_bytes_per_token=kv_bytes_per_token_per_layer(sizes, job.compute_bytes) * sizes.num_layers,
        compute_dtype=request.compute_dtype, memory_budget_bytes=request.memory_budget_bytes,
        weights_bytes=fixed.weights.bytes, runtime_overhead_bytes=rates.runtime_overhead_bytes,
        memory_floor=[["runtime", rates.runtime_overhead_bytes - rates.tokenizer_bytes - rates.rows_bytes],
                      *([["tokenizer", rates.tokenizer_bytes]] if rates.tokenizer_bytes else []),
                      *([["job rows", rates.rows_bytes]] if rates.rows_bytes else []),
                      *map(list, fixed.weights.parts)],
        token_matrices=fixed.placement.word, token_matrices_reason=fixed.placement_reason,
        peak_memory_bytes=fixed.bytes + peak.batch_bytes, turn_bytes=peak.turn_bytes,
        batch_size=batching.max_sequences, micro_batch_size=batching.micro_sequences,
        batch_tokens=batching.max_tokens, batches=batching.batches, rows=len(job.rows),
        passes=len(schedule.choice_batches) + len(schedule.passes),
        lower_bound_passes=lower_bound_passes([job.rows[i] for i in planned], batching.max_sequences),
        read_bandwidth_bytes_per_s=rates.bandwidth.bytes_per_s, bandwidth_basis=rates.bandwidth.basis,
        bandwidth_how=rates.bandwidth.how, load_seconds=time.load_seconds,
        seconds_per_pass=_median(timeline.pass_seconds), io_seconds_per_pass=time.io_seconds,
        compute_seconds_per_pass=_median(timeline.compute_seconds), memory_bytes_per_s=rates.memory_bytes_per_s,
        eta_seconds=eta, first_answer_seconds=time.first_answer,
        answers_per_hour=len(planned) / eta * 3600 if eta and planned else None,
        disk_needed_bytes=_disk_needed(job), disk_free_bytes=rates.disk_free_bytes, estimated=sizes.estimated,
        blockers=job.blockers, caveats=job.caveats, shared_prefix_tokens=job.shared,
        decode_micro_batch_size=peak.calls.decode_group, windows_as_full=schedule.windows_as_full,
        prefetch_depth=peak.read_ahead,
        decode_in_place=job.decode_in_place, decode_prefetch_depth=peak.decode_depth,
        pass_seconds=timeline.pass_seconds, packs_weights=fixed.packs_weights,
        pass_bound_seconds=request.pass_seconds,
        longest_pass_seconds=max(timeline.pass_seconds) if timeline.known and timeline.pass_seconds else None,
        unbounded_passes=bound.unbounded_passes if bounded else None,
        bound_cost_seconds=sum(timeline.pass_seconds) - bound.unbounded_seconds if bounded else None,
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


def _batch_peak_bytes(job: _Job, batch: Sequence[int], micro_sequences: int | None, prefix_bytes: int,
                      shares: bool | None = None, prefilling: Sequence[int] | None = None, *,
                      interleaved: bool = True) -> int:
    """A batch of several sequences shares the prefix (own tokens + the prefix once); one sequence has it all.
    `shares`: whether these rows share it whatever their number (a refilled pass, score.GreedyPool).
    `prefilling`: the rows whose prompts the pass prefills (plan.memory.batch_bytes)."""
    sizes, compute_bytes, device, rows = job.sizes, job.compute_bytes, job.device, job.rows
    if prefix_bytes and (batch_shape(rows, batch)[0] > 1 if shares is None else shares):
        return (batch_bytes(sizes, compute_bytes, device, job.own_rows, batch, micro_sequences, prefilling,
                            interleaved=interleaved) + prefix_bytes)
    return batch_bytes(sizes, compute_bytes, device, rows, batch, micro_sequences, prefilling, interleaved=interleaved)


def _padded_tokens(rows: Sequence[RowCost], batch: Sequence[int]) -> int:
    sequences, longest, _, _ = batch_shape(rows, batch)
    return sequences * longest


def _median(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None
