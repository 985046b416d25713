"""Batches, micro-batches and passes: row costs, packing by answer and prompt length, micro-batches that pad
least, the batch a budget buys, and the prefixes rows may share."""
from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchrun.checkpoint import kv_bytes_for_sequence
from batchrun.plan import RowCost, prefill_groups, shared_prefix_tokens, windows_allow_sharing, without_prefix
from batchrun.plan.batching import (MICRO_BATCH_COST_TOKENS, lower_bound_passes, micro_batches, pack_batches,
                                    pack_in_order, passes_for)
from batchrun.plan.memory import activation_bytes_for_sequence
from batchrun.plan.inputs import MEMORY_HEADROOM_SHARE
from tests.support import GEMMA_1B, LLAMA_70B, MIXED, TINY, GiB, plan


# --- rows, batches and passes -----------------------------------------------------------------------------------------


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


def test_resumed_rows_are_packed_first_so_they_finish():
    """Rows a stopped run left half-written go into the first batch, whatever their length; the rest by length."""
    rows = [RowCost(50, 8), RowCost(400, 3, resumed=True), RowCost(60, 8), RowCost(300, 5, resumed=True),
            RowCost(40, 0, (1, 1))]
    assert pack_batches(rows, max_sequences=2, max_tokens=10_000) == [[4], [3, 1], [0, 2]]
    assert without_prefix(rows[1], 30) == RowCost(370, 3, resumed=True)


# --- micro-batches ----------------------------------------------------------------------------------------------------


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


# --- the batch a budget buys ------------------------------------------------------------------------------------------


