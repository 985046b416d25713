"""The embedding and head read as passes need them (runtime/token_matrices.py) give what the in-memory model gives:
logits, greedy generation and micro-batched passes, tied and untied, Gemma 3's scaled embedding included; the
vocabulary is never held."""
from __future__ import annotations

import pytest
import torch

from batchrun import StreamedModel
from batchrun.checkpoint import read_tensor_infos
from batchrun.runtime import LayerReads, stream
from tests.reference import TOLERANCE, reference_model
from tests.support import in_memory_logits, sample_ids
from tests.tiny_models import TINY_ARCHS

PLACEMENTS = {"gathered": LayerReads(gather_embeddings=True), "streamed-head": LayerReads(stream_head=True),
              "streamed": LayerReads(gather_embeddings=True, stream_head=True)}


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_logits_equal_in_memory_whatever_the_embedding_and_head_placement(tiny_checkpoint, arch, placement):
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS[placement]) as streamed:
        got = streamed(ids).logits
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied; tied with a scaled embedding
def test_greedy_generation_equals_in_memory_with_both_matrices_streamed(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    ref = reference_model(path)
    ids = sample_ids(ref.config.vocab_size, batch=2, length=12)
    with torch.inference_mode():
        expected = ref.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        assert torch.equal(streamed.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8), expected)


def _matrix_bytes(path, streamed: StreamedModel) -> int:
    """The embedding matrix as stored."""
    config = streamed.model.config.get_text_config()
    infos = read_tensor_infos(path)
    return next(info.nbytes for info in infos.values() if info.shape == (config.vocab_size, config.hidden_size))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied, tied
def test_a_micro_batched_pass_reads_the_head_once_for_every_call(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    ref = reference_model(path)
    ids = [sample_ids(ref.config.vocab_size, batch=1, length=10 + 3 * i) for i in range(3)]
    with torch.inference_mode():
        expected = [ref(row).logits for row in ids]
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        layers_before, before = streamed.loader.bytes_read, streamed.bytes_read
        got = streamed.run_pass([lambda row=row: streamed.model(row).logits for row in ids])
        layer_bytes = streamed.loader.bytes_read - layers_before
        outside_layers = streamed.bytes_read - before - layer_bytes
    for logits, want in zip(got, expected):
        assert (logits - want).abs().max().item() <= TOLERANCE
    row_bytes = _matrix_bytes(path, streamed) // ref.config.vocab_size
    rows_gathered = sum(len(torch.unique(row)) for row in ids)  # each call's distinct tokens
    # the head once, and each call's embedding rows: never the head per call
    assert outside_layers == _matrix_bytes(path, streamed) + rows_gathered * row_bytes


def test_the_embedding_holds_only_the_rows_of_a_calls_tokens(tiny_checkpoint):
    path = tiny_checkpoint("gemma3")
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        embedding = streamed.model.get_input_embeddings()
        seen = []
        # runs after the gathering hook: sees the table the embedding computes from
        embedding.register_forward_pre_hook(lambda module, args: seen.append(module.weight.shape[0]))
        ids = torch.tensor([[5, 9, 5, 7, 9, 9]])
        streamed(ids)
        assert seen == [3]  # three distinct ids
        # between passes: a placeholder of the right shape that holds one row
        assert embedding.weight.shape[0] == streamed.model.config.get_text_config().vocab_size
        assert embedding.weight.untyped_storage().nbytes() == embedding.weight.shape[1] * 4
        outside = [p for n, p in streamed.model.named_parameters() if not n.startswith(streamed.layers_path)]
        assert sum(p.untyped_storage().nbytes() for p in outside) < _matrix_bytes(path, streamed)


def test_a_token_id_outside_the_vocabulary_is_named(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["gathered"]) as streamed:
        vocab = streamed.model.config.vocab_size
        with pytest.raises(IndexError, match=f"token id {vocab} is outside the embedding's {vocab:,} rows"):
            streamed(torch.tensor([[1, vocab]]))


def test_bfloat16_checkpoint_streams_its_head_in_float32_exactly(tmp_path, tiny_checkpoint):
    """A head stored narrower than the compute dtype is widened chunk by chunk, as a held one is widened whole."""
    from tests.support import bfloat16_copy

    path = bfloat16_copy(tiny_checkpoint("llama"), tmp_path)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        assert (streamed(ids).logits - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_head_read_in_many_chunks_gives_the_same_logits(tiny_checkpoint, monkeypatch, arch):
    monkeypatch.setattr(stream, "HEAD_CHUNK_BYTES", 4096)  # 16 rows of a 64-wide float32 head a chunk
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        head = streamed.model.get_output_embeddings()
        assert head.chunk_rows == 16 and head.rows.rows > 16 * 10
        assert (streamed(ids).logits - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied; tied with a scaled embedding
def test_a_choice_pass_through_a_streamed_head_keeps_only_the_choice_tokens_log_probs(tiny_checkpoint, tmp_path,
                                                                                      arch, monkeypatch):
    """The head reduces each call's logits to its choices' log-probs chunk by chunk, and a chunk's positions block
    by block (chunks of 16 rows here, so blocks of 64 of the pass's ~90 positions): no call's output is a vocabulary
    row, and the probabilities are the held head's."""
    monkeypatch.setattr(stream, "HEAD_CHUNK_BYTES", 4096)
    from batchrun.runtime import score_choices
    from batchrun.spec import encode_requests, read_spec
    from tests.support import REVIEWS, write_jsonl

    path = tiny_checkpoint(arch)
    spec = write_jsonl(tmp_path / "spec.jsonl", [
        {"prompt": f"Review: {text}", "choices": ["positive", "negative"] if i % 2 else ["good value", "bad"]}
        for i, text in enumerate(REVIEWS * 5)])
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads()) as held:
        rows = encode_requests(held.tokenizer, read_spec(spec).requests)
        pad = held.tokenizer.pad_token_id
        expected = score_choices(held, rows, pad, micro_batch=2)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=PLACEMENTS["streamed"]) as streamed:
        head = streamed.model.get_output_embeddings()
        widths = []
        head.register_forward_hook(lambda module, args, output: widths.append(output.shape[-1]))
        got = score_choices(streamed, rows, pad, micro_batch=2)
    assert widths and max(widths) < head.rows.rows
    for mine, theirs in zip(got, expected):
        assert mine.answer == theirs.answer
        assert max(abs(mine.choice_probs[c] - p) for c, p in theirs.choice_probs.items()) <= TOLERANCE
