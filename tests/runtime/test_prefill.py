"""Micro-batched passes and the shared prefix give the same numbers as plain transformers, one forward per
sequence (tests/reference.py: an in-memory AutoModelForCausalLM, independent of batchrun's handles)."""
from __future__ import annotations

import pytest
import torch

from batchrun.plan import MIN_SHARED_PREFIX
from batchrun.runtime import LayerReads, ResidentModel, StreamedModel
from batchrun.runtime.caches import PrefixSharedLayer
from batchrun.runtime.decode import decode, drop_finished, merge_for_decode
from batchrun.runtime.prefill import SharedPrefix, prefill
from tests.reference import assert_matches_reference, decode_matching_reference, sequences
from tests.support import copy_checkpoint

ARCHS_WITHOUT_WINDOWS = ["llama", "qwen2", "gpt_neox", "phi3", "mixtral", "gpt2"]


def open_handle(kind: str, path):
    if kind == "streamed":
        return StreamedModel(path, device="cpu", dtype=torch.float32)
    return ResidentModel(path, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("arch", ARCHS_WITHOUT_WINDOWS)
@pytest.mark.parametrize("kind", ["streamed", "resident"])
@pytest.mark.parametrize("micro_batch,share", [(None, True), (2, True), (1, False), (2, False)])
def test_prefill_equals_plain_forward(tiny_checkpoint, arch, kind, micro_batch, share):
    checkpoint = tiny_checkpoint(arch)
    handle = open_handle(kind, checkpoint)
    try:
        seqs = sequences(handle.model.config.vocab_size)
        passes_before = handle.passes
        got, states = prefill(handle, seqs, pad_id=0, keep=3, micro_batch=micro_batch, use_cache=True,
                              share_prefix=share)
        assert handle.passes == passes_before + 1  # however many micro-batches, one pass
        for seq, lp in zip(seqs, got):
            assert_matches_reference(lp, checkpoint, seq, keep=3)
        # decoding continues from the caches the prefill left
        next_tokens = {i: int(lp[-1].argmax()) for i, lp in enumerate(got)}
        stepped = decode(handle, states, next_tokens)
        for i, seq in enumerate(seqs):
            assert_matches_reference(stepped[i], checkpoint, seq + [next_tokens[i]])
    finally:
        handle.close()


@pytest.mark.parametrize("kind", ["streamed", "resident"])
def test_a_cpu_prefill_with_no_micro_batch_planned_cuts_short_and_long_prompts_apart(tiny_checkpoint, kind):
    """Every sequence fits at once (no micro-batch planned), yet short prompts are not padded to long ones: two
    forward calls (batching.prefill_groups), the same numbers as one plain forward per sequence."""
    checkpoint = tiny_checkpoint("llama")
    handle = open_handle(kind, checkpoint)
    calls = []
    hook = handle.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        generator = torch.Generator().manual_seed(3)
        vocab = handle.model.config.vocab_size
        seqs = [torch.randint(3, vocab, (length,), generator=generator).tolist() for length in (5, 90, 6, 88)]
        got, _ = prefill(handle, seqs, pad_id=0, keep=1, micro_batch=None, use_cache=False)
        assert len(calls) == 2
        for seq, lp in zip(seqs, got):
            assert_matches_reference(lp, checkpoint, seq)
    finally:
        hook.remove()
        handle.close()


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("group", [None, 3])
def test_decoding_in_merged_micro_batches_equals_plain_forward(tiny_checkpoint, arch, share, group):
    """Micro-batches of different padded widths merge for decoding; the padding they gain is never attended."""
    checkpoint = tiny_checkpoint(arch)
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as handle:
        seqs = sequences(handle.model.config.vocab_size, count=5)
        got, states = prefill(handle, seqs, pad_id=0, keep=1, micro_batch=1, use_cache=True, share_prefix=share)
        merged = merge_for_decode(states, group)
        assert len(merged) == (1 if group is None else 2)
        assert sorted(i for state in merged for i in state.members) == list(range(len(seqs)))
        tokens = {i: int(lp[-1].argmax()) for i, lp in enumerate(got)}
        for step in range(3):
            if step == 2:  # a finished sequence leaves a merged micro-batch too
                merged = drop_finished(merged, {0})
                del tokens[0]
            stepped = decode(handle, merged, tokens)
            for i in tokens:
                seqs[i] = seqs[i] + [tokens[i]]
                assert_matches_reference(stepped[i], checkpoint, seqs[i])
            tokens = {i: int(lp.argmax()) for i, lp in stepped.items()}


def test_micro_batched_streamed_pass_reads_each_layer_once(tiny_checkpoint):
    # without prefetch, so no layer of the next pass is read ahead and the bytes per pass are exact
    with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32,
                       reads=LayerReads(prefetch=False)) as handle:
        seqs = sequences(handle.model.config.vocab_size, count=6)
        prefill(handle, seqs[:1], 0, keep=1, micro_batch=None, use_cache=False)
        one_pass = handle.bytes_read
        prefill(handle, seqs, 0, keep=1, micro_batch=1, use_cache=False, share_prefix=True)
        # 6 micro-batches plus the shared prefix: still one read of the decoder stack
        assert handle.bytes_read == 2 * one_pass
        assert handle.peak_materialised_layers == 1
        assert all(p.is_meta for p in handle.layers.parameters())


