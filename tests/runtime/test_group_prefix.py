"""A pair row's two orders share their prompt's head (the text before the first answer): a choice pass computes it
once for the two, and the choices score as plain transformers scores each sequence alone (tests/reference.py)."""
from __future__ import annotations

import math

import pytest
import torch

from batchrun.plan import GROUP_PREFIX_MIN
from batchrun.runtime import score_choices
from batchrun.runtime.group_prefix import grouped_heads
from batchrun.spec import EncodedRow, PairOrder, Request
from tests.reference import reference_logprobs
from tests.runtime.test_prefill import open_handle

PROBABILITY_TOLERANCE = 1e-5


def pair_rows(vocab: int, pairs: int, head: int, choice_ids) -> list[EncodedRow]:
    """Pairs of rows [everyone's head | the pair's question | answer 1 | answer 2 | tail], the two answers swapped in
    the second order; choice_ids: the two choices' token ids (single or multi-token)."""
    generator = torch.Generator().manual_seed(11)

    def tokens(count: int) -> list[int]:
        return torch.randint(5, vocab, (count,), generator=generator).tolist()

    shared, tail = tokens(8), tokens(3)
    rows = []
    for pair in range(pairs):
        question, a, b = tokens(head), tokens(5 + pair), tokens(9)
        for order, (first, second) in (("ab", (a, b)), ("ba", (b, a))):
            index = len(rows)
            request = Request(index, f"p{pair}", "test", (("user", "x"),), "x", ("A", "B"), 0, (),
                              pair=PairOrder(order, len(a), len(b)))
            rows.append(EncodedRow(request, tuple(shared + question + first + second + tail), choice_ids))
    return rows


def reference_probs(checkpoint, row: EncodedRow) -> dict[str, float]:
    """The row's choice probabilities from plain transformers, one sequence per choice."""
    sums = []
    for choice in row.choice_ids:
        seq = list(row.prompt_ids) + list(choice)
        logprobs = reference_logprobs(checkpoint, seq, keep=len(choice) + 1)
        sums.append(sum(float(logprobs[k, token]) for k, token in enumerate(choice)))
    top = max(sums)
    weights = [math.exp(s - top) for s in sums]
    return {name: w / sum(weights) for name, w in zip(row.request.choices, weights)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
@pytest.mark.parametrize("kind", ["streamed", "resident"])
@pytest.mark.parametrize("choice_ids", [((7,), (9,)), ((7, 8), (9,))], ids=["one-token", "multi-token"])
def test_a_pairs_orders_score_behind_their_shared_head_as_each_alone(tiny_checkpoint, arch, kind, choice_ids):
    checkpoint = tiny_checkpoint(arch)
    handle = open_handle(kind, checkpoint)
    try:
        rows = pair_rows(handle.model.config.vocab_size, pairs=3, head=GROUP_PREFIX_MIN + 6, choice_ids=choice_ids)
        passes = handle.passes
        answers = score_choices(handle, rows, pad_id=0, micro_batch=2)
        assert handle.passes == passes + 1
        for row, answer in zip(rows, answers):
            assert answer.choice_probs == pytest.approx(reference_probs(checkpoint, row), abs=PROBABILITY_TOLERANCE)
    finally:
        handle.close()


def test_a_pair_computes_its_head_once_for_both_orders(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    handle = open_handle("resident", checkpoint)
    widths = []
    hook = handle.model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        kwargs["input_ids"].shape), with_kwargs=True)
    try:
        head = GROUP_PREFIX_MIN + 6
        rows = pair_rows(handle.model.config.vocab_size, pairs=2, head=head, choice_ids=((7,), (9,)))
        score_choices(handle, rows, pad_id=0, micro_batch=None)
    finally:
        hook.remove()
        handle.close()
    heads = [shape for shape in widths if shape[0] == 1]
    assert len(heads) == 2 and all(shape[1] == 8 + head for shape in heads)  # one head call a pair
    own = [shape for shape in widths if shape[0] == 2]  # each pair's two orders, behind their head
    assert len(own) == 2 and all(shape[1] < 8 + head for shape in own)


def test_a_head_no_longer_than_a_calls_cost_is_not_computed_apart():
    seqs = [[1] * 20 + [2] * 40 + [3, 4], [1] * 20 + [2] * 40 + [4, 3], [1] * 20 + [5] * 90 + [3], [1] * 20 + [5] * 90
            + [4]]
    assert grouped_heads(seqs, [[0, 1], [2, 3]], keep=1) == [([2, 3], 110)]  # 40 tokens beyond everyone's 20: no
