"""Plan arithmetic: KV cache, layer sizes, batch for a budget, passes, policy, time, and the printed tables."""
from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchrun.plan.batching import (MICRO_BATCH_COST_TOKENS, micro_batches, pack_in_order, prefill_call_count,
                               prefill_groups, shared_prefix_tokens, windows_allow_sharing, without_prefix)
from batchrun.checkpoint.resolve import sizes_from_config
from batchrun.plan.timing import PassPricing, batch_prefill_flops, job_timeline, pass_memory_bytes, weight_rate_at
from batchrun.plan.planner import (
    HEAP_RETAINED_ACTIVATION_COPIES, HOST_FRESH_PAGE_SLOWDOWN, PREFILL_CALL_BYTES, MEMORY_HEADROOM_SHARE, Bandwidth,
    PlanRequest, Rates, RowCost,
    activation_bytes_for_sequence,
    compare_modes, format_duration, kv_bytes_for_sequence, KV_COPIES_PER_DECODE, lower_bound_passes, make_plan,
    pack_batches,
    host_streaming_bytes, parse_streaming, passes_for, streamed_weights, decode_pass_bytes,
)
from batchrun.plan.formatting import format_bytes, format_comparison, format_plan_table
from batchrun.plan import memory as plan_memory
from batchrun.plan.refill import refill_schedule
from batchrun.plan.memory import (IN_PLACE_SCORE_COPIES, Calls, batch_bytes, decode_call_bytes_per_sequence,
                                  largest_turn_bytes)

CONFIGS = Path(__file__).parent / "configs"
GiB = 1 << 30
LLAMA_70B = sizes_from_config(json.loads((CONFIGS / "llama-3-70b.json").read_text()), "BF16")
GEMMA_1B = sizes_from_config(json.loads((CONFIGS / "gemma-3-1b.json").read_text()), "BF16")
TINY = sizes_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
                          "vocab_size": 256, "max_position_embeddings": 2048, "tie_word_embeddings": True}, "F32")
MEASURED = Bandwidth(1.0e9, "measured", "sequential reads after posix_fadvise(DONTNEED) of 1 GiB")


DEFAULTS = dict(model="m", device="cpu", compute_dtype="bfloat16", memory_budget_bytes=24 * GiB, streaming="auto",
                bandwidth=MEASURED, compute_flops_per_s=4e11, disk_free_bytes=None, checkpoint_is_local=True,
                runtime_overhead_bytes=600 << 20)


def records(**overrides):
    """(PlanRequest, Rates, the job's own keywords) from one set of keywords over DEFAULTS."""
    options = DEFAULTS | overrides
    picked = [{f.name: options.pop(f.name) for f in fields(record) if f.name in options}
              for record in (PlanRequest, Rates)]
    return PlanRequest(**picked[0]), Rates(**picked[1]), options


def plan(sizes=LLAMA_70B, rows=(RowCost(300, 8),), **overrides):
    request, rates, job = records(**overrides)
    return make_plan(sizes, list(rows), request, rates, **job)


# --- policy words -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("word, policy", [
    ("auto", "auto"), ("always", "always"), ("never", "never"), ("YES", "always"), ("on", "always"),
    ("true", "always"), ("1", "always"), ("no", "never"), ("Off", "never"), ("false", "never"), ("0", "never"),
])
def test_streaming_words_people_type_map_to_a_policy(word, policy):
    assert parse_streaming(word, env={}) == policy


def test_flag_beats_environment_which_beats_default():
    assert parse_streaming(None, env={}) == "auto"
    assert parse_streaming(None, env={"BATCHRUN_STREAMING": "off"}) == "never"
    assert parse_streaming("always", env={"BATCHRUN_STREAMING": "off"}) == "always"


def test_unknown_streaming_word_is_refused_naming_the_accepted_ones(monkeypatch):
    with pytest.raises(ValueError, match="'alwyas'.*auto, always, never"):
        parse_streaming("alwyas", env={})
    monkeypatch.setenv("BATCHRUN_STREAMING", "maybe")
    with pytest.raises(ValueError, match="BATCHRUN_STREAMING: unknown streaming policy 'maybe'"):
        parse_streaming(None)


# --- sizes the plan stands on -----------------------------------------------------------------------------------


def test_llama_70b_kv_cache_is_320_kib_per_token_and_1_25_gib_per_4k_sequence():
    candidate = plan(streaming="always")
    assert candidate.kv_bytes_per_token == 2 * 8 * 128 * 2 * 80 == 327_680
    assert kv_bytes_for_sequence(LLAMA_70B, 2, 4096) == 1.25 * GiB
    assert candidate.largest_layer_bytes == 1_711_308_800 and candidate.layers == 80


def test_sliding_window_layers_cap_their_kv_at_the_window():
    per_layer = 2 * 1 * 256 * 2  # one KV head of 256 dims, bf16
    assert plan(GEMMA_1B).kv_bytes_per_token == per_layer * 26  # reported without the cap
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
    logits = LLAMA_70B.vocab_size * 4
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
    assert packing.weights_bytes - plain.weights_bytes == TINY.largest_layer_params * 2
    assert packing.packs_weights and not plain.packs_weights
    resident = plan(TINY, rows=rows, streaming="never", packs_weights=True)
    assert not resident.packs_weights  # a resident run keeps its plain weights
    assert resident.weights_bytes == plan(TINY, rows=rows, streaming="never").weights_bytes


def test_every_layer_read_ahead_holds_a_slot_in_the_plan():
    """--prefetch-depth 3 keeps four layers materialised: the plan must count four, or a capped run is killed."""
    layer = LLAMA_70B.largest_layer_params * 4
    assert (streamed_weights(LLAMA_70B, "float32", prefetch=True, prefetch_depth=3).bytes
            - streamed_weights(LLAMA_70B, "float32", prefetch=True).bytes) == 2 * layer
    shallow = plan(TINY, rows=[RowCost(300, 8)] * 8, streaming="always", compute_dtype="float32")
    deep = plan(TINY, rows=[RowCost(300, 8)] * 8, streaming="always", compute_dtype="float32", prefetch_depth=3)
    assert deep.weights_bytes - shallow.weights_bytes == 2 * TINY.largest_layer_params * 4


