"""Time arithmetic of the plan, as named steps: FLOPs and memory traffic of each pass, its roofline, and the
timeline of a job. No torch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from batchrun.checkpoint import CheckpointSizes, attended_positions, kv_bytes_for_sequence
from batchrun.plan.batching import (RowCost, batch_shape, prefill_call_count, prefill_calls, prefill_groups,
                                    without_prefix)
from batchrun.plan.refill import ScheduledPass

# A decode pass streams every weight from RAM once, so below a few dozen sequences it runs at the speed of memory,
# not of the matmul units. The KV cache moves once more: attention reads it. Appending the token writes in place
# (caches.RoomyLayer), and transformers' SDPA decodes grouped-query heads packed (pack_gqa), without expanding K and
# V to every query head.
KV_COPIES_PER_DECODE = 1
# A host streaming a layer moves it through RAM besides the disk read: the kernel copies it out of the page cache
# (read + write), and a checkpoint narrower than the compute dtype is widened in its slot (read + a wider write).
# That traffic shares the memory bus with the pass's own compute. A decode pass leaves the linear weights narrow and
# widens them tile by tile inside the matmul (stream.run_pass, linear_kernels.widening_linear): the copy only, and
# matmuls about as fast as on float32 weights from RAM, so their weight term stays as it is.
# See docs/performance.md#host-streaming-traffic.
PAGE_CACHE_COPY_TRAFFIC = 2


def prefill_flops(sizes: CheckpointSizes, sequences: int, prefill_tokens: int, logit_positions: int,
                  context_before: int = 0) -> int:
    """FLOPs of computing prefill_tokens per sequence after context_before tokens already cached."""
    tokens = sequences * prefill_tokens
    matmuls = 2 * sizes.decoder_params * tokens  # multiply-add per weight per token
    head = 2 * sizes.vocab_size * sizes.hidden_size * sequences * logit_positions  # logits only where kept
    attention = (4 * sizes.num_attention_heads * sizes.head_dim * tokens
                 * attended_positions(sizes, context_before + prefill_tokens))
    return matmuls + head + attention


def shared_prefix_flops(sizes: CheckpointSizes, shared_prefix: int) -> int:
    """The prefix a pass computes once for all its sequences: one sequence, no logits kept."""
    return prefill_flops(sizes, 1, shared_prefix, 0) if shared_prefix else 0


def decode_flops(sizes: CheckpointSizes, live_sequences: int, context: int) -> int:
    matmuls = 2 * (sizes.decoder_params + sizes.vocab_size * sizes.hidden_size) * live_sequences
    attention = 4 * sizes.num_attention_heads * sizes.head_dim * live_sequences * attended_positions(sizes, context)
    return matmuls + attention


def pass_memory_bytes(sizes: CheckpointSizes, compute_bytes: int, sequences: int, context: int,
                      decode: bool) -> tuple[int, int]:
    """(weight bytes, KV bytes) a pass moves through RAM: every decoder weight and the head once at the compute
    dtype; a prefill writes its KV cache once, a decode pass moves the batch's cache KV_COPIES_PER_DECODE times."""
    weights = (sizes.decoder_params + sizes.vocab_size * sizes.hidden_size) * compute_bytes
    kv = sequences * kv_bytes_for_sequence(sizes, compute_bytes, context)
    return weights, kv * (KV_COPIES_PER_DECODE if decode else 1)


def host_streaming_bytes(sizes: CheckpointSizes, compute_bytes: int, decode: bool = False) -> int:
    """Bytes a host moves through RAM to stream the decoder layers once, beyond the disk read and the matmuls: the
    page-cache copy, and for a prefill the widening of a narrower checkpoint in its slots (a decode pass has none)."""
    copied = sizes.decoder_bytes * PAGE_CACHE_COPY_TRAFFIC
    widened = sizes.decoder_params * compute_bytes
    return copied + (sizes.decoder_bytes + widened if widened > sizes.decoder_bytes and not decode else 0)


