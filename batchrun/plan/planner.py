"""Offload arithmetic as named steps: the mode and the memory it fixes (mode.py), the batches and their passes
(passes.py), the pass bound (bound.py), what the passes hold at their peak, the time and the disk; each step returns
its result and what it says of the job (caveats, blockers). No torch.

Each intermediate is named and says where its number comes from; the activation coefficients are first estimates,
kept at the top of plan/memory.py so measurement can calibrate them.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from batchrun.checkpoint import CheckpointSizes, kv_bytes_per_token_per_layer
from batchrun.plan.batching import RowCost, batch_shape, lower_bound_passes, without_prefix
from batchrun.plan.bound import Bounded, bound_notes, bound_passes
from batchrun.plan.candidate import Candidate, PlanBatching, PlanBound, PlanCheckpoint, PlanMemory, PlanTime
from batchrun.plan.formatting import format_bytes, format_rate
from batchrun.plan.inputs import Notes, PlanInputs
from batchrun.plan.memory import Calls, batch_bytes, decode_pass_bytes, largest_turn_bytes
from batchrun.plan.mode import Fixed, fixed_memory, parse_streaming
from batchrun.plan.passes import (Packing, Schedule, decode_calls, dequantize_seconds, pack, read_times,
                                  schedule_passes, time_passes)
from batchrun.plan.records import PlanRequest, Rates
from batchrun.plan.timing import Timeline
from batchrun.plan.weights import COMPUTE_BYTES, TokenMatrices, held_layer_bytes, holds_blocks

__all__ = ["compare_modes", "make_plan"]

# With no rows to size, memory is reported for one sequence of this many tokens (or the context, if shorter).
DEFAULT_SIZING_TOKENS = 4096


def make_plan(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates, *,
              shared_prefix_tokens: int = 0, decode_in_place: bool = False) -> Candidate:
    """How to run `rows` through the model within request's memory budget, and how long it will take at `rates`.

    shared_prefix_tokens: prompt tokens all rows start with (batching.shared_prefix_tokens). A batch computes them
    once and keeps their KV once, so its sequences are sized, packed and timed by their own tokens.
    decode_in_place: the model's decode steps read each layer's keys and values where they lie, not copied once per
    query head (prepare.plan_rows asks transformers): a decode call then holds far less, so more share it."""
    job, started = _start(sizes, rows, request, rates, shared_prefix_tokens, decode_in_place)
    # Rows: those longer than the context fail on their own (prompts are never truncated) and are not planned.
    planned, sizing_rows, rows_notes = _plannable_rows(rows, request.context_length or sizes.max_position_embeddings)
    fixed, fixed_notes = fixed_memory(job, sizing_rows)
    packing, packing_notes = pack(job, fixed, planned, sizing_rows)
    bounded = bound_passes(job, fixed, packing)
    scheduled = schedule_passes(job, bounded.packing)
    peak = _peak(job, fixed, bounded.packing, scheduled)
    time, time_notes = _time(job, fixed, bounded.packing, scheduled, peak, bounded.timeline)
    notes = (started + rows_notes + fixed_notes + packing_notes + bounded.notes + time_notes
             + bound_notes(fixed.mode, bounded.bound, time.timeline) + _disk_notes(job))
    return _candidate(job, fixed, bounded, scheduled, peak, time, notes)


def compare_modes(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates,
                  **job) -> list[Candidate]:
    """The candidates a user chooses between: resident, streamed with prefetch, streamed without."""
    return [make_plan(sizes, rows, replace(request, streaming="never"), rates, **job),
            make_plan(sizes, rows, replace(request, streaming="always", prefetch=True), rates, **job),
            make_plan(sizes, rows, replace(request, streaming="always", prefetch=False), rates, **job)]


def _start(sizes: CheckpointSizes, rows: Sequence[RowCost], request: PlanRequest, rates: Rates,
           shared: int, decode_in_place: bool) -> tuple[PlanInputs, Notes]:
    """The request checked, and the notes every plan starts with (what the checkpoint's sizes assume)."""
    if request.compute_dtype not in COMPUTE_BYTES:
        raise ValueError(f"compute_dtype must be one of {sorted(COMPUTE_BYTES)}, got {request.compute_dtype!r}")
    if request.batch_size is not None and request.batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {request.batch_size}")
    policy = parse_streaming(request.streaming)
    caveats = list(sizes.assumptions)
    if sizes.estimated:
        caveats.append("sizes estimated from config.json, not read from the safetensors headers")
    job = PlanInputs(sizes, rows, [without_prefix(row, shared) for row in rows], request, rates, policy,
                     COMPUTE_BYTES[request.compute_dtype], shared, decode_in_place)
    return job, Notes(caveats=tuple(caveats))


def _plannable_rows(rows: Sequence[RowCost], context: int | None) -> tuple[list[int], list[RowCost], Notes]:
    """(indices of rows within the context, the rows to size memory for, what that says of the job). With no such
    rows, memory is sized for one sequence of DEFAULT_SIZING_TOKENS (or the context, if shorter)."""
    planned = [i for i, row in enumerate(rows) if not context or row.sequence_length() <= context]
    caveats, blockers = [], []
    if len(planned) < len(rows):
        caveats.append(f"{len(rows) - len(planned)} row(s) longer than the {context:,}-token context will fail "
                       "(prompts are never truncated)")
        if not planned:
            blockers.append(f"every row is longer than the {context:,}-token context")
    if planned:
        return planned, [rows[i] for i in planned], Notes(tuple(caveats), tuple(blockers))
    stand_in = RowCost(min(context or DEFAULT_SIZING_TOKENS, DEFAULT_SIZING_TOKENS), 1)
    caveats.append(f"no rows to run: memory sized for one sequence of {stand_in.prompt_tokens:,} tokens")
    return planned, [stand_in], Notes(tuple(caveats), tuple(blockers))


@dataclass(frozen=True)
class _Peak:
    """What the passes hold at most beside the fixed memory, and the decode calls and read-ahead sized in it."""
    batch_bytes: int
    calls: Calls
    read_ahead: int  # layers a prefill reads ahead
    decode_depth: int  # layers a decode pass reads ahead
    turn_bytes: int


def _peak(job: PlanInputs, fixed: Fixed, packing: Packing, scheduled: Schedule) -> _Peak:
    """The most the passes hold beside the fixed memory: the largest batch or admitting pass, or a decode pass that
    reads one layer further ahead.

    A decode pass computes little per layer, so it is read-bound; with the planned depth the reader idles whenever a
    layer's compute outlasts the next layer's read (they share the cores). Where the memory the prefill's activations
    held fits another layer slot beside the KV cache, decode passes read one layer further ahead
    (docs/streaming.md#what-bounds-a-pass)."""
    peak_batch_bytes = _largest_batch_bytes(job, packing, scheduled, default=fixed.largest_row_bytes,
                                            interleaved=fixed.mode == "streamed")
    calls = decode_calls(job, packing)
    request = job.request
    read_ahead = request.prefetch_depth if fixed.mode == "streamed" and request.prefetch else 0
    decode_depth = read_ahead
    decode_bytes = decode_pass_bytes(job.sizes, job.compute_bytes, job.device, job.own_rows, packing.planned, calls)
    slot_bytes = held_layer_bytes(job.sizes, request.compute_dtype, job.device)
    if read_ahead and decode_bytes and decode_bytes + slot_bytes <= packing.free_bytes:
        decode_depth += 1
        peak_batch_bytes = max(peak_batch_bytes, packing.prefix_bytes + decode_bytes + slot_bytes)
    return _Peak(peak_batch_bytes, calls, read_ahead, decode_depth,
                 _turn_bytes(job, scheduled, replace(calls, interleaved=fixed.mode == "streamed")))


def _largest_batch_bytes(job: PlanInputs, packing: Packing, scheduled: Schedule, default: int,
                         interleaved: bool) -> int:
    """The most a choice batch or a pass that admits rows holds (its sequences, the shared prefix once);
    `interleaved`: its calls take turns at each layer (a streamed model: plan.memory.batch_bytes)."""
    micro, prefix_bytes = packing.micro_sequences, packing.prefix_bytes
    return max([_batch_peak_bytes(job, b, micro, prefix_bytes, interleaved=interleaved)
                for b in scheduled.choice_batches]
               + [_batch_peak_bytes(job, held, micro, prefix_bytes, shares=bool(scheduled.prefix), prefilling=admitted,
                                    interleaved=interleaved)
                  for held, admitted in scheduled.held_together],
               default=default)


def _turn_bytes(job: PlanInputs, scheduled: Schedule, calls: Calls) -> int:
    """The most one forward call's turn at a layer takes in any pass (plan.memory.largest_turn_bytes)."""
    def turn(batch: Sequence[int], prefilling: Sequence[int] | None = None) -> int:
        return largest_turn_bytes(job.sizes, job.compute_bytes, job.device, job.rows, job.own_rows, batch, calls,
                                  prefilling=prefilling)

    return max([turn(b) for b in scheduled.choice_batches]
               + [turn(held, admitted) for held, admitted in scheduled.held_together], default=0)


def _batch_peak_bytes(job: PlanInputs, batch: Sequence[int], micro_sequences: int | None, prefix_bytes: int,
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



@dataclass(frozen=True)
class _Time:
    """How long the job takes: loading what stays resident, reading the layers a pass, every pass, the ETA."""
    load_seconds: float | None
    io_seconds: float | None
    timeline: Timeline
    eta: float | None
    first_answer: float | None


def _time(job: PlanInputs, fixed: Fixed, packing: Packing, scheduled: Schedule, peak: _Peak,
          timed: Timeline | None = None) -> tuple[_Time, Notes]:
    """Load what stays resident once, then each pass takes the slower of reading the layers and computing.
    `timed`: these batches' timeline, where the pass bound timed them already."""
    mode = fixed.mode
    (load_seconds, io_seconds), read_notes = _read_seconds(job, mode, fixed.placement)
    caveats = []
    if job.rates.compute_flops_per_s is None:
        caveats.append("compute rate unknown: " + ("pass times count reads only" if mode == "streamed"
                                                   else "no ETA for a resident run"))
    timeline = timed or time_passes(job, mode, scheduled, peak.calls, io_seconds)
    if mode == "streamed":
        caveats += _compute_bound_caveat(timeline, scheduled.pass_count)
    moe = job.sizes.moe
    if moe and mode == "streamed":
        caveats.append(f"mixture of experts: every layer is read whole ({moe['num_experts']} experts) though "
                       f"only {moe['experts_per_token']} run per token; compute counts every expert")
    eta = first_answer = None
    if timeline.known:
        eta = (load_seconds or 0.0) + sum(timeline.pass_seconds)
        first_answer = ((load_seconds or 0.0) + sum(timeline.pass_seconds[:timeline.first_answer_passes])
                        if packing.batches else None)
        if load_seconds is None:
            caveats.append("the time to load the model is not counted (read bandwidth unknown)")
    return _Time(load_seconds, io_seconds, timeline, eta, first_answer), read_notes + Notes(caveats=tuple(caveats))


def _compute_bound_caveat(timeline: Timeline, passes: int) -> list[str]:
    """A streamed pass that computes longer than it reads gains nothing from a faster disk: say how many do, and
    which kind, since a long prefill and a decode step of a small model are compute-bound for different reasons."""
    kinds = [(timeline.compute_bound_prefills, "with prefills"), (timeline.compute_bound_decodes, "decode only")]
    counted = [f"{count:,} {what}" for count, what in kinds if count]
    if not counted:
        return []
    return [f"{sum(count for count, _ in kinds):,} of {passes:,} passes are compute-bound "
            f"({', '.join(counted)}): faster reads would not speed those up"]


def _read_seconds(job: PlanInputs, mode: str,
                  placement: TokenMatrices) -> tuple[tuple[float | None, float | None], Notes]:
    """(seconds to load what stays resident, seconds to read the streamed layers once a pass), with what the plan
    says of the bandwidth they assume."""
    bandwidth = job.rates.bandwidth
    bytes_per_s = bandwidth.bytes_per_s
    caveats, blockers = (), ()
    if mode == "streamed" and bytes_per_s is None:
        blockers = ("read bandwidth unknown: measure it (`batchrun disk`) or declare it (--bandwidth)",)
    if bandwidth.basis == "assumed" and bytes_per_s is not None:
        caveats = (f"ETA uses an assumed read bandwidth of {format_rate(bytes_per_s)} ({bandwidth.how})",)
    decoding = dequantize_seconds(job, job.sizes.layer_params_by_type)
    if mode == "streamed" and decoding and holds_blocks(job.sizes, job.device):
        caveats += (f"the GGUF's layers stay quantized in memory and every forward call dequantizes them into "
                    f"{job.request.compute_dtype} as it multiplies ({decoding:.2g} s a call at this machine's rates)",)
    elif mode == "streamed" and decoding:
        caveats += (f"a pass's reads include dequantizing the GGUF's layers into {job.request.compute_dtype}: "
                    f"{decoding:.2g} s at this machine's rates",)
    return read_times(job, mode, placement), Notes(caveats, blockers)


def _disk_notes(job: PlanInputs) -> Notes:
    """The checkpoint is read in place, so only a download needs room."""
    free = job.rates.disk_free_bytes
    needed = _disk_needed(job)
    if free is not None and needed > free:
        return Notes(blockers=(f"not enough disk: the checkpoint needs {format_bytes(needed)} downloaded but "
                               f"{format_bytes(free)} is free",))
    return Notes()


def _disk_needed(job: PlanInputs) -> int:
    return 0 if job.request.checkpoint_is_local else job.sizes.checkpoint_bytes


def _candidate(job: PlanInputs, fixed: Fixed, bounded: Bounded, scheduled: Schedule, peak: _Peak, time: _Time,
               notes: Notes) -> Candidate:
    """The steps' results as the one record the CLI prints and the executor runs by."""
    sizes, request, rates = job.sizes, job.request, job.rates
    return Candidate(
        model=request.model, mode=fixed.mode, reason=fixed.reason, device=request.device, prefetch=request.prefetch,
        compute_dtype=request.compute_dtype,
        checkpoint=PlanCheckpoint(
            checkpoint_bytes=sizes.checkpoint_bytes, layers=sizes.num_layers,
            largest_layer_bytes=sizes.largest_layer_bytes, non_decoder_bytes=sizes.non_decoder_bytes,
            kv_bytes_per_token=kv_bytes_per_token_per_layer(sizes, job.compute_bytes) * sizes.num_layers,
            estimated=sizes.estimated, disk_needed_bytes=_disk_needed(job), disk_free_bytes=rates.disk_free_bytes),
        memory=_plan_memory(job, fixed, peak),
        batching=_plan_batching(job, bounded.packing, scheduled, peak),
        time=_plan_time(job, bounded.packing, time),
        bound=_plan_bound(request, bounded, time.timeline),
        blockers=list(notes.blockers), caveats=list(notes.caveats))


def _plan_memory(job: PlanInputs, fixed: Fixed, peak: _Peak) -> PlanMemory:
    rates = job.rates
    return PlanMemory(
        memory_budget_bytes=job.request.memory_budget_bytes, weights_bytes=fixed.weights.bytes,
        runtime_overhead_bytes=rates.runtime_overhead_bytes, peak_memory_bytes=fixed.bytes + peak.batch_bytes,
        turn_bytes=peak.turn_bytes,
        memory_floor=[["runtime", rates.runtime_overhead_bytes - rates.tokenizer_bytes - rates.rows_bytes],
                      *([["tokenizer", rates.tokenizer_bytes]] if rates.tokenizer_bytes else []),
                      *([["job rows", rates.rows_bytes]] if rates.rows_bytes else []),
                      *map(list, fixed.weights.parts)],
        token_matrices=fixed.placement.word, token_matrices_reason=fixed.placement_reason,
        packs_weights=fixed.packs_weights, prefetch_depth=peak.read_ahead, decode_prefetch_depth=peak.decode_depth)


def _plan_batching(job: PlanInputs, packing: Packing, scheduled: Schedule, peak: _Peak) -> PlanBatching:
    return PlanBatching(
        batch_size=packing.max_sequences, micro_batch_size=packing.micro_sequences, batch_tokens=packing.max_tokens,
        batches=packing.batches, rows=len(job.rows), passes=scheduled.pass_count,
        lower_bound_passes=lower_bound_passes([job.rows[i] for i in packing.planned], packing.max_sequences),
        shared_prefix_tokens=job.shared, decode_micro_batch_size=peak.calls.decode_group,
        windows_as_full=scheduled.windows_as_full, decode_in_place=job.decode_in_place)


def _plan_time(job: PlanInputs, packing: Packing, time: _Time) -> PlanTime:
    rates, timeline, eta, planned = job.rates, time.timeline, time.eta, packing.planned
    return PlanTime(
        read_bandwidth_bytes_per_s=rates.bandwidth.bytes_per_s, bandwidth_basis=rates.bandwidth.basis,
        bandwidth_how=rates.bandwidth.how, memory_bytes_per_s=rates.memory_bytes_per_s,
        load_seconds=time.load_seconds, seconds_per_pass=_median(timeline.pass_seconds),
        io_seconds_per_pass=time.io_seconds, compute_seconds_per_pass=_median(timeline.compute_seconds),
        eta_seconds=eta, first_answer_seconds=time.first_answer,
        answers_per_hour=len(planned) / eta * 3600 if eta and planned else None, pass_seconds=timeline.pass_seconds)


def _plan_bound(request: PlanRequest, bounded: Bounded, timeline: Timeline) -> PlanBound:
    bound = bounded.bound if timeline.known else None
    return PlanBound(
        pass_bound_seconds=request.pass_seconds,
        longest_pass_seconds=max(timeline.pass_seconds) if timeline.known and timeline.pass_seconds else None,
        unbounded_passes=bound.unbounded_passes if bound else None,
        bound_cost_seconds=sum(timeline.pass_seconds) - bound.unbounded_seconds if bound else None)


def _median(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None