def test_batch_chosen_for_a_budget_buys_sequences_with_micro_batches():
    budget, overhead = 40 * GiB, 1 * GiB
    candidate = plan(rows=[RowCost(4000, 96)] * 28, device="cuda", streaming="always", token_matrices="held",
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
    assert (candidate.batching.batch_size, candidate.batching.micro_batch_size) == (expected, micro) == (15, 7)
    # static batches (15 + 13 rows) each run to their longest row; the bound assumes rows could join a pass
    # as others finish, which the executor does not do yet
    assert candidate.batching.passes == 2 * 96 and candidate.batching.lower_bound_passes == math.ceil(28 * 96 / 15)
    assert candidate.memory.peak_memory_bytes <= budget and candidate.fits


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
    assert (candidate.batching.batch_size, candidate.batching.micro_batch_size) == (13, micro)
    assert 7 < micro < 13  # larger than the 28-row job's share, still micro-batched
    assert candidate.batching.passes == candidate.batching.lower_bound_passes == 96
    assert candidate.memory.peak_memory_bytes <= budget and candidate.fits


def test_rows_that_fit_at_their_median_length_but_not_padded_to_the_longest_still_share_one_batch():
    """Three short rows and one long one: all four fit live at the median length, not padded to the longest. One
    batch with micro-batches (one pass, the lower bound), not two batches."""
    rows = [RowCost(100, 1)] * 3 + [RowCost(1000, 1)]
    weights = plan(rows=rows, device="cuda", streaming="always").memory.weights_bytes
    per_token = 327_680 + 8192 * 2 * 4 + 28672 * 2 * 3  # KV + hidden states x4 + MLP intermediate x3 (cuda)
    # room for 4 x 101 tokens live, not for 4 x 1001; but to hold 4 x 1001 tokens of KV and hidden states beside one
    # micro-batch of the longest row's activations
    free = 4 * 760 * per_token
    budget = math.ceil((free + weights + GiB) / 0.9)
    candidate = plan(rows=rows, device="cuda", streaming="always", memory_budget_bytes=budget,
                     runtime_overhead_bytes=GiB)
    assert candidate.batching.passes == candidate.batching.lower_bound_passes == 1
    assert candidate.batching.micro_batch_size is not None and candidate.batching.micro_batch_size < 4
    assert candidate.memory.peak_memory_bytes <= budget and candidate.fits


def test_decode_passes_regroup_micro_batches_within_the_memory_left_beside_the_kv_cache():
    """A decode call reads the layer's weights once however few sequences it carries: decode groups are as large
    as the memory beside the whole KV cache allows, never smaller than the prefill's micro-batch."""
    budget, overhead = 40 * GiB, 1 * GiB
    candidate = plan(rows=[RowCost(4000, 96)] * 28, device="cuda", streaming="always",
                     memory_budget_bytes=budget, runtime_overhead_bytes=overhead)
    free = int(budget * 0.9) - candidate.memory.weights_bytes - overhead
    kv_cache = candidate.batching.batch_size * kv_bytes_for_sequence(LLAMA_70B, 2, 4096)
    expanded_kv = 2 * 64 * 128 * 4096 * 2  # one layer's K and V repeated to all 64 query heads
    per_sequence = expanded_kv + activation_bytes_for_sequence(LLAMA_70B, 2, "cuda", 1, 1)
    expected = min(candidate.batching.batch_size,
                   max(candidate.batching.micro_batch_size, (free - kv_cache) // per_sequence))
    assert candidate.batching.decode_micro_batch_size == expected
    batching = candidate.batching
    assert batching.micro_batch_size < batching.decode_micro_batch_size <= batching.batch_size
    # when every sequence fits in one forward call, so does every decode
    assert plan(rows=[RowCost(300, 8)] * 4, streaming="always").batching.decode_micro_batch_size is None


def test_user_batch_size_caps_the_batch():
    candidate = plan(rows=[RowCost(100, 4)] * 20, streaming="always", batch_size=3)
    assert candidate.batching.batch_size == 3 and max(len(b) for b in candidate.batching.batches) == 3
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
        assert candidate.memory.peak_memory_bytes <= budget_gib * GiB
        if not any("run in a batch of their own" in caveat for caveat in candidate.caveats):
            # the batches are sized against the budget less its headroom (README: Memory headroom)
            assert candidate.memory.peak_memory_bytes <= budget_gib * GiB * (1 - MEMORY_HEADROOM_SHARE)


def test_many_rows_of_varied_lengths_keep_the_plan_within_its_headroom():
    """Thousands of choice rows from 60 to 500 tokens, micro-batched on a CPU: the micro-batch holding the longest
    rows is the one the peak counts, so it is the one the plan buys activations for."""
    rows = [RowCost(60 + (i * 37) % 441, 0, (1, 1)) for i in range(20_000)]
    micro_batched = []
    for budget in (4 * GiB, 8 * GiB, 20 * GiB):
        candidate = plan(GEMMA_1B, rows, device="cpu", memory_budget_bytes=budget, streaming="always")
        assert candidate.fits and candidate.memory.peak_memory_bytes <= budget * (1 - MEMORY_HEADROOM_SHARE)
        micro_batched.append(candidate.batching.micro_batch_size is not None)
    assert any(micro_batched)


# --- shared prefixes --------------------------------------------------------------------------------------------------


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


def test_a_groups_rows_share_a_batch_and_count_their_head_once():
    from batchrun.plan import GROUP_PREFIX_MIN, with_group_heads

    head = GROUP_PREFIX_MIN + 30
    prompts = [[1] * 10 + [2] * head + [3, 4], [1] * 10 + [2] * head + [4, 3],  # a pair's orders: a long question
               [1] * 10 + [5] * 40 + [3], [1] * 10 + [5] * 40 + [4],  # a short one: not worth its own calls
               [1] * 10 + [6] * (head + 40)]
    rows = [RowCost(len(p), 0, (1, 1), group=g) for p, g in zip(prompts, (0, 0, 2, 2, None))]
    costs = with_group_heads(rows, prompts, everyone=10, own_tokens=2)
    assert [c.prompt_tokens for c in costs] == [len(prompts[0]), len(prompts[1]) - 10 - head, *map(len, prompts[2:])]
    # a batch takes a group whole: two sequences a batch never split the pair, whatever the lengths
    batches = pack_batches(costs, max_sequences=2, max_tokens=10**6)
    assert [0, 1] in batches and [2, 3] in batches
    # a group alone over a limit is cut as rows of their own would be
    assert sorted(pack_batches(costs[:2], max_sequences=1, max_tokens=10**6)) == [[0], [1]]
