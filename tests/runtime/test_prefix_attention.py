"""Decode attention over [shared prefix | own tokens] in two parts equals attention over their concatenation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchrun.plan import MIN_SHARED_PREFIX
from batchrun.runtime import StreamedModel, cache_argument, output_cache, prefix_attention
from batchrun.runtime.decode import merge_for_decode
from batchrun.runtime.prefill import prefill
from tests.reference import assert_matches_reference, decode_matching_reference, sequences
from tests.tiny_models import TINY_ARCHS


def concatenated(query, own_keys, own_values, prefix_keys, prefix_values, mask, scaling):
    batch, heads = own_keys.shape[:2]
    keys = torch.cat([prefix_keys.expand(batch, -1, -1, -1), own_keys], dim=-2)
    values = torch.cat([prefix_values.expand(batch, -1, -1, -1), own_values], dim=-2)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                           enable_gqa=query.shape[1] != heads)
    return out.transpose(1, 2)


@pytest.mark.parametrize("query_heads,heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["bool", "float", None])
def test_attention_in_two_parts_equals_attention_over_the_concatenation(query_heads, heads, mask_kind):
    generator = torch.Generator().manual_seed(3)
    batch, prefix, own, dim = 5, 11, 7, 16
    query = torch.randn(batch, query_heads, 1, dim, generator=generator)
    own_keys, own_values = (torch.randn(batch, heads, own, dim, generator=generator) for _ in range(2))
    prefix_keys, prefix_values = (torch.randn(1, heads, prefix, dim, generator=generator) for _ in range(2))
    mask = None
    if mask_kind is not None:
        attend = torch.ones(batch, 1, 1, prefix + own, dtype=torch.bool)
        attend[1, ..., prefix:prefix + 3] = False  # left padding of a shorter sequence among its own tokens
        attend[3, ..., prefix:prefix + 5] = False
        mask = attend if mask_kind == "bool" else torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))
    got = prefix_attention.attend_with_prefix(query, own_keys, own_values, prefix_keys, prefix_values, mask, 0.3)
    expected = concatenated(query, own_keys, own_values, prefix_keys, prefix_values, mask, 0.3)
    assert got.shape == (batch, 1, query_heads, dim)
    assert (got - expected).abs().max().item() <= 1e-5


def test_the_wrapper_leaves_unmarked_calls_to_transformers():
    """Outside a marked decode step (any model in the process, a prefill, a reference run) sdpa is transformers'."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prefix_attention.install()
    query, keys, values = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    module = torch.nn.Module()
    module.is_causal = True
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, keys, values, None, scaling=0.5)
    original = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__
    expected, _ = original(module, query, keys, values, None, scaling=0.5)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_decoding_after_a_shared_prefix_reads_the_prefix_in_place(tiny_checkpoint, monkeypatch, arch):
    """Every decode step of a prefix-sharing micro-batch takes the two-part path, and the tokens' log-probs are those
    of plain transformers over the whole sequence."""
    taken = []
    two_parts = prefix_attention.attend_with_prefix
    monkeypatch.setattr(prefix_attention, "attend_with_prefix", lambda *a: taken.append(a[0].shape) or two_parts(*a))
    grouped = prefix_attention.attend_grouped
    prefills = []
    monkeypatch.setattr(prefix_attention, "attend_grouped", lambda *a: prefills.append(a[0].shape) or grouped(*a))
    checkpoint = tiny_checkpoint(arch)
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as handle:
        layers = handle.model.config.num_hidden_layers
        seqs = sequences(handle.model.config.vocab_size, shared=MIN_SHARED_PREFIX + 4, count=4)
        got, states = prefill(handle, seqs, 0, keep=1, micro_batch=2, use_cache=True, share_prefix=True)
        assert not taken  # the prefill attends to the concatenation: many query tokens...
        assert len(prefills) == 2 * layers  # ...each micro-batch's through grouped SDPA, at every layer
        for i, lp in enumerate(got):
            assert_matches_reference(lp[-1], checkpoint, seqs[i])
        states = merge_for_decode(states, None)
        decode_matching_reference(handle, states, got, seqs, checkpoint, steps=2)
        assert len(taken) == 2 * layers