def test_decode_passes_read_one_layer_further_ahead_where_the_prefills_memory_holds_a_slot():
    """A decode pass is read-bound: it gets another layer slot when its KV cache and one decode call leave room for
    it in the budget the batch was sized to, and the plan's peak counts that slot. Not where memory is short, not
    for a job that never decodes, and not resident."""
    rows = [RowCost(4000, 96)] * 28
    roomy = plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                 runtime_overhead_bytes=1 * GiB)
    assert roomy.decode_prefetch_depth == 2 and roomy.prefetch_depth == 1
    assert re.search(r"^read ahead +1 layer \(2 in decode passes", format_plan_table(roomy.to_json()), re.M)
    slot = LLAMA_70B.largest_layer_params * 2
    decode_bytes = decode_pass_bytes(LLAMA_70B, 2, "cuda", rows, range(len(rows)),
                                     Calls(None, roomy.batch_size, roomy.decode_micro_batch_size))
    assert roomy.peak_memory_bytes >= roomy.weights_bytes + (1 * GiB) + decode_bytes + slot
    assert roomy.peak_memory_bytes <= int(40 * GiB * 0.9)
    assert plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                runtime_overhead_bytes=1 * GiB, prefetch_depth=2).decode_prefetch_depth == 3
    # the benchmark's short-answer sweep (a 3 GB bf16 Llama computed in float32 under a 1.55 GB cap): what the
    # batch leaves is given to the prefill's micro-batches, and decoding has no slot to spare; at 2 GB it has
    layers = sizes_from_config({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "num_hidden_layers": 33,
                                "vocab_size": 8192, "max_position_embeddings": 2048}, "BF16")
    short_answers = [RowCost(158 + 60 + 2 * i, 8) for i in range(32)]
    for budget, depth in ((1.546e9, 1), (2e9, 2)):
        assert plan(layers, rows=short_answers, streaming="always", compute_dtype="float32",
                    memory_budget_bytes=int(budget), runtime_overhead_bytes=398 << 20,
                    shared_prefix_tokens=158).decode_prefetch_depth == depth
    assert plan(rows=[RowCost(300, 0, choice_tokens=(1, 1))] * 28, device="cuda", streaming="always",
                memory_budget_bytes=40 * GiB).decode_prefetch_depth == 1  # choices: no decode pass
    assert plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=40 * GiB,
                prefetch=False).decode_prefetch_depth == 0
    resident = plan(TINY, rows=rows, streaming="never")
    assert resident.decode_prefetch_depth == resident.prefetch_depth == 0
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
    assert copying.batch_size == 32 and copying.decode_micro_batch_size < 32
    assert reading.decode_micro_batch_size == 32 and reading.decode_in_place
    assert reading.peak_memory_bytes <= int(1.5e9 * 0.9)
    assert (reading.batch_size, reading.batches, reading.passes) == (copying.batch_size, copying.batches, 8)
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
        with_scratch = plan(BENCH_LLAMA, rows=rows, **common | options).peak_memory_bytes
        monkeypatch.setattr(plan_memory, "ATTENTION_CHUNK_BYTES", 0)
        without = plan(BENCH_LLAMA, rows=rows, **common | options).peak_memory_bytes
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
    assert len(choices.batches) == 1 and choices.passes == 1 and choices.batch_size == 64
    assert generation.batch_size < 64 and generation.passes == 2
    assert choices.peak_memory_bytes <= int(1.546e9 * 0.9)
    # one choice row: its activations at prompt + choice and two kept logit positions, and its forward call
    assert (batch_bytes(layers, 4, "cpu", [RowCost(300, 0, (1, 1))], [0])
            == activation_bytes_for_sequence(layers, 4, "cpu", 301, 2) + PREFILL_CALL_BYTES)


def test_a_shared_prompt_prefix_is_sized_and_timed_once_per_batch():
    """64 rows = a 600-token instruction + 100 tokens of their own: with the prefix shared, a batch holds more
    sequences (their own KV only), and the prefill computes 600 + 64 x 100 tokens, not 64 x 700."""
    rows = [RowCost(700, 8)] * 64
    kwargs = dict(rows=rows, device="cpu", streaming="always", memory_budget_bytes=24 * GiB)
    plain = plan(**kwargs)
    shared = plan(**kwargs, shared_prefix_tokens=600)
    assert shared.shared_prefix_tokens == 600 and plain.shared_prefix_tokens == 0
    assert shared.batch_size > plain.batch_size
    assert shared.passes <= plain.passes
    first_pass = batch_prefill_flops(LLAMA_70B, [without_prefix(r, 600) for r in rows], list(range(64)), 600)
    assert first_pass < batch_prefill_flops(LLAMA_70B, rows, list(range(64))) / 5


def test_shared_prefix_tokens_follow_the_executor_rules():
    head = list(range(100, 140))
    assert shared_prefix_tokens([head + [1, 2], head + [3]]) == 40
    assert shared_prefix_tokens([head, head]) == 39  # every prompt keeps one token of its own
    assert shared_prefix_tokens([head[:10] + [1], head[:10] + [2]]) == 0  # below MIN_SHARED_PREFIX
    assert shared_prefix_tokens([head + [1]]) == 0  # nothing to share with
    assert shared_prefix_tokens([head + [1], head + [2]], sharing_allowed=False) == 0  # sliding windows
    # Choice rows keep the logits of the longest choice + 1 positions; multi-token choices ride after the prompt.
    assert shared_prefix_tokens([head, head], own_tokens=3) == 37
    assert shared_prefix_tokens([head, head], own_tokens=3, shortest_sequence=42) == 39


