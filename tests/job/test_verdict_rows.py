"""Reasons, then the verdict: a row writes its rationale, then its choices are scored after a cue. The verdict's
probabilities must be those of a prompt written by hand with the same rationale in it, a job killed between the two
stages must resume to the answers of an uninterrupted one without writing the rationales again, and the row reads,
refuses and keys as a user expects."""
from __future__ import annotations

import pytest

from batchrun.job import JobOptions, prepare_job
from batchrun.spec import SpecError, read_spec
from tests.job.test_resume import (assert_same_answers, job_status, run_killed, run_passes, run_to_end,
                                   submit_args)
from tests.support import invoke, run_job, write_jsonl

PROBABILITY_TOLERANCE = 1e-6
QUESTIONS = ["Is this review positive or negative? 'The food was wonderful and the staff kind.'",
             "Is this review positive or negative? 'Cold soup, rude waiter, never again.'",
             "Is this review positive or negative? 'Fine, I suppose. Nothing special.'"]


def verdict_rows(**settings) -> list[dict]:
    return [{"id": f"r{number}", "prompt": question + " Explain briefly.", "choices": [" positive", " negative"],
             "then": "Verdict:", **settings} for number, question in enumerate(QUESTIONS)]


# ---- reading -----------------------------------------------------------------------------------------------------


def test_a_then_row_writes_its_rationale_first_and_stops_at_the_cue(tmp_path):
    spec = write_jsonl(tmp_path / "j.jsonl", [{"id": 1, "prompt": "p", "choices": ["yes", "no"], "then": "Verdict:",
                                               "max_new_tokens": 64, "stop": ["\n\n"], "label": "yes"}])
    (request,) = read_spec(spec).requests
    assert request.choices is None and request.max_new_tokens == 64  # the first stage is a generation row
    assert request.stop == ("\n\n", "Verdict:")  # a model that starts its own verdict has finished its reasons
    assert request.verdict.cue == "Verdict:" and request.verdict.choices == ("yes", "no")
    assert request.scored_choices == ("yes", "no") and request.label == "yes"


def test_then_is_refused_without_choices_and_on_pair_rows(tmp_path):
    no_choices = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "then": "Verdict:"}])
    with pytest.raises(SpecError, match="then is the cue before a verdict among the row's choices"):
        read_spec(no_choices)
    pair = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "A: {a}\nB: {b}\nWhich is better?", "a": "x", "b": "y",
                                               "choices": [" A", " B"], "then": "Verdict:"}])
    with pytest.raises(SpecError, match="a pair row scores its two orders' verdicts directly"):
        read_spec(pair)
    label = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "choices": ["yes", "no"], "then": "Verdict:",
                                                "label": "maybe"}])
    with pytest.raises(SpecError, match="label"):
        read_spec(label)


def test_the_job_cue_applies_to_choice_rows_in_corpus_mode(tmp_path):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "great"}, {"text": "awful", "then": "Answer:"}])
    requests = read_spec(corpus, template="Review: {text}", choices=["good", "bad"], then="Verdict:",
                         max_new_tokens=32).requests
    assert [r.verdict.cue for r in requests] == ["Verdict:", "Answer:"]  # a row's own column wins
    assert all(r.max_new_tokens == 32 and r.verdict.choices == ("good", "bad") for r in requests)


def test_a_rows_cue_is_part_of_what_its_answer_depends_on(tmp_path, tiny_checkpoint):
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": 1, "prompt": "p", "choices": ["yes", "no"]},
                                                   {"id": 2, "prompt": "p", "max_new_tokens": 8}])
    cued = write_jsonl(tmp_path / "cued.jsonl", [{"id": 1, "prompt": "p", "choices": ["yes", "no"],
                                                  "then": "Verdict:", "max_new_tokens": 8, "stop": []}])
    model = str(tiny_checkpoint("llama"))
    plain_keys = prepare_job(plain, JobOptions(model=model)).row_keys
    cued_key = prepare_job(cued, JobOptions(model=model)).row_keys[0]
    assert len({plain_keys[0], plain_keys[1], cued_key}) == 3  # neither the bare choice nor the bare generation row


# ---- running -----------------------------------------------------------------------------------------------------