def test_shared_prefix_is_computed_once(tiny_checkpoint):
    """The prefix rides as one extra sequence: the layers see prefix + suffix tokens, not B copies."""
    with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32) as handle:
        seqs = sequences(handle.model.config.vocab_size, shared=MIN_SHARED_PREFIX + 8, count=4)
        seen = []
        hook = handle.layers[0].register_forward_pre_hook(
            lambda m, args: seen.append(args[0].shape[0] * args[0].shape[1]))
        prefill(handle, seqs, 0, keep=1, micro_batch=None, use_cache=True, share_prefix=True)
        hook.remove()
        shared = MIN_SHARED_PREFIX + 8
        suffix_width = max(len(s) for s in seqs) - shared
        assert sum(seen) == shared + len(seqs) * suffix_width


def test_shared_prefix_kv_is_held_once(tiny_checkpoint):
    """Each sequence keeps only its own tokens' keys and values; the prefix's are one tensor for the whole pass."""
    with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32) as handle:
        shared = MIN_SHARED_PREFIX + 8
        seqs = sequences(handle.model.config.vocab_size, shared=shared, count=4)
        _, states = prefill(handle, seqs, 0, keep=1, micro_batch=2, use_cache=True, share_prefix=True)
        suffix_width = max(len(s) for s in seqs[:2]) - shared
        first_layers = [state.cache.layers[0] for state in states]
        assert first_layers[0].keys.shape[0] == 2 and first_layers[0].keys.shape[-2] == suffix_width
        assert first_layers[0].prefix_keys.shape[0] == 1 and first_layers[0].prefix_keys.shape[-2] == shared
        assert first_layers[0].prefix_keys.data_ptr() == first_layers[1].prefix_keys.data_ptr()
        assert states[0].cache.get_seq_length() == shared + suffix_width


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
@pytest.mark.parametrize("kind", ["streamed", "resident"])
def test_a_pass_no_decode_follows_keeps_no_keys_and_values_of_its_own(tiny_checkpoint, arch, kind):
    """Choice scoring (use_cache=False) with a shared prefix: each layer's own keys and values go when the layer is
    done, so a batch holds no KV cache beyond the prefix's, and the log-probs are still the plain model's."""
    checkpoint = tiny_checkpoint(arch)
    handle = open_handle(kind, checkpoint)
    try:
        shared = MIN_SHARED_PREFIX + 8
        seqs = sequences(handle.model.config.vocab_size, shared=shared, count=5)
        got, states = prefill(handle, seqs, 0, keep=3, micro_batch=2, use_cache=False, share_prefix=True)
        for seq, lp in zip(seqs, got):
            assert_matches_reference(lp, checkpoint, seq, keep=3)
        layers = [layer for state in states for layer in state.cache.layers]
        assert len(layers) == len(states) * handle.model.config.num_hidden_layers
        assert all(layer.keys is None and layer.values is None for layer in layers)
        assert all(layer.get_seq_length() == shared for layer in layers)
    finally:
        handle.close()


def test_sliding_window_models_do_not_share_prefixes_rows_reach_past_the_window(tiny_checkpoint):
    checkpoint = tiny_checkpoint("gemma3")
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as handle:
        window = handle.model.config.sliding_window
        assert SharedPrefix.usable(handle.model, window) and not SharedPrefix.usable(handle.model, window + 1)
        seqs = sequences(handle.model.config.vocab_size)  # 28-40 tokens against a window of 8
        got, states = prefill(handle, seqs, 0, keep=1, micro_batch=2, use_cache=True, share_prefix=True)
        assert not any(isinstance(layer, PrefixSharedLayer) for state in states for layer in state.cache.layers)
        for seq, lp in zip(seqs, got):
            assert_matches_reference(lp, checkpoint, seq)


