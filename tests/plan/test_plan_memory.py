"""The memory a plan counts: KV cache, activations, layer slots and read-ahead, decode calls, shared prefixes,
forward calls held by a pass, and the peak against the budget."""
from __future__ import annotations

import json
import re

import pytest

from batchrun.checkpoint import kv_bytes_for_sequence, sizes_from_config
from batchrun.plan import RowCost, format_plan_table, without_prefix
from batchrun.plan import memory as plan_memory
from batchrun.plan.memory import (HEAP_RETAINED_ACTIVATION_COPIES, IN_PLACE_SCORE_COPIES, PREFILL_CALL_BYTES, Calls,
                                  activation_bytes_for_sequence, batch_bytes, decode_call_bytes_per_sequence,
                                  decode_pass_bytes, largest_turn_bytes)
from batchrun.plan.timing import batch_prefill_flops
from batchrun.plan.weights import streamed_weights
from tests.support import CONFIGS, GEMMA_1B, LLAMA_70B, TINY, GiB, plan


def test_llama_70b_kv_cache_is_320_kib_per_token_and_1_25_gib_per_4k_sequence():
    candidate = plan(streaming="always")
    assert candidate.checkpoint.kv_bytes_per_token == 2 * 8 * 128 * 2 * 80 == 327_680
    assert kv_bytes_for_sequence(LLAMA_70B, 2, 4096) == 1.25 * GiB
    assert candidate.checkpoint.largest_layer_bytes == 1_711_308_800 and candidate.checkpoint.layers == 80


def test_sliding_window_layers_cap_their_kv_at_the_window():
    per_layer = 2 * 1 * 256 * 2  # one KV head of 256 dims, bf16
    assert plan(GEMMA_1B).checkpoint.kv_bytes_per_token == per_layer * 26  # reported without the cap
    assert kv_bytes_for_sequence(GEMMA_1B, 2, 4096) == per_layer * (22 * 512 + 4 * 4096)
    assert kv_bytes_for_sequence(GEMMA_1B, 2, 300) == per_layer * 26 * 300


def test_mps_activations_include_the_materialised_attention_scores():
    mps = activation_bytes_for_sequence(LLAMA_70B, 2, "mps", 1000, 1)
    cuda = activation_bytes_for_sequence(LLAMA_70B, 2, "cuda", 1000, 1)
    assert mps - cuda == 64 * 1000 * 1000 * 4


def test_cpu_activations_count_what_the_heap_keeps_of_freed_layers():
    """CPU SDPA tiles attention like CUDA, but glibc keeps freed activation blocks: RSS grows by more than the
    live activations (benchmarks/plan_accuracy.py measures it)."""
    cpu = activation_bytes_for_sequence(LLAMA_70B, 2, "cpu", 1000, 1)
    cuda = activation_bytes_for_sequence(LLAMA_70B, 2, "cuda", 1000, 1)
    logits = plan_memory.call_logit_bytes(LLAMA_70B, 2, 1)
    assert cpu - logits == pytest.approx((1 + HEAP_RETAINED_ACTIVATION_COPIES) * (cuda - logits), rel=1e-6)
    assert cpu > cuda


def test_layer_memory_is_the_slots_plus_a_read_buffer_only_where_one_is_used():
    slots = LLAMA_70B.non_decoder_params * 4 + 2 * LLAMA_70B.largest_layer_params * 4
    # on the host, bf16 tensors are read into their float32 slots and widened there (loader.widen_in_place)
    assert streamed_weights(LLAMA_70B, "float32", prefetch=True, device="cpu").bytes == slots
    # an accelerator's pinned read buffer is host memory, outside the device budget
    assert streamed_weights(LLAMA_70B, "float32", prefetch=True, device="cuda").bytes == slots
    # a narrowing cast on the host needs a raw buffer to read into
    fp32_checkpoint = sizes_from_config(json.loads((CONFIGS / "llama-3-70b.json").read_text()), "F32")
    assert streamed_weights(fp32_checkpoint, "bfloat16", prefetch=True).bytes == (
        fp32_checkpoint.non_decoder_params * 2 + 2 * fp32_checkpoint.largest_layer_params * 2
        + fp32_checkpoint.largest_layer_bytes)
    same_dtype = streamed_weights(LLAMA_70B, "bfloat16", prefetch=False)
    assert same_dtype.bytes == LLAMA_70B.non_decoder_params * 2 + LLAMA_70B.largest_layer_params * 2
    # where long prefills pack, the computing layer's packed copy: one layer more
    packing = streamed_weights(LLAMA_70B, "bfloat16", prefetch=False, packs_weights=True)
    assert packing.bytes == same_dtype.bytes + LLAMA_70B.largest_layer_params * 2
    assert "packed layer" in packing.what and "packed" not in same_dtype.what