def test_sliding_windows_allow_a_shared_prefix_only_where_every_row_fits_the_smallest():
    rows = [RowCost(100, 20), RowCost(120, 4), RowCost(90, 0, (1, 3))]  # longest prompt 120 + most added 20
    assert windows_allow_sharing([None, None], None, rows)  # full attention only
    assert windows_allow_sharing([140, None, 512], None, rows)
    assert not windows_allow_sharing([139, None, 512], None, rows)
    # a window the config does not place on layers (Mistral-7B-v0.1, gemma-2): the same rule
    assert windows_allow_sharing([None, None], 140, rows) and not windows_allow_sharing([None, None], 139, rows)
    assert windows_allow_sharing([8], None, [])


def test_published_70b_calibration_at_4k_context():
    """Published: ~3.9 GB without prefetch, ~6.1 GB with (layers, KV and activations on a 4 GB-class card)."""
    for prefetch, published in ((False, 3.9e9), (True, 6.1e9)):
        candidate = plan(rows=[RowCost(4095, 1)], device="cuda", streaming="always", prefetch=prefetch,
                         memory_budget_bytes=80 * GiB)
        on_card = candidate.peak_memory_bytes - LLAMA_70B.non_decoder_params * 2 - candidate.runtime_overhead_bytes
        assert on_card == pytest.approx(published, rel=0.15)


# --- batching and passes ----------------------------------------------------------------------------------------

MIXED = [RowCost(100, 8), RowCost(50, 4), RowCost(200, 0, (1, 1)), RowCost(120, 0, (2, 3, 1)), RowCost(80, 2)]


def test_row_costs_count_sequences_and_kv_tokens():
    assert (MIXED[2].sequences(), MIXED[2].tokens()) == (1, 201)  # one-token choices: one distribution
    assert (MIXED[3].sequences(), MIXED[3].tokens()) == (3, 3 * 123)  # each choice its own sequence
    assert (MIXED[0].sequences(), MIXED[0].tokens(), MIXED[0].passes()) == (1, 108, 8)


def test_mixed_job_batches_choices_apart_and_counts_passes():
    batches = pack_batches(MIXED, max_sequences=4, max_tokens=10_000)
    assert batches == [[3, 2], [1, 4, 0]]
    assert passes_for(MIXED, batches) == 1 + 8
    assert lower_bound_passes(MIXED, 4) == max(8, math.ceil((8 + 4 + 1 + 1 + 2) / 4))


def test_smaller_batches_cost_more_passes_and_an_oversized_row_runs_alone():
    batches = pack_batches(MIXED, max_sequences=2, max_tokens=10_000)
    assert batches == [[3], [2], [1, 4], [0]]  # row 3 alone holds 3 sequences
    assert passes_for(MIXED, batches) == 1 + 1 + 4 + 8


def test_token_budget_counts_padding_to_the_longest_sequence():
    rows = [RowCost(10, 1), RowCost(10, 1), RowCost(100, 1)]
    assert pack_batches(rows, max_sequences=8, max_tokens=150) == [[0, 1], [2]]  # 3 x 101 > 150


def test_answers_of_different_lengths_are_batched_apart_when_that_saves_passes():
    """Every batch runs until its longest answer is done: mixing short and long answers in every batch would make
    each batch as long as the longest."""
    rows = [RowCost(50 + (i * 37) % 400, 4 if i % 2 else 64) for i in range(1000)]  # lengths and answers interleaved
    by_length = pack_in_order(rows, sorted(range(len(rows)), key=lambda i: (rows[i].prompt_tokens, i)), 100, 10**9)
    assert passes_for(rows, by_length) == 10 * 64
    batches = pack_batches(rows, max_sequences=100, max_tokens=10**9)
    assert passes_for(rows, batches) == 5 * 4 + 5 * 64 == lower_bound_passes(rows, 100)
    assert all(len({rows[i].new_tokens for i in batch}) == 1 for batch in batches)


def test_equal_answer_lengths_keep_the_packing_by_prompt_length():
    rows = [RowCost(300, 8), RowCost(20, 8), RowCost(290, 8), RowCost(25, 8)]
    assert pack_batches(rows, max_sequences=2, max_tokens=10**6) == [[1, 3], [2, 0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 20), st.lists(st.integers(1, 4), max_size=4)),
                max_size=40),
       st.integers(1, 16), st.integers(1, 4000))
def test_packing_places_every_row_once_in_single_kind_batches_within_limits(specs, max_sequences, max_tokens):
    rows = [RowCost(p, 0, tuple(c)) if c else RowCost(p, n) for p, n, c in specs]
    batches = pack_batches(rows, max_sequences, max_tokens)
    assert sorted(i for batch in batches for i in batch) == list(range(len(rows)))
    for batch in batches:
        assert len({rows[i].is_choice for i in batch}) == 1
        sequences = sum(rows[i].sequences() for i in batch)
        if len(batch) > 1:
            assert sequences <= max_sequences
            assert sequences * max(rows[i].sequence_length() for i in batch) <= max_tokens
    if rows:
        assert passes_for(rows, batches) >= lower_bound_passes(rows, max_sequences)
        by_length = sorted(range(len(rows)), key=lambda i: (not rows[i].is_choice, rows[i].prompt_tokens, i))
        assert passes_for(rows, batches) <= passes_for(rows, pack_in_order(rows, by_length, max_sequences, max_tokens))


def _padded_tokens(lengths, groups):
    return sum(len(group) * max(lengths[i] for i in group) for group in groups)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1:]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=7), st.integers(1, 8))
def test_micro_batches_pad_least_within_the_planned_micro_batch(lengths, size):
    """Every sequence once; no group beyond the micro-batch the plan sized (sequences, and padded tokens of that
    many longest sequences); and no other grouping, sorted or not, pads less at the same cost per group."""
    groups = micro_batches(lengths, size)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert len(group) <= size
        assert len(group) * max(lengths[i] for i in group) <= size * max(lengths)

    def cost(partition):
        return _padded_tokens(lengths, partition) + MICRO_BATCH_COST_TOKENS * len(partition)

    allowed = [p for p in _set_partitions(list(range(len(lengths))))
               if all(len(g) <= size and len(g) * max(lengths[i] for i in g) <= size * max(lengths) for g in p)]
    assert cost(groups) == min(cost(p) for p in allowed)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([3, 7, 8, 40, 41, 90, 300]) | st.integers(1, 400), min_size=1, max_size=60),
       st.integers(1, 70))
