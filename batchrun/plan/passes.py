"""The plan's passes: the batches packed beside the fixed memory, the passes they run as (a refilled queue for the
generation rows), the forward calls a pass is cut into, and the time those passes take. No torch."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from batchrun.plan.batching import RowCost, batch_shape, inside_windows, pack_batches, without_prefix
from batchrun.plan.formatting import format_bytes
from batchrun.plan.inputs import MEMORY_HEADROOM_SHARE, Notes, PlanInputs
from batchrun.plan.memory import Calls, batch_limits, decode_group_size
from batchrun.plan.mode import Fixed
from batchrun.plan.rates import decode_cores_share, effective_rates, streaming_traffic
from batchrun.plan.refill import ScheduledPass, refill_schedule, shares_prefix
from batchrun.plan.timing import PassPricing, Timeline, job_timeline
from batchrun.plan.weights import HELD, TokenMatrices, head_read_bytes, holds_blocks, token_matrix_bytes

# Share of the measured cold read bandwidth a streamed pass achieves. `batchrun disk` measures reads made the way the
# streamer makes them, and with a prefetch thread the disk never idles during an I/O-bound pass, so nothing is lost
# (the published design's 0.85 would overstate pass times). Without prefetch each layer's compute waits for its read
# (published: 0.70).
IO_EFFICIENCY = {True: 1.0, False: 0.70}


@dataclass(frozen=True)
class Packing:
    """The batches, packed by the rule the executor uses, and the limits they were packed under."""
    planned: list[int]  # rows within the context
    prefix_bytes: int  # the shared prefix, held once per batch
    free_bytes: int  # what a batch's sequences may hold beside the weights, the runtime and the prefix
    max_sequences: int
    max_tokens: int
    micro_sequences: int | None
    batches: list[list[int]]


@dataclass(frozen=True)
class Schedule:
    """Choice rows run as their batches, one pass each; generation rows as one refilled queue (refill.py)."""
    choice_batches: list[list[int]]
    passes: list[ScheduledPass]
    prefix: int  # prompt tokens the scheduled passes share (0 where a pass holds one row)
    decode_merges: bool  # decode micro-batches merge (job_timeline)
    windows_as_full: bool  # the generation rows fit inside the smallest sliding window (PlanBatching.windows_as_full)
    held_together: list[tuple[list[int], list[int]]]  # (rows held, rows prefilled) of each pass that admits

    @property
    def pass_count(self) -> int:
        return len(self.choice_batches) + len(self.passes)


def pack(job: PlanInputs, fixed: Fixed, planned: list[int],
         sizing_rows: Sequence[RowCost]) -> tuple[Packing, Notes]:
    """The largest batches that fit beside the weights, packed by the rule the executor uses; each sequence is sized
    by its own tokens (a shared prefix is held once per batch)."""
    prefix_bytes = job.prefix_bytes()
    free_bytes = job.sizing_budget - fixed.bytes - prefix_bytes  # what a batch's sequences may hold
    max_sequences, max_tokens, micro_sequences = batch_limits(
        job.sizes, job.compute_bytes, job.device, [without_prefix(row, job.shared) for row in sizing_rows],
        free_bytes, job.request.batch_size)
    own_rows = job.own_rows
    packed = pack_batches([own_rows[i] for i in planned], max_sequences, max_tokens) if planned else []
    batched = [[planned[i] for i in batch] for batch in packed]
    oversize = sum(1 for batch in batched if _padded_tokens(own_rows, batch) > max_tokens)
    caveats = ()
    if oversize:
        caveats = (f"{oversize} row(s) larger than the {max_tokens:,}-token batch budget run in a batch of "
                   f"their own (the budget less {MEMORY_HEADROOM_SHARE:.0%} headroom leaves "
                   f"{format_bytes(max(free_bytes, 0))} for sequences beside the weights and runtime; a "
                   "larger --memory batches more rows a pass)",)
    return (Packing(planned, prefix_bytes, free_bytes, max_sequences, max_tokens, micro_sequences, batched),
            Notes(caveats=caveats))


def schedule_passes(job: PlanInputs, packing: Packing) -> Schedule:
    """Generation rows run as one queue whose passes refill the places of finished rows (refill.py); choice rows as
    their batches, one pass each. A pass holds its decoding rows and the rows it admits at once: sized as one batch.
    Only passes that admit rows need sizing: between admissions rows only leave, and the decode passes' own needs
    (the whole batch's cache at its longest) are counted apart (planner's peak step)."""
    rows, max_sequences = job.rows, packing.max_sequences
    choice_batches = [batch for batch in packing.batches if rows[batch[0]].is_choice]
    generation = [i for batch in packing.batches if not rows[batch[0]].is_choice for i in batch]
    prefix = job.shared if shares_prefix(len(generation), max_sequences) else 0
    # Every row, answered in full, inside the smallest window: windowed layers cache as full ones and decode
    # micro-batches merge, as a shared prefix's do (score.GreedyPool.refills)
    windows_as_full = inside_windows(job.sizes.sliding_windows, job.sizes.unplaced_window,
                                     max((rows[i].sequence_length() for i in generation), default=0))
    decode_merges = bool(prefix) or windows_as_full
    passes = refill_schedule(job.own_rows, generation, max_sequences, packing.max_tokens,
                             refill_while_live=decode_merges)
    # (rows held, rows prefilled) of each pass that admits: its prefill calls are the admitted rows' alone
    held_together = [([*p.decoding, *p.admitted], p.admitted) for p in passes if p.admitted]
    return Schedule(choice_batches, passes, prefix, decode_merges, windows_as_full, held_together)


def decode_calls(job: PlanInputs, packing: Packing) -> Calls:
    """How passes are cut into calls: the prefill's micro-batches, and decode calls as large as memory allows."""
    calls = Calls(packing.micro_sequences, packing.max_sequences, None, job.shared, job.decode_in_place)
    decode_group = decode_group_size(job.sizes, job.compute_bytes, job.device, job.own_rows, packing.planned, calls,
                                     packing.free_bytes)
    return replace(calls, decode_group=decode_group)