def test_a_plan_that_packs_holds_one_more_layer_when_streamed_and_none_resident():
    rows = [RowCost(300, 8)] * 8
    plain, packing = (plan(TINY, rows=rows, streaming="always", packs_weights=packs) for packs in (False, True))
    assert packing.memory.weights_bytes - plain.memory.weights_bytes == TINY.largest_layer_params * 2
    assert packing.memory.packs_weights and not plain.memory.packs_weights
    resident = plan(TINY, rows=rows, streaming="never", packs_weights=True)
    assert not resident.memory.packs_weights  # a resident run keeps its plain weights
    assert resident.memory.weights_bytes == plan(TINY, rows=rows, streaming="never").memory.weights_bytes


def test_every_layer_read_ahead_holds_a_slot_in_the_plan():
    """--prefetch-depth 3 keeps four layers materialised: the plan must count four, or a capped run is killed."""
    layer = LLAMA_70B.largest_layer_params * 4
    assert (streamed_weights(LLAMA_70B, "float32", prefetch=True, prefetch_depth=3).bytes
            - streamed_weights(LLAMA_70B, "float32", prefetch=True).bytes) == 2 * layer
    shallow = plan(TINY, rows=[RowCost(300, 8)] * 8, streaming="always", compute_dtype="float32")
    deep = plan(TINY, rows=[RowCost(300, 8)] * 8, streaming="always", compute_dtype="float32", prefetch_depth=3)
    assert deep.memory.weights_bytes - shallow.memory.weights_bytes == 2 * TINY.largest_layer_params * 4


def test_decode_passes_read_one_layer_further_ahead_where_the_prefills_memory_holds_a_slot():
    """A decode pass is read-bound: it gets another layer slot when its KV cache and one decode call leave room for
    it in the budget the batch was sized to, and the plan's peak counts that slot. Not where memory is short, not
    for a job that never decodes, and not resident."""
    rows = [RowCost(4000, 96)] * 28
    roomy = plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                 runtime_overhead_bytes=1 * GiB)
    assert roomy.memory.decode_prefetch_depth == 2 and roomy.memory.prefetch_depth == 1
    assert re.search(r"^read ahead +1 layer \(2 in decode passes", format_plan_table(roomy.to_json()), re.M)
    slot = LLAMA_70B.largest_layer_params * 2
    decode_bytes = decode_pass_bytes(LLAMA_70B, 2, "cuda", rows, range(len(rows)),
                                     Calls(None, roomy.batching.batch_size, roomy.batching.decode_micro_batch_size))
    assert roomy.memory.peak_memory_bytes >= roomy.memory.weights_bytes + (1 * GiB) + decode_bytes + slot
    assert roomy.memory.peak_memory_bytes <= int(40 * GiB * 0.9)
    assert plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                runtime_overhead_bytes=1 * GiB, prefetch_depth=2).memory.decode_prefetch_depth == 3
    # the benchmark's short-answer sweep (a 3 GB bf16 Llama computed in float32 under a 1.55 GB cap): what the
    # batch leaves is given to the prefill's micro-batches, and decoding has no slot to spare; at 2 GB it has
    layers = sizes_from_config({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 33,
                                "vocab_size": 8192, "max_position_embeddings": 2048}, "BF16")
    short_answers = [RowCost(158 + 60 + 2 * i, 8) for i in range(32)]
    for budget, depth in ((1.546e9, 1), (2e9, 2)):
        assert plan(layers, rows=short_answers, streaming="always", compute_dtype="float32",
                    memory_budget_bytes=int(budget), runtime_overhead_bytes=398 << 20,
                    shared_prefix_tokens=158).memory.decode_prefetch_depth == depth
    assert plan(rows=[RowCost(300, 0, choice_tokens=(1, 1))] * 28, device="cuda", streaming="always",
                memory_budget_bytes=40 * GiB).memory.decode_prefetch_depth == 1  # choices: no decode pass
    assert plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                prefetch=False).memory.decode_prefetch_depth == 0
    resident = plan(TINY, rows=rows, streaming="never")
    assert resident.memory.decode_prefetch_depth == resident.memory.prefetch_depth == 0
    assert "read ahead" not in format_plan_table(resident.to_json())