def test_micro_batches_pad_as_little_as_trying_every_cut(lengths, size):
    """Longer jobs, runs of equal lengths: the pruned search finds the least cost that trying every start of every
    group finds (the plain dynamic program, quadratic in the pass's sequences)."""
    ordered, size = sorted(lengths), min(size, len(lengths))
    least = [0] + [math.inf] * len(ordered)
    for end in range(1, len(ordered) + 1):
        for start in range(max(0, end - size), end):
            group = ordered[start:end]
            least[end] = min(least[end], least[start] + len(group) * group[-1] - sum(group) + MICRO_BATCH_COST_TOKENS)
    groups = micro_batches(lengths, size)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(len(group) <= size for group in groups)
    padding = _padded_tokens(lengths, groups) - sum(lengths)
    assert padding + MICRO_BATCH_COST_TOKENS * len(groups) == least[-1]


def test_short_prompts_are_not_padded_to_long_ones_in_a_micro_batch():
    lengths = [300, 20, 310, 25, 22, 305, 21, 302]  # two kinds of request interleaved in the job
    groups = micro_batches(lengths, 4)
    assert groups == [[1, 3, 4, 6], [0, 2, 5, 7]]
    assert _padded_tokens(lengths, groups) == 4 * 25 + 4 * 310  # in arrival order: 4 x 310 + 4 x 305
    assert micro_batches(lengths, None) == [list(range(8))]  # no micro-batches planned: one forward call


def test_a_cpu_prefill_cuts_by_length_even_when_every_sequence_fits_at_once():
    lengths = [300, 20, 310, 25, 22, 305, 21, 302]
    assert prefill_groups(lengths, None, "cpu") == [[1, 3, 4, 6], [0, 2, 5, 7]]
    assert prefill_groups(lengths, None, "cuda") == [list(range(8))]  # a call costs more than padding there
    assert prefill_groups(lengths, 2, "cuda") == micro_batches(lengths, 2)
    assert prefill_groups([40, 41, 42], None, "cpu") == [[0, 1, 2]]  # 3 tokens of padding: not worth a call