@pytest.mark.parametrize("kind", ["streamed", "resident"])
def test_sliding_window_models_share_a_prefix_when_every_row_fits_the_window(tiny_checkpoint, tmp_path, kind):
    """Rows of 28-40 tokens decoding 3 more fit a window of 43: the windowed layers attend like full ones, so the
    prefix is computed once, and prefill and decode steps give plain transformers' numbers (one sequence each)."""
    # the tiny Gemma 3 (two sliding layers, one full) with a wider window: same weights, other masks
    checkpoint = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "gemma3-window-43",
                                 config={"sliding_window": 43})
    handle = open_handle(kind, checkpoint)
    try:
        seqs = sequences(handle.model.config.vocab_size)
        got, states = prefill(handle, seqs, 0, keep=1, micro_batch=2, use_cache=True, share_prefix=True,
                              decode_tokens=3)
        assert all(isinstance(layer, PrefixSharedLayer) for state in states for layer in state.cache.layers)
        states = merge_for_decode(states, None)  # shared caches merge across length groups
        assert len(states) == 1
        tokens = {i: int(lp[-1].argmax()) for i, lp in enumerate(got)}
        for seq, lp in zip(seqs, got):
            assert_matches_reference(lp, checkpoint, seq)
        for after in (1, 0):
            stepped = decode(handle, states, tokens, tokens_after=after)
            for i in tokens:
                seqs[i] = seqs[i] + [tokens[i]]
                assert_matches_reference(stepped[i], checkpoint, seqs[i])
            tokens = {i: int(lp.argmax()) for i, lp in stepped.items()}
        # one decode step more than announced would reach past the window: such a pass does not share
        _, states = prefill(handle, seqs[:2], 0, keep=1, micro_batch=None, use_cache=True, share_prefix=True,
                            decode_tokens=43 - max(len(seq) for seq in seqs[:2]) + 1)
        assert not any(isinstance(layer, PrefixSharedLayer) for state in states for layer in state.cache.layers)
    finally:
        handle.close()


def test_a_failing_micro_batch_fails_the_pass_and_releases_layers(tiny_checkpoint):
    with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32) as handle:
        def boom():
            raise ValueError("bad micro-batch")

        good = lambda: handle.model(input_ids=torch.tensor([[5, 6, 7]]))  # noqa: E731
        with pytest.raises(ValueError, match="bad micro-batch"):
            handle.run_pass([good, boom, good])
        assert all(p.is_meta for p in handle.layers.parameters())
        # and the model still works afterwards
        assert handle.run_pass([good, good])[0].logits.shape[0] == 1


@pytest.mark.parametrize("share", [True, False])
def test_decode_steps_write_into_the_room_kept_for_them(tiny_checkpoint, share):
    """After the first decode step moves a layer's keys into a buffer with room for the steps announced, later steps
    append in place (no copy of the cache per step), and the log-probs stay those of plain transformers."""
    checkpoint = tiny_checkpoint("llama")
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32) as handle:
        seqs = sequences(handle.model.config.vocab_size, shared=MIN_SHARED_PREFIX + 4, count=3)
        got, states = prefill(handle, seqs, 0, keep=1, micro_batch=None, use_cache=True, share_prefix=share)
        tokens = {i: int(lp[-1].argmax()) for i, lp in enumerate(got)}
        addresses = []
        for after in (2, 1, 0):
            stepped = decode(handle, states, tokens, tokens_after=after)
            addresses.append(states[0].cache.layers[0].keys.data_ptr())
            for i in tokens:
                seqs[i] = seqs[i] + [tokens[i]]
                assert_matches_reference(stepped[i], checkpoint, seqs[i])
            tokens = {i: int(lp.argmax()) for i, lp in stepped.items()}
        assert addresses[0] == addresses[1] == addresses[2]
        layer = states[0].cache.layers[0]
        assert layer._room[0].shape[-2] == layer.keys.shape[-2]  # exactly the room announced, none left over
        # rows leaving the batch take their room with them: the cache holds no buffer of the larger batch
        drop_finished(states, {0})
        assert layer._room is None and layer.keys.shape[0] == 2