def pass_compute_seconds(flops: int, memory: tuple[int, int], flops_per_s: float | None,
                         memory_bytes_per_s: float | None, weights_bytes_per_s: float | None = None) -> float | None:
    """Roofline of one pass: matmuls take the longer of their FLOPs and streaming their weights from RAM (at
    weights_bytes_per_s where the pass's row count has a measured rate, else the memory rate); KV cache traffic adds
    to that. The memory terms count only when the memory rate is known."""
    if flops_per_s is None:
        return None
    if memory_bytes_per_s is None:
        return flops / flops_per_s
    weights, kv = memory
    return max(flops / flops_per_s, weights / (weights_bytes_per_s or memory_bytes_per_s)) + kv / memory_bytes_per_s


def weight_rate_at(rates: Mapping[int, float], rows: int) -> float:
    """Weight bytes/s of a matmul of `rows` rows from the rates measured at a few row counts (measure.decode_rates):
    time per byte interpolated linearly between the nearest two; below the fewest rows, theirs; past the most, time
    per byte grows with the rows, as it does where a matmul turns compute-bound (the FLOP term takes over there)."""
    counts = sorted(rates)
    if rows <= counts[0]:
        return rates[counts[0]]
    if rows >= counts[-1]:
        return rates[counts[-1]] * counts[-1] / rows
    upper = next(count for count in counts if count >= rows)
    lower = counts[counts.index(upper) - 1]
    share = (rows - lower) / (upper - lower)
    return 1 / ((1 - share) / rates[lower] + share / rates[upper])


@dataclass(frozen=True)
class PassPricing:
    """What prices every pass of a job alike: the model at its compute dtype on the device, the rates a pass achieves
    there (rates.effective_rates), and how the plan cuts a pass into calls.

    decode_rates: {rows: weight bytes/s} pricing a decode pass's weights at its row count. micro_batches: sequences
    per (prefill, decode) call, None: one call. streaming_bytes: the host's RAM traffic of streaming the layers in a
    (prefill, decode) pass. decode_cores_share: the share of the cores a decode pass computes on
    (rates.decode_cores_share)."""
    sizes: CheckpointSizes
    compute_bytes: int
    device: str
    flops_per_s: float | None
    memory_bytes_per_s: float | None = None
    decode_rates: Mapping[int, float] | None = None
    layer_call_seconds: float = 0.0
    decode_cores_share: float = 1.0
    micro_batches: tuple[int | None, int | None] = (None, None)
    streaming_bytes: tuple[int, int] = (0, 0)


def prefill_seconds(pricing: PassPricing, rows: Sequence[RowCost], batch: Sequence[int], flops: int,
                    shared_prefix: int, *, computes_prefix: bool = False) -> float | None:
    """The prefill of `batch`'s prompts ( `flops` of it): its micro-batches are cut by length, as the executor cuts
    them, and each reads the layer's weights from memory once. `computes_prefix`: a call of the shared prefix's own
    runs first (its FLOPs are in `flops`)."""
    sequences, _, prefill, _ = batch_shape(rows, batch)
    weights, kv = pass_memory_bytes(pricing.sizes, pricing.compute_bytes, sequences, shared_prefix + prefill, False)
    calls = prefill_call_count(rows, batch, pricing.micro_batches[0], pricing.device)
    compute = pass_compute_seconds(flops, (weights * calls, kv + pricing.streaming_bytes[0]), pricing.flops_per_s,
                                   pricing.memory_bytes_per_s)
    return with_layer_calls(compute, pricing.sizes, calls + computes_prefix, pricing.layer_call_seconds)


def decode_seconds(pricing: PassPricing, live: int, context: int, calls: int | None = None, *,
                   beside_prefill: bool = False) -> float | None:
    """One decode step of `live` sequences at `context` tokens, in calls of the pricing's decode micro-batch (None:
    one call), its roofline computed on decode_cores_share of the cores the rates were measured on. `calls`: the
    calls the step makes where its micro-batches cannot merge (job_timeline), instead of the regrouped ones.
    `beside_prefill`: the pass prefills too, so it streams the layers as a prefill does and computes on every core."""
    sizes = pricing.sizes
    weights, kv = pass_memory_bytes(sizes, pricing.compute_bytes, live, context, True)
    group = pricing.micro_batches[1]
    calls = calls or (math.ceil(live / group) if group else 1)
    decode_rates = pricing.decode_rates
    weights_rate = weight_rate_at(decode_rates, math.ceil(live / calls)) if decode_rates else None
    streamed = 0 if beside_prefill else pricing.streaming_bytes[1]
    compute = pass_compute_seconds(decode_flops(sizes, live, context), (weights * calls, kv + streamed),
                                   pricing.flops_per_s, pricing.memory_bytes_per_s, weights_rate)
    cores_share = 1.0 if beside_prefill else pricing.decode_cores_share
    # fewer threads take longer over the matmuls and memory traffic; a layer call's Python costs what it costs
    return with_layer_calls(None if compute is None else compute / cores_share, sizes, calls,
                            pricing.layer_call_seconds)