def test_batch_chosen_for_a_budget_buys_sequences_with_micro_batches():
    budget, overhead = 40 * GiB, 1 * GiB
    candidate = plan(rows=[RowCost(4000, 96)] * 28, device="cuda", streaming="always",
                     memory_budget_bytes=budget, runtime_overhead_bytes=overhead)
    weights = LLAMA_70B.non_decoder_params * 2 + 2 * LLAMA_70B.largest_layer_params * 2
    free = int(budget * 0.9) - weights - overhead  # 10% of the budget is kept as headroom
    kv, activations = 327_680, 8192 * 2 * 4 + 28672 * 2 * 3  # KV; hidden states x4 + MLP intermediate x3
    per_sequence_logits = 128256 * 4
    all_live = free // (4096 * (kv + activations) + per_sequence_logits)
    assert all_live == 12 < 28  # not every sequence's activations fit at once: micro-batches
    micro = int(free * 0.25 // (4096 * activations + per_sequence_logits))
    held = kv + 8192 * 2 * 2  # KV + hidden states held between layers by waiting micro-batches
    expected = int((free - micro * (4096 * activations + per_sequence_logits)) // (4096 * held))
    assert (candidate.batch_size, candidate.micro_batch_size) == (expected, micro) == (15, 7)
    # static batches (15 + 13 rows) each run to their longest row; the bound assumes rows could join a pass
    # as others finish, which the executor does not do yet
    assert candidate.passes == 2 * 96 and candidate.lower_bound_passes == math.ceil(28 * 96 / 15)
    assert candidate.peak_memory_bytes <= budget and candidate.fits


def test_memory_the_job_does_not_need_for_sequences_buys_larger_micro_batches():
    """13 rows where memory holds 15 sequences: all 13 in one batch, the rest of memory to each micro-batch's
    activations (larger matmuls), still within the budget."""
    budget, overhead = 40 * GiB, 1 * GiB
    candidate = plan(rows=[RowCost(4000, 96)] * 13, device="cuda", streaming="always",
                     memory_budget_bytes=budget, runtime_overhead_bytes=overhead)
    weights = LLAMA_70B.non_decoder_params * 2 + 2 * LLAMA_70B.largest_layer_params * 2
    free = int(budget * 0.9) - weights - overhead
    kv, activations = 327_680, 8192 * 2 * 4 + 28672 * 2 * 3
    held = kv + 8192 * 2 * 2
    micro = int((free - 13 * 4096 * held) // (4096 * activations + 128256 * 4))
    assert (candidate.batch_size, candidate.micro_batch_size) == (13, micro)
    assert 7 < micro < 13  # larger than the 28-row job's share, still micro-batched
    assert candidate.passes == candidate.lower_bound_passes == 96
    assert candidate.peak_memory_bytes <= budget and candidate.fits


def test_rows_that_fit_at_their_median_length_but_not_padded_to_the_longest_still_share_one_batch():
    """Three short rows and one long one: all four fit live at the median length, not padded to the longest. One
    batch with micro-batches (one pass, the lower bound), not two batches."""
    rows = [RowCost(100, 1)] * 3 + [RowCost(1000, 1)]
    weights = plan(rows=rows, device="cuda", streaming="always").weights_bytes
    per_token = 327_680 + 8192 * 2 * 4 + 28672 * 2 * 3  # KV + hidden states x4 + MLP intermediate x3 (cuda)
    # room for 4 x 101 tokens live, not for 4 x 1001; but to hold 4 x 1001 tokens of KV and hidden states beside one
    # micro-batch of the longest row's activations
    free = 4 * 760 * per_token
    budget = math.ceil((free + weights + GiB) / 0.9)
    candidate = plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=budget,
                     runtime_overhead_bytes=GiB)
    assert candidate.passes == candidate.lower_bound_passes == 1
    assert candidate.micro_batch_size is not None and candidate.micro_batch_size < 4
    assert candidate.peak_memory_bytes <= budget and candidate.fits


def test_decode_passes_regroup_micro_batches_within_the_memory_left_beside_the_kv_cache():
    """A decode call reads the layer's weights once however few sequences it carries: decode groups are as large
    as the memory beside the whole KV cache allows, never smaller than the prefill's micro-batch."""
    budget, overhead = 40 * GiB, 1 * GiB
    candidate = plan(rows=[RowCost(4000, 96)] * 28, device="cuda", streaming="always",
                     memory_budget_bytes=budget, runtime_overhead_bytes=overhead)
    free = int(budget * 0.9) - candidate.weights_bytes - overhead
    kv_cache = candidate.batch_size * kv_bytes_for_sequence(LLAMA_70B, 2, 4096)
    expanded_kv = 2 * 64 * 128 * 4096 * 2  # one layer's K and V repeated to all 64 query heads
    per_sequence = expanded_kv + activation_bytes_for_sequence(LLAMA_70B, 2, "cuda", 1, 1)
    expected = min(candidate.batch_size, max(candidate.micro_batch_size, (free - kv_cache) // per_sequence))
    assert candidate.decode_micro_batch_size == expected
    assert candidate.micro_batch_size < candidate.decode_micro_batch_size <= candidate.batch_size
    # when every sequence fits in one forward call, so does every decode
    assert plan(rows=[RowCost(300, 8)] * 4, streaming="always").decode_micro_batch_size is None


def test_user_batch_size_caps_the_batch():
    candidate = plan(rows=[RowCost(100, 4)] * 20, streaming="always", batch_size=3)
    assert candidate.batch_size == 3 and max(len(b) for b in candidate.batches) == 3
    with pytest.raises(ValueError, match="batch_size"):
        plan(batch_size=0)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([LLAMA_70B, GEMMA_1B, TINY]), st.sampled_from(["cpu", "cuda"]),
       st.lists(st.tuples(st.integers(1, 6000), st.integers(1, 64)), min_size=1, max_size=30),
       st.integers(8, 64))
@example(LLAMA_70B, "cpu", [(1, 1)] * 6 + [(992, 2)], 12)  # short rows beside a long one, micro-batched
def test_a_plan_that_fits_never_exceeds_its_budget(sizes, device, specs, budget_gib):
    candidate = plan(sizes, [RowCost(p, n) for p, n in specs], device=device, memory_budget_bytes=budget_gib * GiB)
    if candidate.fits:
        assert candidate.peak_memory_bytes <= budget_gib * GiB
        if not any("run in a batch of their own" in caveat for caveat in candidate.caveats):
            # the batches are sized against the budget less its headroom (README: Memory headroom)
            assert candidate.peak_memory_bytes <= budget_gib * GiB * (1 - MEMORY_HEADROOM_SHARE)


def test_many_rows_of_varied_lengths_keep_the_plan_within_its_headroom():
    """Thousands of choice rows from 60 to 500 tokens, micro-batched on a CPU: the micro-batch holding the longest
    rows is the one the peak counts, so it is the one the plan buys activations for."""
    rows = [RowCost(60 + (i * 37) % 441, 0, (1, 1)) for i in range(20_000)]
    micro_batched = []
    for budget in (4 * GiB, 8 * GiB, 20 * GiB):
        candidate = plan(GEMMA_1B, rows, device="cpu", memory_budget_bytes=budget, streaming="always")
        assert candidate.fits and candidate.peak_memory_bytes <= budget * (1 - MEMORY_HEADROOM_SHARE)
        micro_batched.append(candidate.micro_batch_size is not None)
    assert any(micro_batched)


# --- policy and blockers ----------------------------------------------------------------------------------------


def test_auto_runs_resident_when_the_model_fits():
    candidate = plan(TINY, compute_dtype="float32")
    assert candidate.mode == "resident" and candidate.fits
    assert candidate.reason.startswith("auto: the model fits") and candidate.io_seconds_per_pass == 0


def test_auto_streams_a_model_that_does_not_fit_and_says_why():
    candidate = plan()
    assert candidate.mode == "streamed" and candidate.fits
    assert "over the 24.0 GiB budget" in candidate.reason and "131 GiB" in candidate.reason


def test_always_streams_even_a_model_that_fits():
    assert plan(TINY, streaming="always", compute_dtype="float32").mode == "streamed"


def test_never_on_a_model_that_does_not_fit_is_refused_with_the_numbers():
    candidate = plan(streaming="never")
    assert candidate.mode == "resident" and not candidate.fits
    assert any("resident run does not fit" in b and "24.0 GiB" in b and "131 GiB" in b for b in candidate.blockers)


def test_budget_below_one_layer_is_a_blocker():
    candidate = plan(streaming="always", memory_budget_bytes=6 * GiB)
    assert any(b.startswith("does not fit even one layer") for b in candidate.blockers)


def test_a_row_too_long_for_the_budget_is_a_blocker():
    candidate = plan(rows=[RowCost(60_000, 1)], streaming="always", context_length=100_000)
    assert any(b.startswith("does not fit even one sequence") and "60,001 tokens" in b for b in candidate.blockers)


def test_rows_over_the_context_are_left_out_and_counted():
    candidate = plan(rows=[RowCost(9000, 4), RowCost(300, 8)])
    assert candidate.passes == 8 and candidate.fits
    assert any("1 row(s) longer than the 8,192-token context" in c for c in candidate.caveats)
    assert not plan(rows=[RowCost(9000, 4)]).fits


def test_a_job_without_rows_is_sized_for_one_sequence():
    candidate = plan(rows=[], streaming="always")
    assert candidate.passes == 0 and candidate.batches == [] and candidate.fits
    assert candidate.peak_memory_bytes > candidate.weights_bytes + kv_bytes_for_sequence(LLAMA_70B, 2, 4096)


def test_unknown_bandwidth_blocks_streaming_but_not_a_resident_run():
    unknown = Bandwidth(None, "assumed", "not measured")
    streamed = plan(bandwidth=unknown)
    assert "read bandwidth unknown" in streamed.blockers[0] and streamed.eta_seconds is None
    resident = plan(TINY, compute_dtype="float32", bandwidth=unknown)
    assert resident.fits and resident.eta_seconds is not None
    assert any("load the model is not counted" in c for c in resident.caveats)


def test_assumed_bandwidth_is_a_caveat():
    candidate = plan(bandwidth=Bandwidth(1e9, "assumed", "the low end of cold reads"))
    assert any("assumed read bandwidth of 1.00 GB/s" in c for c in candidate.caveats)


def test_downloading_needs_the_checkpoint_in_free_disk():
    short = plan(checkpoint_is_local=False, disk_free_bytes=100 * GiB)
    assert short.disk_needed_bytes == LLAMA_70B.checkpoint_bytes
    assert any("not enough disk" in b for b in short.blockers)
    assert plan(checkpoint_is_local=True, disk_free_bytes=1).fits  # read in place: nothing to download


def test_mixture_of_experts_is_read_whole_and_said_so():
    config = json.loads((CONFIGS / "llama-3-70b.json").read_text()) | {
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4}
    candidate = plan(sizes_from_config(config), streaming="always")
    assert any("8 experts" in c and "only 2 run per token" in c for c in candidate.caveats)


# --- time -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch, efficiency", [(True, 1.0), (False, 0.70)])
def test_io_bound_eta_is_one_read_of_the_layers_per_pass(prefetch, efficiency):
    rows = [RowCost(300, 8)] * 4 + [RowCost(300, 0, (1, 1))] * 4
    candidate = plan(rows=rows, streaming="always", prefetch=prefetch, compute_flops_per_s=1e30)
    per_pass = LLAMA_70B.decoder_bytes / 1e9 / efficiency
    assert candidate.passes == 1 + 8
    assert candidate.io_seconds_per_pass == pytest.approx(per_pass)
    assert candidate.eta_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + 9 * per_pass)
    assert candidate.first_answer_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + per_pass)
    assert candidate.answers_per_hour == pytest.approx(8 / candidate.eta_seconds * 3600)


def test_generation_passes_follow_the_refill_schedule():
    """A place a finished row leaves is taken in the next pass: 5 passes where batches would make 6 (rows of 1 and 2
    new tokens, then 2 and 4), the lower bound; the first answer comes out of the first pass."""
    rows = [RowCost(300, 1), RowCost(300, 4), RowCost(300, 2), RowCost(300, 2)]
    candidate = plan(rows=rows, streaming="always", compute_flops_per_s=1e30, batch_size=2)
    per_pass = LLAMA_70B.decoder_bytes / 1e9
    assert passes_for(rows, candidate.batches) == 6
    assert candidate.passes == candidate.lower_bound_passes == 5
    assert candidate.eta_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + 5 * per_pass)
    assert candidate.first_answer_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + per_pass)