@pytest.mark.parametrize("query_heads,heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_a_marked_prefill_attends_in_grouped_mode_as_transformers_does_over_copied_heads(query_heads, heads,
                                                                                          mask_kind):
    """A prefill of a prefix-sharing micro-batch (many query tokens, keys already [prefix | own]) skips transformers'
    per-query-head copies of the keys and values on a CPU, and gets transformers' result."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(7)
    batch, prefix, own, dim = 3, 6, 5, 8
    query = torch.randn(batch, query_heads, own, dim, generator=generator)
    keys, values = (torch.randn(batch, heads, prefix + own, dim, generator=generator) for _ in range(2))
    attend = torch.ones(batch, 1, own, prefix + own, dtype=torch.bool).tril(diagonal=prefix)
    attend[1, ..., prefix:prefix + 2] = False  # left padding among the own tokens
    mask = attend if mask_kind == "bool" else torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = query_heads // heads, True
    prefix_attention.mark_next_call(keys[:1, :, :prefix], values[:1, :, :prefix], keys)
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, keys, values, mask, scaling=0.4)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__(module, query, keys, values, mask, scaling=0.4)
    assert got.shape == (batch, own, query_heads, dim)
    assert (got - expected).abs().max().item() <= 1e-6
    assert got.is_contiguous()


def test_a_decode_step_that_does_not_attend_as_marked_fails_instead_of_dropping_the_prefix():
    """Attention over the own tokens alone would be silently wrong: an architecture that transforms the keys between
    its cache and sdpa, or attends through another function, fails the pass."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    query, keys, values = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    prefix_keys, prefix_values = torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8)
    prefix_attention.mark_next_call(prefix_keys, prefix_values, keys)
    with pytest.raises(prefix_attention.PrefixAttentionError, match="other keys"):
        ALL_ATTENTION_FUNCTIONS["sdpa"](torch.nn.Module(), query, keys.clone(), values, None, scaling=0.5)
    prefix_attention.mark_next_call(prefix_keys, prefix_values, keys)  # a call that never comes...
    with pytest.raises(prefix_attention.PrefixAttentionError, match="never reached"):
        prefix_attention.mark_next_call(prefix_keys, prefix_values, keys)  # ...is caught at the next layer's mark
    # and the thread is left clean for what follows
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](torch.nn.Module(), query, keys, values, None, scaling=0.5)
    assert torch.equal(got, ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__(torch.nn.Module(), query, keys, values, None,
                                                                         scaling=0.5)[0])


def test_a_marked_call_with_a_position_bias_attends_to_the_concatenation_through_transformers():
    """Scores the two-part path does not model (here a position bias) go to transformers' sdpa over prefix + own."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(5)
    query, keys, values = (torch.randn(2, 4, 1, 8, generator=generator), torch.randn(2, 4, 6, 8, generator=generator),
                           torch.randn(2, 4, 6, 8, generator=generator))
    prefix_keys = torch.randn(1, 4, 5, 8, generator=generator)
    prefix_values = torch.randn(1, 4, 5, 8, generator=generator)
    bias = torch.randn(2, 4, 1, 11, generator=generator)
    prefix_attention.mark_next_call(prefix_keys, prefix_values, keys)
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](torch.nn.Module(), query, keys, values, None, scaling=0.5,
                                             position_bias=bias)
    full_keys = torch.cat([prefix_keys.expand(2, -1, -1, -1), keys], dim=-2)
    full_values = torch.cat([prefix_values.expand(2, -1, -1, -1), values], dim=-2)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__(torch.nn.Module(), query, full_keys, full_values, None,
                                                              scaling=0.5, position_bias=bias)
    assert torch.equal(got, expected)
    without_bias = prefix_attention.attend_with_prefix(query, keys, values, prefix_keys, prefix_values, None, 0.5)
    assert not torch.allclose(got, without_bias, atol=1e-3)  # the bias mattered: the two-part path was not taken


@pytest.mark.parametrize("window, two_part", [(11, True), (64, True), (10, False)])
def test_a_sliding_window_that_covers_every_key_keeps_the_two_part_path(monkeypatch, window, two_part):
    """Gemma passes its layer's window to the attention function; over 5 prefix + 6 own keys a window of 11 or more
    masks nothing (prefixes are shared only then), a smaller one would, and goes to transformers over the whole."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    generator = torch.Generator().manual_seed(6)
    query, keys, values = (torch.randn(2, 4, 1, 8, generator=generator), torch.randn(2, 4, 6, 8, generator=generator),
                           torch.randn(2, 4, 6, 8, generator=generator))
    prefix_keys = torch.randn(1, 4, 5, 8, generator=generator)
    prefix_values = torch.randn(1, 4, 5, 8, generator=generator)
    taken = []
    real = prefix_attention.attend_with_prefix
    monkeypatch.setattr(prefix_attention, "attend_with_prefix", lambda *a: taken.append(True) or real(*a))
    prefix_attention.mark_next_call(prefix_keys, prefix_values, keys)
    got, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](torch.nn.Module(), query, keys, values, None, scaling=0.5,
                                             sliding_window=window)
    assert bool(taken) == two_part
    full_keys = torch.cat([prefix_keys.expand(2, -1, -1, -1), keys], dim=-2)
    full_values = torch.cat([prefix_values.expand(2, -1, -1, -1), values], dim=-2)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"].__wrapped__(torch.nn.Module(), query, full_keys, full_values, None,
                                                              scaling=0.5)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("requested", [None, "eager"])