def time_passes(job: PlanInputs, mode: str, scheduled: Schedule, calls: Calls,
                io_seconds: float | None) -> Timeline:
    """Every pass of the schedule timed (timing.job_timeline) at the rates the device achieves."""
    return job_timeline(_pricing(job, mode, calls), job.rows, scheduled.choice_batches, io_seconds,
                        shared_prefix=job.shared, schedule=scheduled.passes, schedule_prefix=scheduled.prefix,
                        decode_merges=scheduled.decode_merges, own_rows=job.own_rows)


def read_times(job: PlanInputs, mode: str, placement: TokenMatrices = HELD) -> tuple[float | None, float | None]:
    """(seconds to load what stays resident, seconds a pass reads): its layers, and the head where it streams. A
    GGUF model's weights are dequantized on the reader's thread as they load, so that time is the reads' too, except
    for a streamed layer that holds its matrices as blocks: those are dequantized by each call (_pricing)."""
    bytes_per_s = job.rates.bandwidth.bytes_per_s
    sizes = job.sizes
    not_loaded = head_read_bytes(sizes, placement) + (
        token_matrix_bytes(sizes) if placement.gather_embeddings and not sizes.tied_embeddings else 0)
    load_bytes = sizes.checkpoint_bytes if mode == "resident" else sizes.non_decoder_bytes - not_loaded
    layers_decode = dequantize_seconds(job, sizes.layer_params_by_type)
    load_decode = dequantize_seconds(job, sizes.non_decoder_params_by_type) + (layers_decode if mode == "resident"
                                                                                 else 0.0)
    if holds_blocks(sizes, job.device):
        layers_decode = 0.0
    load_seconds = load_bytes / bytes_per_s + load_decode if bytes_per_s else None
    pass_bytes = sizes.decoder_bytes + head_read_bytes(sizes, placement)
    io_seconds = 0.0 if mode == "resident" else (
        pass_bytes / bytes_per_s / IO_EFFICIENCY[job.request.prefetch] + layers_decode if bytes_per_s else None)
    return load_seconds, io_seconds


def dequantize_seconds(job: PlanInputs, params_by_type: dict[str, int]) -> float:
    """Seconds to dequantize a GGUF's weights (`params_by_type`: weights by ggml type) at the measured rates."""
    rates = job.rates.dequantize_weights_per_s
    return sum(count / rates[ggml_type] for ggml_type, count in params_by_type.items() if rates.get(ggml_type))


def _pricing(job: PlanInputs, mode: str, calls: Calls) -> PassPricing:
    """The rates a pass achieves on the device (effective_rates), and how the plan cuts it into calls."""
    sizes, compute_bytes, device, rates = job.sizes, job.compute_bytes, job.device, job.rates
    flops_rate, memory_rate = effective_rates(device, rates.compute_flops_per_s, rates.memory_bytes_per_s)
    weight_rates = ({count: effective_rates(device, None, rate)[1] for count, rate in rates.decode_rates.items()}
                    if rates.decode_rates and memory_rate else None)
    # A streamed layer holding its matrices as GGUF blocks dequantizes them in every forward call through it.
    layer_call_seconds = rates.layer_call_seconds + (
        dequantize_seconds(job, sizes.layer_params_by_type) / sizes.num_layers
        if mode == "streamed" and holds_blocks(sizes, device) else 0.0)
    return PassPricing(
        sizes, compute_bytes, device, flops_rate, memory_rate, weight_rates, layer_call_seconds,
        decode_cores_share(sizes, compute_bytes, device, mode, job.request.prefetch, rates.compute_threads),
        (calls.micro_sequences, calls.decode_group), streaming_traffic(sizes, compute_bytes, device, mode))


def _padded_tokens(rows: Sequence[RowCost], batch: Sequence[int]) -> int:
    sequences, longest, _, _ = batch_shape(rows, batch)
    return sequences * longest