def with_layer_calls(compute_seconds: float | None, sizes: CheckpointSizes, calls: int,
                     layer_call_seconds: float) -> float | None:
    """A pass's compute plus the fixed cost of each forward call through each decoder layer (batchrun.measure's
    layer_call_seconds): the Python and small ops a roofline of matmuls and memory traffic leaves out, most of a
    small model's decode step."""
    if compute_seconds is None:
        return None
    return compute_seconds + sizes.num_layers * calls * layer_call_seconds


def batch_prefill_flops(sizes: CheckpointSizes, rows: Sequence[RowCost], batch: Sequence[int],
                        shared_prefix: int = 0, cut: tuple[int | None, str] | None = None) -> int:
    """FLOPs of a batch's prefill: every prompt (a shared prefix once), padded to the batch's longest, or with `cut`
    (sequences per call, device) to the longest of each forward call as the executor cuts them (prefill_calls)."""
    return own_prefill_flops(sizes, rows, batch, shared_prefix, cut) + shared_prefix_flops(sizes, shared_prefix)


def own_prefill_flops(sizes: CheckpointSizes, rows: Sequence[RowCost], batch: Sequence[int], context_before: int,
                      cut: tuple[int | None, str] | None) -> int:
    """The prefill's FLOPs beside a shared prefix. A CPU cuts even an unplanned prefill by length, so each call is
    padded to its own longest row, not the batch's (docs/planning.md#memory-the-plan-counts)."""
    positions = batch_shape(rows, batch)[3]
    if cut is None:
        sequences, _, prefill, _ = batch_shape(rows, batch)
        return prefill_flops(sizes, sequences, prefill, positions, context_before)
    return sum(prefill_flops(sizes, len(call), max(call), positions, context_before)
               for call in prefill_calls(rows, batch, *cut))


@dataclass(frozen=True)
class Timeline:
    pass_seconds: list[float | None]  # in run order
    compute_seconds: list[float | None]
    first_answer_passes: int  # passes until the first rows are answered
    compute_bound_prefills: int  # passes that prefill and compute longer than they read
    compute_bound_decodes: int  # decode passes (no prompt admitted) that compute longer than they read

    @property
    def known(self) -> bool:
        return None not in self.pass_seconds