def test_the_verdict_scores_as_a_prompt_written_by_hand_with_the_same_rationale(tmp_path, default_checkpoint):
    spec = write_jsonl(tmp_path / "judge.jsonl", verdict_rows(max_new_tokens=24))
    summary, rows = run_job(spec, tmp_path, default_checkpoint, "judge", calibrate="none")
    assert summary.rows_done == 3 and summary.rows_errored == 0
    assert all(row["rationale"] and 0 < row["rationale_tokens"] <= 24 for row in rows)
    assert {row["rationale_finish_reason"] for row in rows} <= {"stop", "length"}
    by_hand = [{"id": row["id"], "messages": [
        {"role": "user", "content": question + " Explain briefly."},
        {"role": "assistant", "content": row["rationale"] + ("" if row["rationale"][-1:].isspace() else "\n")
         + "Verdict:"}], "continue_final_message": True, "choices": [" positive", " negative"]}
        for row, question in zip(rows, QUESTIONS)]
    _, written = run_job(write_jsonl(tmp_path / "by_hand.jsonl", by_hand), tmp_path, default_checkpoint, "by_hand",
                         calibrate="none")
    for cued, hand in zip(rows, written):
        assert cued["answer"] == hand["answer"]
        assert dict(cued["choice_probs"]) == pytest.approx(dict(hand["choice_probs"]), abs=PROBABILITY_TOLERANCE)
        assert cued["prompt_tokens"] < hand["prompt_tokens"]  # the row's own prompt, not the verdict's


def test_a_raw_verdict_follows_the_rationale_right_after_the_prompt(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("qwen2")
    spec = write_jsonl(tmp_path / "judge.jsonl", verdict_rows(max_new_tokens=6))
    _, rows = run_job(spec, tmp_path, model, "judge", calibrate="none", raw=True)
    by_hand = [{"id": row["id"], "prompt": question + " Explain briefly." + row["rationale"]
                + ("" if not row["rationale"] or row["rationale"][-1].isspace() else "\n") + "Verdict:",
                "choices": [" positive", " negative"]} for row, question in zip(rows, QUESTIONS)]
    _, written = run_job(write_jsonl(tmp_path / "by_hand.jsonl", by_hand), tmp_path, model, "by_hand",
                         calibrate="none", raw=True)
    for cued, hand in zip(rows, written):
        assert dict(cued["choice_probs"]) == pytest.approx(dict(hand["choice_probs"]), abs=PROBABILITY_TOLERANCE)


def test_a_job_killed_between_the_stages_resumes_at_the_verdicts(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = write_jsonl(tmp_path / "judge.jsonl", verdict_rows(max_new_tokens=8, stop=[]) + [
        {"id": "plain", "prompt": "Is water wet?", "choices": [" yes", " no"]},
        {"id": "story", "prompt": "Write a long story about item 1", "max_new_tokens": 5}])
    reference = run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet",
                                       "--calibrate", "none"))
    args = submit_args(spec, model, tmp_path / "job.db", tmp_path / "job.parquet", "--calibrate", "none")

    run_killed(args, "verdicts", tmp_path / "killed.log")  # every rationale written, no verdict scored
    before = job_status(tmp_path / "job.db")
    assert before["rows_done"] == 2 and before["partial_rows"] == 3  # the rationales wait for their verdicts
    resumed = run_to_end(args)
    assert resumed["rows_computed_now"] == 3
    # no rationale is written again: the resumed run makes only the verdicts' pass
    assert [passes for _, passes, _ in run_passes(tmp_path / "job.db")] == [before["passes"], 1]
    assert before["passes"] + resumed["passes_now"] == reference["passes_now"]
    assert_same_answers(tmp_path / "job.parquet", tmp_path / "ref.parquet")
    import pyarrow.parquet as pq

    got, want = (pq.read_table(tmp_path / name).to_pylist() for name in ("job.parquet", "ref.parquet"))
    assert [row["rationale"] for row in got] == [row["rationale"] for row in want]
    assert [row["rationale"] is not None for row in got] == [True, True, True, False, False]


def test_the_cli_takes_a_cue_for_every_choice_row(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "reviews.jsonl", [{"id": 1, "prompt": "Great phone."}, {"id": 2, "prompt": "Bad."}])
    out = tmp_path / "out.parquet"
    result = invoke("submit", spec, "--model", tiny_checkpoint("llama"), "--db", tmp_path / "j.db", "--output", out,
                    "--choices", '[" good", " bad"]', "--then", "Verdict:", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    import pyarrow.parquet as pq

    rows = pq.read_table(out).to_pylist()
    assert all(row["rationale_tokens"] <= 4 and row["answer"] in (" good", " bad") for row in rows)
