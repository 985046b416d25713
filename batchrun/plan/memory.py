"""Memory as named steps: what one sequence's activations, a batch and a decode pass hold. No torch.

The coefficients below are first estimates, kept at the top so measurement can calibrate them
(benchmarks/plan_accuracy.py checks them against measured RSS).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from batchrun.checkpoint import CheckpointSizes, kv_bytes_for_sequence, kv_bytes_per_token_per_layer
from batchrun.plan.batching import RowCost, batch_shape, kept_logprobs, prefill_calls

# Activations of one sequence at prefill, the peak of a batch (checked against RSS in benchmarks/plan_accuracy.py):
HIDDEN_STATE_COPIES = 4  # residual stream, normed input, attention output, MLP output live together
MLP_INTERMEDIATE_COPIES = 3  # act(gate), up, and their product live together until down_proj runs
ATTENTION_SCORE_BYTES = 4  # an unfused attention materialises heads x S x S float32 scores...
SCORES_MATERIALISED_ON = frozenset({"mps"})  # ...while torch's SDPA computes them in tiles on CUDA and on CPU
LOGIT_BYTES = 4  # logits are upcast to float32
# glibc malloc keeps some freed activation memory even with host.heap.keep_heap_flat: what a layer turn frees stays in
# the heap until the turn ends and the heap is trimmed, and fragments it meanwhile. Half a copy covers both a
# micro-batched pass and a whole batch in one forward call, which keeps more (docs/performance.md#heap-memory).
HEAP_RETAINED_ACTIVATION_COPIES = 0.5
HEAP_RETAINS_ON = frozenset({"cpu"})  # accelerator allocators hold freed blocks for reuse: no growth beyond the peak

# Micro-batches (runtime/turns.py): when a pass's activations do not fit all at once, its sequences enter each layer in
# turns, so only one micro-batch's activations are live while every sequence's KV cache and hidden state wait.
HELD_HIDDEN_COPIES = 2  # a waiting micro-batch holds its hidden states and the residual they add to
# Each of a prefill's forward calls is held suspended between its turns (runtime.turns.run_interleaved), keeping its
# saved stack and Python frames until the pass ends, counted with a wide margin
# (docs/planning.md#memory-the-plan-counts); its activations are counted apart. The OpenMP team and matmul scratch are
# the one calling thread's, in the runtime.
PREFILL_CALL_BYTES = 256 << 10
# A decode step that attends to its keys and values where they lie (decode_in_place) may still copy one layer's
# [H_kv, context, D] once (a strided cache view made contiguous), and prefix_attention.attend_with_prefix keeps its
# float32 scores against the prefix and its own tokens, their concatenation, the scaled and masked scores and the
# softmax weights alive together.
IN_PLACE_SCORE_COPIES = 5
# A half-precision prefill of prefix-sharing micro-batches on a CPU attends a chunk of query rows at a time
# (prefix_attention.attend_in_chunks): its scores take at most this much beside the call's activations.
ATTENTION_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Calls:
    """How the plan cuts a job's passes into forward calls, which sizes a call's turn and a decode pass's memory."""
    micro_sequences: int | None  # sequences per prefill call; None: the whole batch in one
    max_sequences: int  # most sequences in a batch
    decode_group: int | None = None  # sequences per decode call; None: the whole batch in one
    shared: int = 0  # prompt tokens every row starts with, held once (a batch of one holds them as its own)
    in_place: bool = False  # decode steps read keys and values where they lie (decode_call_bytes_per_sequence)
    interleaved: bool = True  # the calls take turns at each layer (streamed), not one after another (batch_bytes)


def attention_scratch_bytes(device: str, compute_bytes: int, shared: int) -> int:
    """The chunked attention's scratch: only a CPU prefill in half precision behind a shared prefix takes it."""
    return ATTENTION_CHUNK_BYTES if shared and compute_bytes == 2 and device.split(":")[0] == "cpu" else 0