BENCH_LLAMA = sizes_from_config({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                                 "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 33,
                                 "vocab_size": 8192, "max_position_embeddings": 2048}, "BF16")  # the benchmark's


def test_a_decode_step_reading_keys_and_values_in_place_lets_the_whole_batch_share_one_decode_call():
    """Where decode steps read each layer's keys and values where they lie (a shared prefix through
    prefix_attention, or sdpa's grouped one-token query), a decode call holds one key-head copy and float32 scores,
    not the keys and values copied per query head: the benchmark's short-answer sweep (float32, a 1.5 GB budget;
    its run under the 1.55 GB cap planned 25 a call) then decodes its 32 sequences in one call a layer instead of
    two, its peak inside the budget. The batches are the same; a job that never decodes plans the same either way."""
    context = 158 + 124 + 8
    expanded = decode_call_bytes_per_sequence(BENCH_LLAMA, 4, "cpu", context)
    in_place = decode_call_bytes_per_sequence(BENCH_LLAMA, 4, "cpu", context, in_place=True)
    one_token = activation_bytes_for_sequence(BENCH_LLAMA, 4, "cpu", 1, 1)
    assert expanded - one_token == 2 * 32 * 64 * context * 4  # keys and values for every query head
    assert in_place - one_token == 2 * 4 * 64 * context * 4 + IN_PLACE_SCORE_COPIES * 32 * context * 4
    short_answers = [RowCost(158 + 60 + 2 * i, 8) for i in range(32)]
    common = dict(streaming="always", compute_dtype="float32", memory_budget_bytes=int(1.5e9),
                  runtime_overhead_bytes=398 << 20, shared_prefix_tokens=158)
    copying = plan(BENCH_LLAMA, rows=short_answers, **common)
    reading = plan(BENCH_LLAMA, rows=short_answers, decode_in_place=True, **common)
    assert copying.batching.batch_size == 32 and copying.batching.decode_micro_batch_size < 32
    assert reading.batching.decode_micro_batch_size == 32 and reading.batching.decode_in_place
    assert reading.memory.peak_memory_bytes <= int(1.5e9 * 0.9)
    assert (reading.batching.batch_size, reading.batching.batches, reading.batching.passes) == (
        copying.batching.batch_size, copying.batching.batches, 8)
    choices = [RowCost(300, 0, choice_tokens=(1, 1))] * 64
    unchanged = [plan(BENCH_LLAMA, rows=choices, decode_in_place=flag, **common).to_json() for flag in (False, True)]
    assert unchanged[0] == unchanged[1] | {"decode_in_place": False}


