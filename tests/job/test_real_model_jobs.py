"""Jobs on the registry models as users run them: streamed under a memory budget or by request, with every placement
of the token matrices, choice and generation rows give the resident run's answers and probabilities, and the
resident run gives plain transformers'."""
from __future__ import annotations

import json

import pytest

from tests.support import (REVIEWS, plain_transformers, reference_choice_probs, reference_generation, run_job,
                           write_jsonl)

# float32 on both sides: only the order of operations differs (batching, padding, a shared prefix, chunked head)
PROBABILITY_TOLERANCE = 1e-5
TICKETS = ("Order 58213 never arrived and nobody answers the phone.", "The invoice charges me twice for one month.")


def mixed_spec(tmp_path):
    """Choice rows (one-token and multi-token choices) and generation rows, as the quick start's jobs mix them."""
    rows = [{"id": f"c{i}", "prompt": f"Review: {text}\nIs it positive or negative? Answer with one word.",
             "choices": ["positive", "negative"]} for i, text in enumerate(REVIEWS[:4])]
    rows.append({"id": "multi", "prompt": f"Review: {REVIEWS[4]}\nHow many stars?",
                 "choices": ["one star", "three stars", "five stars"]})
    rows += [{"id": f"g{i}", "prompt": f"Ticket: {text}\nWhat is the ticket about, in a few words?",
              "max_new_tokens": 5} for i, text in enumerate(TICKETS)]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


def assert_same_answers(got: list[dict], expected: list[dict]) -> None:
    assert [row["id"] for row in got] == [row["id"] for row in expected]
    for mine, theirs in zip(got, expected):
        assert mine["answer"] == theirs["answer"], mine["id"]
        assert mine["finish_reason"] == theirs["finish_reason"], mine["id"]
        if theirs["choice_probs"] is not None:
            mine_probs = dict(mine["choice_probs"])
            difference = max(abs(mine_probs[c] - p) for c, p in dict(theirs["choice_probs"]).items())
            assert difference <= PROBABILITY_TOLERANCE, (mine["id"], difference)


def resident_answers(spec, tmp_path, checkpoint) -> list[dict]:
    return run_job(spec, tmp_path, checkpoint, "resident", streaming="never", dtype="float32", calibrate="none")[1]


@pytest.mark.slow
def test_the_default_model_under_a_budget_that_streams_it_answers_as_resident_in_every_placement(
        default_checkpoint, tmp_path):
    spec = mixed_spec(tmp_path)
    expected = resident_answers(spec, tmp_path, default_checkpoint)
    plans = {}
    for placement in ("auto", "held", "gathered", "streamed"):
        summary, got = run_job(spec, tmp_path, default_checkpoint, placement, memory_gb=0.7, dtype="float32",
                               calibrate="none", token_matrices=placement,
                               on_plan=lambda plan, placement=placement: plans.__setitem__(placement, plan))
        assert plans[placement].mode == "streamed"
        assert_same_answers(got, expected)


@pytest.mark.slow
def test_gemma3_streamed_answers_as_resident_in_every_placement(gemma3_checkpoint, tmp_path):
    spec = mixed_spec(tmp_path)
    expected = resident_answers(spec, tmp_path, gemma3_checkpoint)
    for placement in ("held", "gathered", "streamed"):
        _, got = run_job(spec, tmp_path, gemma3_checkpoint, placement, streaming="always", dtype="float32",
                         calibrate="none", token_matrices=placement)
        assert_same_answers(got, expected)


@pytest.mark.slow
def test_resident_answers_equal_plain_transformers_on_both_registry_models(default_checkpoint, gemma3_checkpoint,
                                                                          tmp_path):
    spec = mixed_spec(tmp_path)
    rows = [json.loads(line) for line in spec.read_text().splitlines()]
    for checkpoint in (default_checkpoint, gemma3_checkpoint):
        model, tokenizer = plain_transformers(checkpoint)
        (tmp_path / checkpoint.name).mkdir()
        for got, row in zip(resident_answers(spec, tmp_path / checkpoint.name, checkpoint), rows):
            if "choices" in row:
                expected = reference_choice_probs(model, tokenizer, row["prompt"], row["choices"])
                got_probs = dict(got["choice_probs"])
                assert max(abs(got_probs[c] - p) for c, p in expected.items()) <= PROBABILITY_TOLERANCE
            else:
                assert (got["answer"], got["finish_reason"]) == reference_generation(
                    model, tokenizer, row["prompt"], row["max_new_tokens"])


@pytest.mark.slow
def test_the_ticket_jobs_first_rows_stream_under_a_budget_and_answer_as_resident(default_checkpoint, tmp_path):
    """Generation rows only, as the ready ticket job begins: every decode pass of few distinct tokens gathers a
    table smaller than the pad token's index."""
    from tests.support import REPO_ROOT

    spec = tmp_path / "tickets.jsonl"
    spec.write_text("".join((REPO_ROOT / "jobs" / "ticket-triage.jsonl").read_text().splitlines(True)[:3]))
    expected = resident_answers(spec, tmp_path, default_checkpoint)
    for placement in ("auto", "streamed"):
        plans = []
        _, got = run_job(spec, tmp_path, default_checkpoint, placement, memory_gb=0.7, dtype="float32",
                         calibrate="none", token_matrices=placement, on_plan=plans.append)
        assert plans[0].mode == "streamed"
        assert_same_answers(got, expected)


@pytest.mark.slow
def test_a_continued_assistant_turn_answers_as_the_same_text_written_by_hand(default_checkpoint, tmp_path):
    """A messages row continuing its final assistant turn (a prefilled start of the answer) is scored and decoded
    exactly as a raw prompt holding the text its chat template renders: choices and generated text alike."""
    from batchrun.checkpoint import load_tokenizer

    conversation = [{"role": "user", "content": f"Review: {REVIEWS[0]}\nIs it positive or negative?"},
                    {"role": "assistant", "content": "The review is clearly"}]
    rows = [{"id": "choice", "messages": conversation, "continue_final_message": True,
             "choices": [" positive", " negative"]},
            {"id": "text", "messages": conversation, "continue_final_message": True, "max_new_tokens": 6}]
    text = load_tokenizer(default_checkpoint).apply_chat_template(conversation, continue_final_message=True,
                                                                  tokenize=False)
    assert text.endswith("<|im_start|>assistant\nThe review is clearly")
    by_hand = [{"id": "choice", "prompt": text, "choices": [" positive", " negative"]},
               {"id": "text", "prompt": text, "max_new_tokens": 6}]
    _, continued = run_job(write_jsonl(tmp_path / "continued.jsonl", rows), tmp_path, default_checkpoint,
                           "continued", streaming="never", dtype="float32", calibrate="none")
    _, written = run_job(write_jsonl(tmp_path / "by-hand.jsonl", by_hand), tmp_path, default_checkpoint, "by-hand",
                         streaming="never", dtype="float32", calibrate="none", raw=True)
    assert [row["answer"] for row in continued] == [row["answer"] for row in written]
    mine, theirs = dict(continued[0]["choice_probs"]), dict(written[0]["choice_probs"])
    assert max(abs(mine[choice] - theirs[choice]) for choice in theirs) <= 1e-6
    assert continued[1]["finish_reason"] == written[1]["finish_reason"]