def test_long_prefill_on_a_slow_cpu_is_compute_bound_and_said_so():
    candidate = plan(rows=[RowCost(4000, 1)] * 8, streaming="always", bandwidth=Bandwidth(1e12, "declared", "x"),
                     compute_flops_per_s=1e11)
    for batch, seconds in zip(candidate.batches, candidate.pass_seconds):  # one pass per batch: choice-like rows
        assert seconds > 2 * LLAMA_70B.decoder_params * len(batch) * 4000 / 1e11
    assert candidate.seconds_per_pass == candidate.compute_seconds_per_pass
    assert any("compute-bound" in c for c in candidate.caveats)


def test_decode_passes_take_as_long_as_streaming_the_weights_and_kv_cache_from_memory():
    """A decode step of a few sequences is bound by RAM, not FLOPs (several times slower on a CPU): with the memory
    rate measured, the median (decode) pass is every weight plus the KV cache moved KV_COPIES_PER_DECODE times."""
    rows = [RowCost(300, 8)] * 4
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11)
    flops_only = plan(**options)
    bound = plan(**options, memory_bytes_per_s=1e10)
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 2
    kv_at = [4 * kv_bytes_for_sequence(LLAMA_70B, 2, 300 + step) for step in range(1, 8)]
    memory_rate = 1e10 / HOST_FRESH_PAGE_SLOWDOWN  # on the host every pass also faults in fresh pages
    decode = sorted((weights + KV_COPIES_PER_DECODE * kv) / memory_rate for kv in kv_at)
    assert bound.memory_bytes_per_s == 1e10 and flops_only.memory_bytes_per_s is None
    assert bound.seconds_per_pass == pytest.approx((decode[3] + decode[4]) / 2)  # median of 1 prefill + 7 decodes
    assert bound.seconds_per_pass > 5 * flops_only.seconds_per_pass
    # the prefill (1200 tokens) stays FLOP-bound: its weights stream once for all of them
    assert bound.eta_seconds - flops_only.eta_seconds == pytest.approx(
        sum(decode) - 7 * flops_only.seconds_per_pass, rel=0.01)


def test_decode_passes_are_priced_at_the_rate_their_row_count_reads_the_layer_matrices():
    """With rates measured by row count (measure.decode_rates), each decode pass's weights stream at its own rows'
    rate, interpolated: 4 sequences at 4 rows' 5 GB/s take twice the 10 GB/s memory rate. The prefill and the KV
    cache are priced as before."""
    rows = [RowCost(300, 8)] * 4
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11,
                   memory_bytes_per_s=1e10)
    flat = plan(**options)
    by_rows = plan(**options, decode_rates={1: 2e10, 4: 5e9, 16: 1e9})
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 2
    assert by_rows.pass_seconds[0] == flat.pass_seconds[0]  # the prefill
    for priced, before in zip(by_rows.pass_seconds[1:], flat.pass_seconds[1:]):
        assert priced - before == pytest.approx(weights / (5e9 / HOST_FRESH_PAGE_SLOWDOWN)
                                                - weights / (1e10 / HOST_FRESH_PAGE_SLOWDOWN))
    assert plan(**options | dict(memory_bytes_per_s=None), decode_rates={4: 5e9}).pass_seconds == \
        plan(**options | dict(memory_bytes_per_s=None)).pass_seconds  # FLOPs alone: no memory terms at all