def job_timeline(pricing: PassPricing, rows: Sequence[RowCost], batches: Sequence[Sequence[int]],
                 io_seconds: float | None, *, shared_prefix: int = 0, schedule: Sequence[ScheduledPass] = (),
                 schedule_prefix: int = 0, decode_merges: bool = True,
                 own_rows: Sequence[RowCost] | None = None) -> Timeline:
    """Seconds of every pass of the job, in run order: each batch of `batches` (choice rows: one pass each, no
    decoding), then the generation rows' `schedule` (refill.refill_schedule). A batch of several sequences computes
    `shared_prefix` prompt tokens once (prefill.SharedPrefix), one sequence alone its whole prompt; the scheduled
    passes share `schedule_prefix` tokens (score.GreedyPool: 0 where a pass holds one row), computed by their first
    pass. `decode_merges` False: the scheduled passes' micro-batches cannot merge for decoding (sliding-window caches of
    rows longer than the window, decode.merge_for_decode), so each admission's prefill micro-batches decode in a
    call of their own for as long as one of their rows lives. `own_rows`: the rows without the shared prefix, where
    the caller has them."""
    if own_rows is None:
        own_rows = [without_prefix(row, shared_prefix) for row in rows]
    computes = [_batch_pass_seconds(pricing, rows, own_rows, batch, shared_prefix) for batch in batches]
    decodes = [False] * len(computes)  # which passes only decode
    first_answer = 1 if batches else 0
    steps: dict[int, int] = {}  # live row -> tokens it has after the pass before
    scheduled_rows = own_rows if schedule_prefix else rows
    unmerged: list[set[int]] = []  # the live rows of each micro-batch that decodes alone (decode_merges False)
    for index, scheduled in enumerate(schedule):
        calls = len(unmerged) if not decode_merges else None
        computes.append(_scheduled_pass_seconds(pricing, scheduled_rows, scheduled, steps, schedule_prefix,
                                                index == 0, calls))
        decodes.append(not scheduled.admitted)
        if not decode_merges and scheduled.admitted:
            lengths = [scheduled_rows[i].prefill_length() for i in scheduled.admitted]
            unmerged += [{scheduled.admitted[j] for j in group}
                         for group in prefill_groups(lengths, pricing.micro_batches[0], pricing.device)]
        steps.update((i, 0) for i in scheduled.admitted)
        steps = {i: n + 1 for i, n in steps.items()}
        finished = [i for i, n in steps.items() if n >= rows[i].passes()]
        if finished and not first_answer:
            first_answer = index + 1
        for i in finished:
            del steps[i]
        unmerged = [left for left in (members.difference(finished) for members in unmerged) if left]
    passes = [pass_bound(io_seconds, c) for c in computes]
    bound = [c is not None and bool(io_seconds) and c > io_seconds for c in computes]
    bound_decodes = sum(1 for b, decode in zip(bound, decodes) if b and decode)
    return Timeline(passes, computes, first_answer, sum(bound) - bound_decodes, bound_decodes)


def _batch_pass_seconds(pricing: PassPricing, rows: Sequence[RowCost], own_rows: Sequence[RowCost],
                        batch: Sequence[int], shared_prefix: int) -> float | None:
    """A batch's one pass (choice rows): its prefill, the shared prefix once where several sequences share it."""
    shared = shared_prefix if batch_shape(rows, batch)[0] > 1 else 0
    costs = own_rows if shared else rows  # a shared prefix: the rows' own tokens, the prefix once
    flops = batch_prefill_flops(pricing.sizes, costs, batch, shared, (pricing.micro_batches[0], pricing.device))
    return prefill_seconds(pricing, costs, batch, flops, shared, computes_prefix=shared > 0)


def _scheduled_pass_seconds(pricing: PassPricing, rows: Sequence[RowCost], scheduled: ScheduledPass,
                            steps: Mapping[int, int], shared_prefix: int, computes_prefix: bool,
                            decode_calls: int | None = None) -> float | None:
    """A pass that prefills the admitted rows' prompts and decodes one token of the others: the two sets of calls
    one after the other, each as a batch would run it (rows: without the prefix where it is shared). A pass that
    admits nobody is a decode pass on decode_cores_share of the cores; one that prefills computes on all."""
    sizes = pricing.sizes
    seconds = []
    if scheduled.admitted:
        batch = scheduled.admitted
        flops = (own_prefill_flops(sizes, rows, batch, shared_prefix, (pricing.micro_batches[0], pricing.device))
                 + (shared_prefix_flops(sizes, shared_prefix) if computes_prefix else 0))
        seconds.append(prefill_seconds(pricing, rows, batch, flops, shared_prefix,
                                       computes_prefix=computes_prefix and shared_prefix > 0))
    if scheduled.decoding:
        live = len(scheduled.decoding)
        context = shared_prefix + max(rows[i].prefill_length() + steps[i] for i in scheduled.decoding)
        seconds.append(decode_seconds(pricing, live, context, decode_calls,
                                      beside_prefill=bool(scheduled.admitted)))
    return None if None in seconds else sum(seconds)


def pass_bound(io_seconds: float | None, compute_seconds: float | None) -> float | None:
    """max(read the layers, compute); reads alone when the compute rate is unknown. Unknown for a streamed pass
    without a bandwidth, and for a resident one (io 0) without a compute rate."""
    if io_seconds is None:
        return None
    if compute_seconds is None:
        return io_seconds or None
    return max(io_seconds, compute_seconds)