def test_a_half_precision_cpu_prefill_behind_a_shared_prefix_counts_its_attention_scratch(monkeypatch):
    """On a CPU, half-precision micro-batches behind a shared prefix attend a chunk of query rows at a time
    (prefix_attention.attend_in_chunks) with a scratch of ATTENTION_CHUNK_BYTES: the plan's peak holds it, and
    only there (float32 and other devices take torch's SDPA, a prompt without a shared prefix transformers' own)."""
    rows = [RowCost(158 + 60 + 2 * i, 8) for i in range(32)]
    common = dict(streaming="always", memory_budget_bytes=int(1.5e9), runtime_overhead_bytes=398 << 20)

    def peaks(**options):
        with_scratch = plan(BENCH_LLAMA, rows=rows, **common | options).memory.peak_memory_bytes
        monkeypatch.setattr(plan_memory, "ATTENTION_CHUNK_BYTES", 0)
        without = plan(BENCH_LLAMA, rows=rows, **common | options).memory.peak_memory_bytes
        monkeypatch.undo()
        return with_scratch - without

    assert peaks(compute_dtype="bfloat16", shared_prefix_tokens=158) == 16 << 20
    assert peaks(compute_dtype="float32", shared_prefix_tokens=158) == 0
    assert peaks(compute_dtype="bfloat16", shared_prefix_tokens=0) == 0
    assert peaks(compute_dtype="bfloat16", shared_prefix_tokens=158, device="cuda") == 0