def test_every_forward_call_through_a_layer_adds_the_layers_fixed_cost_to_its_pass():
    """Beyond its roofline, a pass pays a decoder layer's fixed cost (Python, small ops) once per layer for each of
    its forward calls: the prefill's calls cut by length plus the shared prefix's own, each decode call."""
    rows = [RowCost(1200, 4)] * 2 + [RowCost(240, 4)] * 2  # a 200-token shared prefix, then 1,000 or 40 tokens
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11,
                   memory_bytes_per_s=1e10, shared_prefix_tokens=200)
    bare, with_calls = plan(**options), plan(**options, layer_call_seconds=1e-3)
    own = [without_prefix(row, 200) for row in rows]
    calls = prefill_call_count(own, range(4), bare.micro_batch_size, "cpu")
    assert bare.passes == 4 and calls == 2  # cut by length
    layers = LLAMA_70B.num_layers
    assert with_calls.pass_seconds[0] - bare.pass_seconds[0] == pytest.approx(layers * (calls + 1) * 1e-3)
    for priced, before in zip(with_calls.pass_seconds[1:], bare.pass_seconds[1:]):
        assert priced - before == pytest.approx(layers * 1e-3)  # the four sequences decode in one call
    assert with_calls.eta_seconds > bare.eta_seconds


def test_a_host_streaming_with_a_reader_decodes_on_one_thread_fewer():
    """stream.py leaves a core to the reader in decode passes: on 2 threads a decode pass computes on one, its
    roofline twice as long (each layer call's fixed cost, Python, stays what it is); the prefill keeps every thread,
    and so do decode passes whose linears widen a narrower checkpoint's tiles on every core, a run without a reader
    thread and a resident one."""
    options = dict(rows=[RowCost(300, 4)] * 4, streaming="always", bandwidth=Bandwidth(1e15, "declared", "fast"),
                   memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11, memory_bytes_per_s=1e10,
                   layer_call_seconds=1e-4)
    one, two = plan(**options, compute_threads=1), plan(**options, compute_threads=2)
    assert two.pass_seconds[0] == one.pass_seconds[0]  # the prefill
    calls = LLAMA_70B.num_layers * 1e-4  # one decode call through every layer
    for decode_two, decode_one in zip(two.pass_seconds[1:], one.pass_seconds[1:]):
        assert decode_two - calls == pytest.approx(2 * (decode_one - calls))
    for unchanged in (dict(compute_dtype="float32"), dict(prefetch=False), dict(streaming="never")):
        assert plan(**options | unchanged, compute_threads=2).pass_seconds == \
            plan(**options | unchanged, compute_threads=1).pass_seconds


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


def test_decode_micro_batches_that_cannot_merge_are_priced_a_call_each():
    """Sliding-window caches of rows longer than the window cannot be padded and stacked: each admission's
    micro-batch decodes in a call of its own while one of its rows lives, and each call reads every weight from RAM
    once more. Row 0 ends after 2 tokens; row 2, admitted into its place, decodes beside row 1 in two calls."""
    rows = [RowCost(600, 2), RowCost(600, 4), RowCost(600, 4), RowCost(600, 4)]
    schedule = refill_schedule(rows, [0, 1, 2, 3], 2, 10**9)
    assert [(p.admitted, p.decoding) for p in schedule[:4]] == [((0, 1), ()), ((), (0, 1)), ((2,), (1,)),
                                                                ((), (1, 2))]
    pricing = PassPricing(LLAMA_70B, 2, "cpu", flops_per_s=4e11, memory_bytes_per_s=1e10, layer_call_seconds=1e-4)
    merged = job_timeline(pricing, rows, [], None, schedule=schedule).compute_seconds
    unmerged = job_timeline(pricing, rows, [], None, schedule=schedule, decode_merges=False).compute_seconds
    assert unmerged[:3] == merged[:3]  # one micro-batch alive until row 2 joins
    weights = pass_memory_bytes(LLAMA_70B, 2, 2, 604, True)[0]
    assert unmerged[3] - merged[3] == pytest.approx(weights / 1e10 + LLAMA_70B.num_layers * 1e-4)


def test_a_row_counts_weight_rate_is_interpolated_in_time_per_byte():
    rates = {1: 2e10, 4: 1e10, 16: 4e9}
    assert weight_rate_at(rates, 1) == 2e10 and weight_rate_at(rates, 4) == 1e10
    assert weight_rate_at(rates, 10) == pytest.approx(1 / (0.5 / 1e10 + 0.5 / 4e9))  # halfway from 4 to 16 rows
    assert weight_rate_at(rates, 32) == pytest.approx(2e9)  # past the last: time per byte doubles with the rows
    assert weight_rate_at({8: 1e10}, 2) == 1e10  # below the fewest measured: their rate