def linear_activation_bytes_per_token(sizes: CheckpointSizes, compute_bytes: int, device: str = "cuda",
                                      retained: bool = True) -> int:
    """Live activations of one token in the layer computing, plus what the host allocator keeps of earlier layers'
    (`retained`: where calls take turns; a resident call is not, batch_bytes)."""
    hidden_states = sizes.hidden_size * compute_bytes * HIDDEN_STATE_COPIES
    mlp_intermediate = sizes.intermediate_size * compute_bytes * MLP_INTERMEDIATE_COPIES
    return round((hidden_states + mlp_intermediate) * (heap_factor(device) if retained else 1))


def activation_bytes_for_sequence(sizes: CheckpointSizes, compute_bytes: int, device: str,
                                  prefill_tokens: int, logit_positions: int, retained: bool = True) -> int:
    per_token = prefill_tokens * linear_activation_bytes_per_token(sizes, compute_bytes, device, retained)
    attention_scores = 0
    if scores_materialised(device):  # one layer's scores at a time
        attention_scores = round(sizes.num_attention_heads * prefill_tokens * prefill_tokens
                                 * ATTENTION_SCORE_BYTES * (heap_factor(device) if retained else 1))
    return per_token + attention_scores + call_logit_bytes(sizes, compute_bytes, logit_positions)


def call_logit_bytes(sizes: CheckpointSizes, compute_bytes: int, logit_positions: int) -> int:
    """A forward call's logits of one sequence while the call turns them into log-probabilities: the head's output
    at the compute dtype, its float32 copy where that is another dtype, and the log-softmax. Only the positions the
    executor keeps; what it keeps after the call is RowCost.kept_logprobs."""
    copies = compute_bytes + LOGIT_BYTES * (1 if compute_bytes == LOGIT_BYTES else 2)
    return logit_positions * sizes.vocab_size * copies


def batch_bytes(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                batch: Sequence[int], micro_sequences: int | None = None,
                prefilling: Sequence[int] | None = None, *, interleaved: bool = True) -> int:
    """KV cache at the batch's longest sequence (none for choice rows) and kept log-probabilities (every call's stay
    until the pass ends: a choice's tokens, a generation row's next-token distribution), for every sequence;
    activations (a call's logits among them) at its longest prefill for every sequence, or with micro-batches for
    one micro-batch and held hidden states for the others; and the prefill's suspended forward calls: those of
    `prefilling`, the rows whose prompts the pass prefills (a refilled pass: the rows it admits; None: the whole
    batch).

    A whole batch's prefill cut into several calls (always on a CPU: prefill_calls) holds one call's activations at
    a time (batch_cut_bytes).

    `interleaved`: the calls take turns at each layer (a streamed model reads each layer once for all of them), so
    every call but the one computing waits suspended with its hidden states. A resident model runs its calls one
    after another through the whole stack: a call not yet begun holds only its tokens, one finished only its kept
    log-probabilities. Nor does a resident call's heap keep what its earlier layers freed (each layer's hook returns
    it, host.heap): the copies counted are its whole live set. Measured peaks against these counts:
    docs/planning.md#memory-the-plan-counts."""
    sequences, longest, prefill, positions = batch_shape(rows, batch)
    holds_cache = any(rows[i].holds_cache for i in batch)
    kv = kv_bytes_for_sequence(sizes, compute_bytes, longest) if holds_cache else 0
    logits = kept_logprobs(rows, batch, sizes.vocab_size) * LOGIT_BYTES
    activations = activation_bytes_for_sequence(sizes, compute_bytes, device, prefill, positions, retained=interleaved)
    prefilled = batch if prefilling is None else prefilling
    cut = prefill_calls(rows, prefilled, micro_sequences, device) if prefilled else ()
    calls = len(cut) * PREFILL_CALL_BYTES if interleaved else 0
    if prefilling is None and len(cut) > 1:
        return batch_cut_bytes(sizes, compute_bytes, device, (sequences, prefill, positions, logits), kv, cut,
                               interleaved=interleaved) + calls
    if micro_sequences is None or micro_sequences >= sequences:
        return sequences * (kv + activations + logits) + calls
    held = prefill * sizes.hidden_size * compute_bytes * HELD_HIDDEN_COPIES if interleaved else 0
    return sequences * (kv + held + logits) + micro_sequences * activations + calls