def test_choice_rows_hold_no_kv_cache_so_a_pass_carries_more_of_them():
    """A choice row is done in one pass and its keys and values are needed only inside each layer: its batch is
    sized without KV cache, unlike the same prompts generating one token, whose caches outlive the layer."""
    layers = sizes_from_config({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 33,
                                "vocab_size": 8192, "max_position_embeddings": 2048}, "BF16")
    # the benchmark's classification sweep: a 241-token instruction + 55-95 tokens of review, under a 1.55 GB cap
    options = dict(streaming="always", compute_dtype="float32", memory_budget_bytes=int(1.546e9),
                   runtime_overhead_bytes=398 << 20, shared_prefix_tokens=241)
    choices = plan(layers, rows=[RowCost(241 + 55 + i * 40 // 63, 0, (1, 1)) for i in range(64)], **options)
    generation = plan(layers, rows=[RowCost(241 + 56 + i * 40 // 63, 1) for i in range(64)], **options)
    assert len(choices.batching.batches) == 1 and choices.batching.passes == 1 and choices.batching.batch_size == 64
    assert generation.batching.batch_size < 64 and generation.batching.passes == 2
    assert choices.memory.peak_memory_bytes <= int(1.546e9 * 0.9)
    # one choice row: its activations at prompt + choice with its call's logits at two positions, its two choices'
    # log-probabilities kept at those positions, and its forward call
    assert (batch_bytes(layers, 4, "cpu", [RowCost(300, 0, (1, 1))], [0])
            == activation_bytes_for_sequence(layers, 4, "cpu", 301, 2) + 2 * 2 * plan_memory.LOGIT_BYTES
            + PREFILL_CALL_BYTES)


def test_a_shared_prompt_prefix_is_sized_and_timed_once_per_batch():
    """64 rows = a 600-token instruction + 100 tokens of their own: with the prefix shared, a batch holds more
    sequences (their own KV only), and the prefill computes 600 + 64 x 100 tokens, not 64 x 700."""
    rows = [RowCost(700, 8)] * 64
    kwargs = dict(rows=rows, device="cpu", streaming="always", memory_budget_bytes=24 * GiB)
    plain = plan(**kwargs)
    shared = plan(**kwargs, shared_prefix_tokens=600)
    assert shared.batching.shared_prefix_tokens == 600 and plain.batching.shared_prefix_tokens == 0
    assert shared.batching.batch_size > plain.batching.batch_size
    assert shared.batching.passes <= plain.batching.passes
    first_pass = batch_prefill_flops(LLAMA_70B, [without_prefix(r, 600) for r in rows], list(range(64)), 600)
    assert first_pass < batch_prefill_flops(LLAMA_70B, rows, list(range(64))) / 5


def test_published_70b_calibration_at_4k_context():
    """Published: ~3.9 GB without prefetch, ~6.1 GB with (layers, KV and activations on a 4 GB-class card)."""
    for prefetch, published in ((False, 3.9e9), (True, 6.1e9)):
        candidate = plan(rows=[RowCost(4095, 1)], device="cuda", streaming="always", prefetch=prefetch,
                         memory_budget_bytes=80 * GiB)
        on_card = (candidate.memory.peak_memory_bytes - LLAMA_70B.non_decoder_params * 2
                   - candidate.memory.runtime_overhead_bytes)
        assert on_card == pytest.approx(published, rel=0.15)


def test_a_refilled_pass_holds_every_live_row_but_prefills_only_the_rows_it_admits():
    """Its decoding rows' caches and held states are counted, but its prefill calls, and their turns, are the
    admitted rows' alone: counting the live rows' prompts as calls too cost nothing in safety, and planning 10,000
    rows of mixed lengths took 9 s instead of 2.4 (a micro-batch cut of every pass's live rows)."""
    rows = [RowCost(1000, 8)] * 4 + [RowCost(100, 8)]
    live, admitted = [0, 1, 2, 3], [4]
    union = live + admitted
    counted = batch_bytes(LLAMA_70B, 2, "cpu", rows, union, 1)
    prefilled = batch_bytes(LLAMA_70B, 2, "cpu", rows, union, 1, prefilling=admitted)
    assert counted - prefilled == 4 * PREFILL_CALL_BYTES  # one call a row at 1 sequence a micro-batch: 5 against 1
    calls = Calls(micro_sequences=1, max_sequences=len(union), decode_group=None, shared=0)
    turn = largest_turn_bytes(LLAMA_70B, 2, "cpu", rows, rows, union, calls, prefilling=admitted)
    decode_turn = len(union) * decode_call_bytes_per_sequence(LLAMA_70B, 2, "cpu", 1008)
    assert turn == max(activation_bytes_for_sequence(LLAMA_70B, 2, "cpu", 100, 1), decode_turn)
    assert largest_turn_bytes(LLAMA_70B, 2, "cpu", rows, rows, union, calls) == max(
        activation_bytes_for_sequence(LLAMA_70B, 2, "cpu", 1000, 1), decode_turn)


def test_the_peak_counts_every_forward_call_of_the_prefill():
    """Each micro-batch's forward call is held suspended until the pass ends: six equal sequences in micro-batches
    of two make three calls, each counted."""
    rows = [RowCost(100, 0, (1, 1))] * 6
    one_call = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=None)
    three_calls = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=2)
    two_calls = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=3)
    # a call fewer holds one sequence's activations and logits more; every sequence's kept log-probabilities stay
    # either way
    assert three_calls - two_calls == PREFILL_CALL_BYTES - activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 101, 2)
    assert one_call >= 6 * activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 101, 2) + PREFILL_CALL_BYTES


def test_a_turn_is_sized_by_the_largest_forward_call_not_the_whole_batch():
    """The executor may keep a turn's freed pages while the process stays under the plan's peak less turn_bytes
    (host.heap.keep_freed_pages_below): that is the largest call the prefill makes, cut by length as the executor cuts
    it. 16 short and 16 long choice rows make two calls on the CPU; the long one is the largest turn."""
    rows = [RowCost(40, 0, (1, 1))] * 16 + [RowCost(200, 0, (1, 1))] * 16
    candidate = plan(GEMMA_1B, rows, compute_dtype="float32", memory_budget_bytes=64 * GiB)
    assert candidate.batching.micro_batch_size is None and candidate.batching.batches == [list(range(32))]
    assert candidate.mode == "resident"  # a call runs through every layer in turn: no heap share of earlier layers
    long_call = 16 * activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 201, 2, retained=False)
    assert candidate.memory.turn_bytes == long_call
    assert candidate.memory.turn_bytes < batch_bytes(GEMMA_1B, 4, "cpu", rows, range(32), micro_sequences=None)
    fixed = candidate.memory.weights_bytes + candidate.memory.runtime_overhead_bytes
    assert fixed + candidate.memory.turn_bytes <= candidate.memory.peak_memory_bytes


