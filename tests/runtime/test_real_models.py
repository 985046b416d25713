"""The registry models, resident and streamed in every placement of their token matrices, give plain transformers'
log-probabilities: what tiny fixtures lack is in them (SmolLM2's pad token 2 and chat template; Gemma 3's scaled,
tied embedding of 262,144 rows and its sliding windows)."""
from __future__ import annotations

import pytest
import torch

from batchrun.runtime import LayerReads, ResidentModel, StreamedModel, score_choices
from tests.reference import TOLERANCE, assert_matches_reference, reference_logprobs
from batchrun.spec import encode_requests, read_spec
from tests.support import prompt_ids, write_jsonl

PLACEMENTS = {"held": LayerReads(), "gathered": LayerReads(gather_embeddings=True),
              "streamed-head": LayerReads(stream_head=True),
              "streamed": LayerReads(gather_embeddings=True, stream_head=True)}
# bfloat16 keeps 8 bits of mantissa: a log-prob near -10 rounds in steps of 0.06
BFLOAT16_TOLERANCE = 0.1
PROMPTS = ("Review: The blender died after a week.\nIs it positive or negative?",
           "Ticket: Order 58213 never arrived. What is the order number?")


def _open(checkpoint, placement: str):
    if placement == "resident":
        return ResidentModel(checkpoint, device="cpu", dtype=torch.float32)
    return StreamedModel(checkpoint, device="cpu", dtype=torch.float32, reads=PLACEMENTS[placement])


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["resident", *PLACEMENTS])
def test_log_probs_equal_plain_transformers_in_every_placement(real_checkpoint, placement):
    handle = _open(real_checkpoint, placement)
    try:
        tokenizer = handle.tokenizer
        sequences = [prompt_ids(tokenizer, prompt) for prompt in PROMPTS]
        pad = tokenizer.pad_token_id
        # A call of one token and one of two distinct tokens (a decode step's table is that small), then whole prompts
        # one at a time: each against the plain model over the same tokens.
        for seq in ([sequences[0][-1]], [pad, pad, sequences[1][-1]] if pad is not None else sequences[1][-2:],
                    *sequences):
            with torch.inference_mode():
                logits = handle.model(torch.tensor([seq])).logits[0, -1]
            assert_matches_reference(torch.log_softmax(logits.float(), -1), real_checkpoint, seq)
    finally:
        handle.close()


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["resident", "held", "streamed"])
def test_choice_scores_equal_plain_transformers_in_a_micro_batched_pass(real_checkpoint, placement, tmp_path):
    """Rows of different lengths in micro-batches of one pass, left-padded with the model's own pad token."""
    handle = _open(real_checkpoint, placement)
    try:
        spec = write_jsonl(tmp_path / "spec.jsonl", [{"prompt": prompt, "choices": ["yes", "no", "maybe not"]}
                                                     for prompt in PROMPTS])
        rows = encode_requests(handle.tokenizer, read_spec(spec).requests)
        answers = score_choices(handle, rows, handle.tokenizer.pad_token_id or 0, micro_batch=1)
        for row, answer in zip(rows, answers):
            sums = []
            for tokens in row.choice_ids:
                seq = list(row.prompt_ids) + list(tokens)
                expected = reference_logprobs(real_checkpoint, seq, len(tokens) + 1)
                sums.append(sum(expected[j, t].item() for j, t in enumerate(tokens)))
            probs = torch.softmax(torch.tensor(sums, dtype=torch.float64), 0).tolist()
            got = list(answer.choice_probs.values())
            assert max(abs(a - b) for a, b in zip(got, probs)) <= TOLERANCE
    finally:
        handle.close()


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["held", "streamed"])
def test_bfloat16_streamed_log_probs_equal_the_resident_bfloat16_model(real_checkpoint, placement):
    """In bfloat16 the reference is the resident model at the same dtype (plain transformers rounds differently from
    float32 by far more than a tolerance for exactness): the same next token, log-probs within bfloat16's rounding."""
    resident = ResidentModel(real_checkpoint, device="cpu", dtype=torch.bfloat16)
    try:
        sequences = [prompt_ids(resident.tokenizer, prompt) for prompt in PROMPTS]
        with torch.inference_mode():
            expected = [torch.log_softmax(resident.model(torch.tensor([seq])).logits[0, -1].float(), -1)
                        for seq in sequences]
    finally:
        resident.close()
    with StreamedModel(real_checkpoint, device="cpu", dtype=torch.bfloat16, reads=PLACEMENTS[placement]) as streamed:
        for seq, want in zip(sequences, expected):
            with torch.inference_mode():
                got = torch.log_softmax(streamed.model(torch.tensor([seq])).logits[0, -1].float(), -1)
            assert int(got.argmax()) == int(want.argmax())
            assert (got - want).abs().max().item() <= BFLOAT16_TOLERANCE