def batch_cut_bytes(sizes: CheckpointSizes, compute_bytes: int, device: str, shape: tuple[int, int, int, int],
                    kv: int,
                    cut: Sequence[Sequence[int]], *, interleaved: bool = True) -> int:
    """A batch prefilled in the calls `cut` (each call's prefill lengths), `shape` (sequences, longest prefill, logit
    positions, kept log-probability bytes a sequence): the largest call's activations and logits, the other calls'
    held hidden states where the calls take turns (`interleaved`, batch_bytes), and every sequence's KV cache and
    kept log-probabilities."""
    sequences, prefill, positions, logits = shape
    live = max(len(call) * activation_bytes_for_sequence(sizes, compute_bytes, device, max(call), positions,
                                                         retained=interleaved) for call in cut)
    held = prefill * sizes.hidden_size * compute_bytes * HELD_HIDDEN_COPIES if interleaved else 0
    return sequences * (kv + held + logits) + live


def largest_turn_bytes(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                       own_rows: Sequence[RowCost], batch: Sequence[int], calls: Calls,
                       prefilling: Sequence[int] | None = None) -> int:
    """The most activation memory one forward call's turn at a layer takes in a batch's passes: its largest prefill
    call (cut as the executor cuts them), the shared prefix's call, or a decode call. A turn that finds no freed
    pages to reuse takes this much more memory (host.heap.keep_freed_pages_below). `prefilling`: as batch_bytes."""
    sequences = batch_shape(rows, batch)[0]
    shared = calls.shared
    sharing = bool(shared) and sequences > 1
    costs = own_rows if sharing else rows
    positions = batch_shape(costs, batch)[3]
    prefilled = batch if prefilling is None else prefilling
    turns = [len(call) * activation_bytes_for_sequence(sizes, compute_bytes, device, max(call), positions,
                                                       retained=calls.interleaved)
             for call in (prefill_calls(costs, prefilled, calls.micro_sequences, device) if prefilled else ())]
    if sharing:
        turns.append(activation_bytes_for_sequence(sizes, compute_bytes, device, shared, 0,
                                                   retained=calls.interleaved))
    if any(rows[i].passes() > 1 for i in batch):
        context = (shared if sharing else 0) + max(costs[i].sequence_length() for i in batch)
        turns.append(min(calls.decode_group or sequences, sequences)
                     * decode_call_bytes_per_sequence(sizes, compute_bytes, device, context, calls.in_place))
    return max(turns)


def decode_call_bytes_per_sequence(sizes: CheckpointSizes, compute_bytes: int, device: str, context: int,
                                   in_place: bool = False) -> int:
    """What a decode forward adds per sequence at the context length: the attention's copies of one layer's keys and
    values, plus one token's activations and logits. Expanded to every query head where transformers' sdpa repeats
    them (under a padding mask, before transformers 5.24, or an eager attention); `in_place` (the step reads them
    where they lie: a shared prefix through prefix_attention, or sdpa's grouped one-token query) one copy at the key
    heads and the float32 scores per query head."""
    if in_place:
        attention = (2 * sizes.num_kv_heads * sizes.head_dim * context * compute_bytes
                     + IN_PLACE_SCORE_COPIES * sizes.num_attention_heads * context * ATTENTION_SCORE_BYTES)
    else:
        attention = 2 * sizes.num_attention_heads * sizes.head_dim * context * compute_bytes
    return attention + activation_bytes_for_sequence(sizes, compute_bytes, device, 1, 1)


def decode_kv_bytes(sizes: CheckpointSizes, compute_bytes: int, own_rows: Sequence[RowCost],
                    planned: Sequence[int], max_sequences: int) -> tuple[int, int]:
    """(KV cache of a full batch at the longest row's end, that row's own length) during its decode passes."""
    longest_own = max(own_rows[i].sequence_length() for i in planned)
    return max_sequences * kv_bytes_for_sequence(sizes, compute_bytes, longest_own), longest_own