def test_the_plan_is_told_what_the_built_model_will_answer(tiny_checkpoint, tmp_path, arch, requested):
    """attends_through_sdpa (read from the config, before any model exists, for the plan's decode memory) agrees
    with supported (asked of the model the run builds), for every tiny architecture and for a config asking for
    eager attention."""
    checkpoint = tiny_checkpoint(arch)
    if requested is not None:
        checkpoint = Path(shutil.copytree(checkpoint, tmp_path / arch))
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps(config | {"attn_implementation": requested}))
    predicted = prefix_attention.attends_through_sdpa(AutoConfig.from_pretrained(checkpoint))
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as handle:
        assert predicted == prefix_attention.reads_prefix_in_place(handle.model)
    if requested == "eager":
        assert not predicted


def test_a_grouped_decode_step_through_sdpa_copies_no_keys_per_query_head(tiny_checkpoint, monkeypatch):
    """What the plan relies on where sdpa_groups_one_token_queries says so: a padded decode step of a grouped-query
    model (4 query heads on 2 key heads) reaches transformers' sdpa and never repeats its keys and values per query
    head, while its prefill does (a mask and several query tokens)."""
    from transformers.integrations import sdpa_attention

    repeated = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda states, n: repeated.append(states.shape[-2])
                        or real_repeat(states, n))
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads and prefix_attention.reads_prefix_in_place(model)
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        prefill_repeats = len(repeated)
        model(input_ids=first.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, torch.ones(2, 1)], 1).long(),
              use_cache=True, **{cache_argument(model): output_cache(first)})
    assert prefill_repeats == 2 * model.config.num_hidden_layers  # keys and values, each layer: the check can fail
    decode_repeats = len(repeated) - prefill_repeats
    assert (decode_repeats == 0) == prefix_attention.sdpa_groups_one_token_queries()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_a_half_precision_prefill_attends_in_chunks_as_float32_attention_does(monkeypatch, dtype, mask_kind):
    """Half-precision prefill attention runs one sequence and a few query rows at a time; it must equal float32
    attention over the same inputs to half precision's rounding, whatever the chunk, and a query row with nothing
    to attend must stay finite (its NaN would reach every row through the next layer's values)."""
    generator = torch.Generator().manual_seed(11)
    batch, query_heads, heads, prefix, own, dim = 3, 8, 2, 9, 7, 16
    query = torch.randn(batch, query_heads, own, dim, generator=generator)
    keys, values = (torch.randn(batch, heads, prefix + own, dim, generator=generator) for _ in range(2))
    attend = torch.ones(batch, 1, own, prefix + own, dtype=torch.bool).tril(diagonal=prefix)
    attend[1, ..., prefix:prefix + 2] = False  # left padding among the own tokens
    attend[2, :, 0] = False  # a row that attends to nothing
    mask = attend if mask_kind == "bool" else torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(query_heads // heads, 1), values.repeat_interleave(query_heads // heads, 1),
        attn_mask=attend, scale=0.3).transpose(1, 2)
    for chunk_bytes in (1, 10 * query_heads * (prefix + own) * 3, 8 << 20):  # one row, three rows, all rows a chunk
        # attend_in_chunks reads the chunk size from its own module's global (imported from the plan)
        monkeypatch.setattr(prefix_attention, "ATTENTION_CHUNK_BYTES", chunk_bytes)
        got = prefix_attention.attend_grouped(query.to(dtype), keys.to(dtype), values.to(dtype),
                                              mask if mask_kind == "bool" else mask.to(dtype), 0.3)
        assert got.shape == (batch, own, query_heads, dim) and got.dtype == dtype and got.is_contiguous()
        assert torch.isfinite(got).all()
        attending = attend[:, 0].any(-1)  # [b, S]: rows with something to attend
        assert (got.float() - reference)[attending].abs().max().item() <= 3e-2