def test_a_resident_pass_runs_its_calls_one_after_another_so_none_waits_holding_hidden_states():
    """A streamed pass's calls take turns at each layer, so every call but the one computing waits with its hidden
    states; a resident model runs each call through the whole stack before the next begins. 3,000 choice rows of
    SmolLM2's shapes, cut into calls by length: resident, a pass holds every row's kept log-probabilities and the
    largest call's activations, nothing more."""
    smollm2 = sizes_from_config({"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                                 "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
                                 "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True},
                                "F32")
    rows = [RowCost(40 + i % 60, 0, (1, 1)) for i in range(3000)]
    batch = range(len(rows))
    streamed = batch_bytes(smollm2, 4, "cpu", rows, batch)
    resident = batch_bytes(smollm2, 4, "cpu", rows, batch, interleaved=False)
    kept = len(rows) * 2 * 2 * plan_memory.LOGIT_BYTES  # two choices' log-probabilities at two positions a row
    calls = plan_memory.prefill_calls(rows, batch, None, "cpu")
    largest_call = max(len(call) * activation_bytes_for_sequence(smollm2, 4, "cpu", max(call), 2, retained=False)
                       for call in calls)  # each layer hands back what it freed: no heap share of earlier layers
    assert len(calls) > 1 and resident == kept + largest_call
    longest_prefill = plan_memory.batch_shape(rows, batch)[2]
    held = len(rows) * longest_prefill * smollm2.hidden_size * 4 * plan_memory.HELD_HIDDEN_COPIES
    streamed_call = max(len(call) * activation_bytes_for_sequence(smollm2, 4, "cpu", max(call), 2) for call in calls)
    assert streamed == kept + streamed_call + held + len(calls) * PREFILL_CALL_BYTES
    # the heap keeps a share of a streamed call's layer activations, not of its logits (computed after the layers)
    largest = max(calls, key=lambda call: len(call) * max(call))
    logits = len(largest) * plan_memory.call_logit_bytes(smollm2, 4, 2)
    assert streamed_call - logits == pytest.approx((largest_call - logits) * (1 + HEAP_RETAINED_ACTIVATION_COPIES),
                                                   rel=1e-3)
    candidates = {mode: plan(smollm2, rows, streaming=mode, compute_dtype="float32", memory_budget_bytes=64 * GiB)
                  for mode in ("never", "always")}
    assert [sorted(b) for b in candidates["never"].batching.batches] == [list(batch)]  # one batch either way
    assert candidates["never"].batching.batches == candidates["always"].batching.batches
    resident_batch = candidates["never"].memory.peak_memory_bytes - candidates["never"].memory.weights_bytes
    streamed_batch = candidates["always"].memory.peak_memory_bytes - candidates["always"].memory.weights_bytes
    assert resident_batch < streamed_batch - held // 2


def test_a_cpu_call_holds_no_more_tokens_than_keep_its_cores_busy():
    """Resident with memory to spare, 4,000 choice rows of 50 tokens would fit in one forward call; on a CPU a call
    stops at CPU_CALL_TOKENS (more buys no speed), so the pass's peak is one such call, not all 4,000 rows' logits
    and activations. An accelerator still makes the one call."""
    rows = [RowCost(50, 0, (1, 1))] * 4000
    cpu = plan(GEMMA_1B, rows, compute_dtype="float32", memory_budget_bytes=64 * GiB)
    cuda = plan(GEMMA_1B, rows, compute_dtype="float32", memory_budget_bytes=64 * GiB, device="cuda")
    assert cpu.batching.batch_size == cuda.batching.batch_size == 4000
    assert cpu.batching.micro_batch_size == plan_memory.CPU_CALL_TOKENS // 51 and cuda.batching.micro_batch_size is None
    assert cpu.memory.turn_bytes == cpu.batching.micro_batch_size * activation_bytes_for_sequence(
        GEMMA_1B, 4, "cpu", 51, 2, retained=False)
    assert cpu.memory.peak_memory_bytes < cuda.memory.peak_memory_bytes