def decode_group_size(sizes: CheckpointSizes, compute_bytes: int, device: str, own_rows: Sequence[RowCost],
                      planned: Sequence[int], calls: Calls, free_bytes: int) -> int | None:
    """Sequences per forward call in a decode pass: as many as fit beside the batch's whole KV cache (`calls`'s own
    decode_group is not read).

    A decode forward reads the layer's weights from memory however few sequences it carries, so decode micro-batches
    are made as large as memory allows. The prefill's activations and held hidden states are gone by then."""
    if calls.micro_sequences is None or not planned:
        return None
    kv_cache, longest_own = decode_kv_bytes(sizes, compute_bytes, own_rows, planned, calls.max_sequences)
    per_sequence = decode_call_bytes_per_sequence(sizes, compute_bytes, device, calls.shared + longest_own,
                                                  calls.in_place)
    return int(min(calls.max_sequences, max(calls.micro_sequences, (free_bytes - kv_cache) // per_sequence)))


def decode_pass_bytes(sizes: CheckpointSizes, compute_bytes: int, device: str, own_rows: Sequence[RowCost],
                      planned: Sequence[int], calls: Calls) -> int:
    """What a batch holds during its decode passes (beside the weights and the shared prefix): its whole KV cache and
    one decode call. 0 when no planned row decodes (choice rows and one-token answers finish in their prefill)."""
    if not planned or not any(own_rows[i].passes() > 1 for i in planned):
        return 0
    kv_cache, longest_own = decode_kv_bytes(sizes, compute_bytes, own_rows, planned, calls.max_sequences)
    group = min(calls.decode_group or calls.max_sequences, calls.max_sequences)
    return kv_cache + group * decode_call_bytes_per_sequence(sizes, compute_bytes, device, calls.shared + longest_own,
                                                             calls.in_place)


def scores_materialised(device: str) -> bool:
    return device.split(":")[0] in SCORES_MATERIALISED_ON


def heap_factor(device: str) -> float:
    return 1 + HEAP_RETAINED_ACTIVATION_COPIES if device.split(":")[0] in HEAP_RETAINS_ON else 1


MICRO_BATCH_MEMORY_SHARE = 0.25  # of the free memory given to one micro-batch's activations; the rest buys sequences


# A CPU multiplies a forward call of this many tokens as fast per token as a larger one (docs/performance.md): more
# tokens a call buy no speed, only activation memory.
CPU_CALL_TOKENS = 8192


def batch_limits(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                 free_bytes: int, batch_size: int | None) -> tuple[int, int, int | None]:
    """memory_limits, with a CPU's forward calls held to CPU_CALL_TOKENS at the longest prefill (at least one
    sequence a call)."""
    max_sequences, max_tokens, micro_sequences = memory_limits(sizes, compute_bytes, device, rows, free_bytes,
                                                               batch_size)
    if device.split(":")[0] != "cpu":
        return max_sequences, max_tokens, micro_sequences
    cap = max(1, CPU_CALL_TOKENS // max(row.prefill_length() for row in rows))
    if cap >= min(micro_sequences or max_sequences, max_sequences):
        return max_sequences, max_tokens, micro_sequences
    return max_sequences, max_tokens, cap


def memory_limits(sizes: CheckpointSizes, compute_bytes: int, device: str, rows: Sequence[RowCost],
                  free_bytes: int, batch_size: int | None) -> tuple[int, int, int | None]:
    """(max sequences, max padded tokens, sequences per micro-batch or None) such that any batch packed under them
    fits in free_bytes. Bound: every token costs at most its KV (no window cap; none in a job of choice rows only), its
    linear activations and one row of attention scores at the longest prefill; every sequence adds its kept logits.
    Sequences are sized so typical (median-length) rows fill the budget; the token budget then keeps longer rows from
    overflowing it. When the job's sequences do not all fit with their activations live at once (padded to the
    longest row), the pass is split into micro-batches: activations are bought for one micro-batch (a share of the
    budget, or what holding a smaller job's every row leaves), KV, held hidden states and kept logits for every
    sequence of the pass (every call's log-probabilities stay until the pass ends), in either mode (a resident pass
    holds no held states, batch_bytes: buying a larger call with that memory is unmeasured)."""
    longest_prefill = max(row.prefill_length() for row in rows)
    kv_per_token = (kv_bytes_per_token_per_layer(sizes, compute_bytes) * sizes.num_layers
                    if any(row.holds_cache for row in rows) else 0)
    activation_per_token = (linear_activation_bytes_per_token(sizes, compute_bytes, device)
                            + (sizes.num_attention_heads * longest_prefill * ATTENTION_SCORE_BYTES
                               * heap_factor(device) if scores_materialised(device) else 0))
    positions = max(row.logit_positions() for row in rows)
    per_sequence = max(row.kept_logprobs(sizes.vocab_size, positions) for row in rows) * LOGIT_BYTES
    call_logits = call_logit_bytes(sizes, compute_bytes, positions)  # a sequence's logits inside its forward call
    typical_length = statistics.median_low(row.sequence_length() for row in rows)
    wanted = min(sum(row.sequences() for row in rows), batch_size or math.inf)
    free_bytes = max(free_bytes, 0)

    per_token = kv_per_token + activation_per_token
    one_call = per_sequence + call_logits  # every sequence in one forward call, its logits live at once
    all_live = free_bytes // (typical_length * per_token + one_call)
    longest = max(row.sequence_length() for row in rows)
    if all_live >= wanted and wanted * (longest * per_token + one_call) <= free_bytes:
        # every sequence's activations fit at once, even all padded to the longest: one forward call per pass
        max_sequences = max(int(wanted), 1)
        return max_sequences, int(max((free_bytes - max_sequences * one_call) // per_token, 1)), None

    # A micro-batch is cut from sequences sorted by length, so the last one holds the longest rows: its activations
    # are bought at the longest prefill, as the peak counts them (batch_bytes), not at the median length.
    micro_per_sequence = longest_prefill * activation_per_token + call_logits
    micro_sequences = max(int(free_bytes * MICRO_BATCH_MEMORY_SHARE // micro_per_sequence), 1)
    held_per_token = kv_per_token + sizes.hidden_size * compute_bytes * HELD_HIDDEN_COPIES
    # Each forward call (micro-batch) is held suspended (PREFILL_CALL_BYTES), shared by its sequences.
    max_sequences = ((free_bytes - micro_sequences * micro_per_sequence)
                     // (typical_length * held_per_token + per_sequence + PREFILL_CALL_BYTES / micro_sequences))
    if max_sequences > wanted:
        # The job needs fewer sequences than memory holds. Every row is held at the longest row's length, so the
        # token budget packs them all into one batch, and the micro-batch gets what that leaves (at least one
        # sequence, fewer than all), each of its sequences at the longest row's activations like the batch's peak:
        # usually more than the fixed share, and larger micro-batches run faster
        # (docs/performance.md#tokens-a-forward-call).
        max_sequences = wanted
        leftover = free_bytes - wanted * (longest * held_per_token + per_sequence)

        def micro_fitting(room: float) -> int:
            return max(1, min(int(wanted) - 1, int(room // (longest * activation_per_token + call_logits))))

        micro_sequences = micro_fitting(leftover)
        micro_sequences = micro_fitting(leftover - _calls_bytes(wanted, micro_sequences))  # room for its calls
    max_sequences = max(int(max_sequences), 1)
    if max_sequences <= micro_sequences:  # micro-batches gain nothing: the whole batch in one forward call
        max_sequences = max(int(min(all_live, wanted)), 1)
        return max_sequences, int(max((free_bytes - max_sequences * one_call) // per_token, 1)), None
    max_tokens = max(int((free_bytes - micro_sequences * micro_per_sequence - max_sequences * per_sequence
                          - _calls_bytes(max_sequences, micro_sequences)) // held_per_token), 1)
    return max_sequences, max_tokens, micro_sequences


def _calls_bytes(sequences: int, micro_sequences: int) -> int:
    """The suspended forward calls of a pass, one per micro-batch (the plan's peak counts the executor's cut)."""
    return math.ceil(sequences / micro_sequences) * PREFILL_CALL_BYTES