def test_a_host_streaming_pass_also_moves_the_layers_through_ram_copied_and_a_prefill_widened():
    """The kernel copies each layer out of the page cache, and for a prefill a bf16 checkpoint computed in float32 is
    widened in its slot (a decode pass widens tiles inside its matmuls): RAM traffic the host's passes share; an
    accelerator computes beside it, a resident run has none."""
    decoder = LLAMA_70B.decoder_bytes  # bf16
    assert host_streaming_bytes(LLAMA_70B, 4) == 2 * decoder + decoder + 2 * decoder  # copy; read bf16, write f32
    assert host_streaming_bytes(LLAMA_70B, 4, decode=True) == 2 * decoder  # the copy only
    assert host_streaming_bytes(LLAMA_70B, 2) == 2 * decoder  # computed at its stored dtype: the copy only
    options = dict(rows=[RowCost(300, 8)] * 4, streaming="always", bandwidth=Bandwidth(1e15, "declared", "fast"),
                   memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11, memory_bytes_per_s=1e10,
                   compute_dtype="float32")
    host, accelerator = plan(**options), plan(**options, device="cuda")
    slowed_rate = 1e10 / HOST_FRESH_PAGE_SLOWDOWN
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 4
    kv_at = [4 * kv_bytes_for_sequence(LLAMA_70B, 4, 300 + step) for step in range(1, 8)]
    decode = sorted((weights + KV_COPIES_PER_DECODE * kv + host_streaming_bytes(LLAMA_70B, 4, decode=True))
                    / slowed_rate for kv in kv_at)
    assert host.seconds_per_pass == pytest.approx((decode[3] + decode[4]) / 2)  # median of 1 prefill + 7 decodes
    assert sorted(host.pass_seconds[1:]) == pytest.approx(decode)  # every pass, kept for benchmarks/plan_accuracy
    assert "pass_seconds" not in host.to_json()  # the JSON plan stays a summary
    copied = host_streaming_bytes(LLAMA_70B, 4, decode=True)
    assert accelerator.seconds_per_pass < host.seconds_per_pass - copied / 1e10
    resident = plan(**options | dict(streaming="never"))
    assert resident.mode == "resident"
    assert resident.seconds_per_pass < host.seconds_per_pass - copied / slowed_rate * 0.99


def test_resident_eta_counts_loading_once_and_compute_per_pass():
    candidate = plan(TINY, rows=[RowCost(100, 3)], compute_dtype="float32", compute_flops_per_s=1e9)
    assert candidate.io_seconds_per_pass == 0
    assert candidate.eta_seconds > candidate.load_seconds == TINY.checkpoint_bytes / 1e9
    assert plan(TINY, compute_dtype="float32", compute_flops_per_s=None).eta_seconds is None


# --- output -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds, text", [
    (2.46, "2.5 s"), (42, "42 s"), (180, "3 min"), (3.4 * 3600, "3.4 h"), (2.3 * 86400, "2.3 days"),
    (None, "unknown"), (0, "0 s"), (0.0012, "1.2 ms"), (0.035, "35 ms"), (0.5, "500 ms"),
])
def test_durations_read_the_way_people_say_them(seconds, text):
    assert format_duration(seconds) == text


def test_bytes_read_in_binary_units():
    assert [format_bytes(n) for n in (512, 1.25 * GiB, 131 * GiB)] == ["512 B", "1.25 GiB", "131 GiB"]


def test_plan_json_is_serialisable_and_omits_row_indices():
    report = plan(rows=MIXED, streaming="always").to_json()
    assert json.loads(json.dumps(report))["batch_count"] == 2
    assert "batches" not in report and report["fits"] is True and report["eta_human"].endswith(("min", "h", "s"))


def test_plan_table_and_comparison_show_mode_memory_eta_and_blockers():
    request, rates, job = records(runtime_overhead_bytes=0)
    candidates = compare_modes(LLAMA_70B, MIXED, request, rates, **job)
    assert [(c.mode, c.prefetch) for c in candidates] == [("resident", True), ("streamed", True),
                                                           ("streamed", False)]
    table = format_plan_table(candidates[1].to_json())
    assert "streaming forced" in table and format_bytes(candidates[1].peak_memory_bytes) in table
    assert candidates[1].eta_human in table
    comparison = format_comparison(candidates)
    assert "streamed (no prefetch)" in comparison and "resident blockers:" in comparison
    assert "resident run does not fit" in comparison


def test_resumed_rows_are_packed_first_so_they_finish():
    """Rows a stopped run left half-written go into the first batch, whatever their length; the rest by length."""
    rows = [RowCost(50, 8), RowCost(400, 3, resumed=True), RowCost(60, 8), RowCost(300, 5, resumed=True),
            RowCost(40, 0, (1, 1))]
    assert pack_batches(rows, max_sequences=2, max_tokens=10_000) == [[4], [3, 1], [0, 2]]
    assert without_prefix(rows[1], 30) == RowCost(370, 3, resumed=True)


def test_the_peak_counts_every_forward_call_of_the_prefill():
    """Each micro-batch's forward call is held suspended until the pass ends: six equal sequences in micro-batches
    of two make three calls, each counted."""
    rows = [RowCost(100, 0, (1, 1))] * 6
    one_call = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=None)
    three_calls = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=2)
    two_calls = batch_bytes(GEMMA_1B, 4, "cpu", rows, range(6), micro_sequences=3)
    assert three_calls - two_calls == PREFILL_CALL_BYTES - activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 101, 2)
    assert one_call >= 6 * activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 101, 2) + PREFILL_CALL_BYTES


def test_a_turn_is_sized_by_the_largest_forward_call_not_the_whole_batch():
    """The executor may keep a turn's freed pages while the process stays under the plan's peak less turn_bytes
    (host.heap.keep_freed_pages_below): that is the largest call the prefill makes, cut by length as the executor cuts
    it. 16 short and 16 long choice rows make two calls on the CPU; the long one is the largest turn."""
    rows = [RowCost(40, 0, (1, 1))] * 16 + [RowCost(900, 0, (1, 1))] * 16
    candidate = plan(GEMMA_1B, rows, compute_dtype="float32", memory_budget_bytes=64 * GiB)
    assert candidate.micro_batch_size is None and candidate.batches == [list(range(32))]
    long_call = 16 * activation_bytes_for_sequence(GEMMA_1B, 4, "cpu", 901, 2)
    assert candidate.turn_bytes == long_call
    assert candidate.turn_bytes < batch_bytes(GEMMA_1B, 4, "cpu", rows, range(32), micro_sequences=None)
    fixed = candidate.weights_bytes + candidate.runtime_overhead_bytes
    assert fixed + candidate.turn_bytes <= candidate.peak_memory_bytes