@pytest.mark.parametrize("kind", ["streamed", "resident"])
def test_sliding_window_layers_hold_only_their_window_after_a_prefill(tiny_checkpoint, kind):
    """transformers keeps a window as a view of the whole prompt's keys: the plan counts the window, so the prompt's
    keys and values must not outlive the prefill. Decoding from the trimmed cache still equals plain transformers."""
    checkpoint = tiny_checkpoint("gemma3")
    with open_handle(kind, checkpoint) as handle:
        window = handle.model.config.sliding_window
        seqs = sequences(handle.model.config.vocab_size, shared=4 * window, count=3)
        got, states = prefill(handle, seqs, 0, keep=1, micro_batch=2, use_cache=True, share_prefix=False)
        sliding = [layer for state in states for layer in state.cache.layers if layer.is_sliding]
        assert sliding and all(layer.keys.shape[-2] < window for layer in sliding)
        assert all(t.untyped_storage().nbytes() == t.nbytes for layer in sliding for t in (layer.keys, layer.values))
        decode_matching_reference(handle, states, got, seqs, checkpoint, steps=3)


@pytest.mark.parametrize("decode_groups", [None, 2])
def test_streamed_decode_passes_leave_the_loader_a_core_and_prefills_use_every_core(tiny_checkpoint, decode_groups):
    """A decode pass computes less per layer than reading the next takes: on the CPU its forward runs on one thread
    fewer, so the reader and the widening are not fighting the matmuls for the cores. A prefill keeps them all, and
    every core is given back after the pass (also after several micro-batches, each on its own thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32) as streamed:
            seen: list[tuple[str, int]] = []
            phase = ["prefill"]
            hook = streamed.layers[0].register_forward_pre_hook(
                lambda module, args: seen.append((phase[0], torch.get_num_threads())))
            seqs = sequences(streamed.model.config.vocab_size)
            got, states = prefill(streamed, seqs, pad_id=0, keep=1, micro_batch=2, use_cache=True, share_prefix=False)
            states = merge_for_decode(states, decode_groups)
            phase[0] = "decode"
            decode(streamed, states, {i: int(lp[-1].argmax()) for i, lp in enumerate(got)})
            hook.remove()
            assert torch.get_num_threads() == 2
        assert {threads for step, threads in seen if step == "prefill"} == {2}
        assert {threads for step, threads in seen if step == "decode"} == {1}
        assert len([step for step, _ in seen if step == "decode"]) == len(states)
    finally:
        torch.set_num_threads(before)


def test_resident_decode_passes_use_every_core(tiny_checkpoint):
    handle = ResidentModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        handle.layers[0].register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
        seqs = sequences(handle.model.config.vocab_size)
        got, states = prefill(handle, seqs, pad_id=0, keep=1, micro_batch=None, use_cache=True)
        decode(handle, states, {i: int(lp[-1].argmax()) for i, lp in enumerate(got)})
        assert seen == [2, 2, 2]  # the shared prefix, the prefill, the decode pass
    finally:
        handle.close()
        torch.set_num_threads(before)


def test_decode_passes_read_a_layer_further_ahead_and_free_that_slot_before_the_next_prefill(tiny_checkpoint):
    """The plan may give decode passes one more layer slot (the memory the prefill's activations held): decode
    passes then keep three layers materialised, and the next prefill has its two again, the third slot's buffers
    freed before its activations need the memory. Answers are unchanged."""
    checkpoint = tiny_checkpoint("llama")
    with StreamedModel(checkpoint, device="cpu", dtype=torch.float32, reads=LayerReads(decode_depth=2)) as handle:
        slots_seen: list[tuple[str, int]] = []
        phase = ["prefill"]
        handle.layers[0].register_forward_pre_hook(
            lambda module, args: slots_seen.append((phase[0], handle.slots.count)))
        buffered_slots = lambda: {key[0] for key in handle.loader._buffers}  # noqa: E731
        seqs = sequences(handle.model.config.vocab_size, count=4)
        got, states = prefill(handle, seqs, pad_id=0, keep=1, micro_batch=2, use_cache=True, share_prefix=True)
        assert len(buffered_slots()) == 2
        phase[0] = "decode"
        decode_matching_reference(handle, states, got, seqs, checkpoint, steps=2)
        assert len(buffered_slots()) == 3
        phase[0] = "prefill"
        again, _ = prefill(handle, seqs, pad_id=0, keep=1, micro_batch=2, use_cache=False)
        assert len(buffered_slots()) == 2 and handle.slots.count == 2
        for i, seq in enumerate(seqs):
            assert_matches_reference(again[i][-1], checkpoint, seq)
    assert {count for step, count in slots_seen if step == "decode"} == {3}
    assert {count for step, count in slots_seen if step == "prefill"} == {2}
