"""Choice rows end to end (batchrun.job.submit), checked against plain transformers computed independently, one
row at a time: probabilities, scores, multi-token choices, and the default model's answers."""
from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from batchrun.job import JobOptions, submit
from batchrun.store import Store
from tests.support import (REVIEWS, choice_spec, plain_transformers, reference_choice_probs, reference_generation,
                           run_job, write_jsonl)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mixtral"])
@pytest.mark.parametrize("streaming,batch_size", [("never", 1), ("never", None), ("always", 1), ("always", None)])
def test_choice_answers_equal_reference(tmp_path, tiny_checkpoint, arch, streaming, batch_size):
    path = tiny_checkpoint(arch)
    model, tokenizer = plain_transformers(path)
    summary, rows = run_job(choice_spec(tmp_path), tmp_path, path, "out", streaming=streaming, batch_size=batch_size)
    assert summary.mode == ("resident" if streaming == "never" else "streamed")
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(REVIEWS))]
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        assert row["finish_reason"] == "choice"
        got = dict(row["choice_probs"])
        for choice, p in expected.items():
            assert got[choice] == pytest.approx(p, abs=1e-4)
        assert row["answer"] == max(expected, key=expected.get)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # untied; tied with a scaled embedding
@pytest.mark.parametrize("token_matrices", ["gathered", "streamed"])
def test_choice_answers_equal_reference_with_the_embedding_and_head_read_as_passes_need_them(
        tmp_path, tiny_checkpoint, arch, token_matrices):
    """Micro-batches of two: the head streamed is read once a pass and multiplies every call's rows."""
    path = tiny_checkpoint(arch)
    model, tokenizer = plain_transformers(path)
    plans = []
    _, rows = run_job(choice_spec(tmp_path), tmp_path, path, "out", streaming="always", micro_batch=2,
                      token_matrices=token_matrices, on_plan=plans.append)
    tied = arch == "gemma3"
    assert plans[0].memory.token_matrices == ("held" if tied and token_matrices == "gathered" else token_matrices)
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        got = dict(row["choice_probs"])
        assert all(got[choice] == pytest.approx(p, abs=1e-4) for choice, p in expected.items())


def test_numeric_choices_get_a_probability_weighted_score(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path, choices=("1", "2", "3", "4", "5"))
    _, rows = run_job(spec, tmp_path, tiny_checkpoint("llama"), "score")
    for row in rows:
        probs = dict(row["choice_probs"])
        assert row["score"] == pytest.approx(sum(float(c) * p for c, p in probs.items()), abs=1e-9)
        assert sum(probs.values()) == pytest.approx(1.0)


def test_multi_token_choices_are_scored_over_all_their_tokens(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = plain_transformers(path)
    choices = ["very positive indeed", "negative", "it is hard to say"]
    assert any(len(tokenizer.encode(c, add_special_tokens=False)) > 1 for c in choices)
    _, rows = run_job(choice_spec(tmp_path, choices), tmp_path, path, "multi", streaming="always")
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?", choices)
        got = dict(row["choice_probs"])
        assert all(got[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())


def test_store_keeps_every_row_once(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path)
    summary = submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama")), batch_size=2),
                     output=tmp_path / "o.parquet", db=tmp_path / "j.db")
    with Store(tmp_path / "j.db") as store:
        status = store.status(summary.job_id)
    assert status["rows_done"] == len(REVIEWS) and status["rows_pending"] == 0
    # --batch-size counts sequences; a row of multi-token choices scores each choice as its own sequence
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    single = all(len(tokenizer.encode(c, add_special_tokens=False)) == 1 for c in ("positive", "negative"))
    rows_per_pass = 2 if single else 1
    assert status["passes"] == math.ceil(len(REVIEWS) / rows_per_pass)  # one pass per batch, no decode


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_default_model_answers_equal_reference(tmp_path, default_checkpoint, streaming):
    """The real default model (SmolLM2-135M-Instruct): choice probabilities and greedy answers vs plain transformers."""
    model, tokenizer = plain_transformers(default_checkpoint)
    rows = [{"id": f"c{i}", "prompt": f"Review: {text}\nIs it positive or negative?",
             "choices": ["positive", "negative"]} for i, text in enumerate(REVIEWS[:3])]
    rows += [{"id": f"g{i}", "prompt": f"Summarise in a few words: {text}", "max_new_tokens": 6}
             for i, text in enumerate(REVIEWS[:2])]
    spec = write_jsonl(tmp_path / "default.jsonl", rows)
    _, out = run_job(spec, tmp_path, default_checkpoint, "default", streaming=streaming)
    by_id = {r["id"]: r for r in out}
    for i, text in enumerate(REVIEWS[:3]):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        got = dict(by_id[f"c{i}"]["choice_probs"])
        assert all(got[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())
    for i, text in enumerate(REVIEWS[:2]):
        answer, finish = reference_generation(model, tokenizer, f"Summarise in a few words: {text}", 6)
        assert (by_id[f"g{i}"]["answer"], by_id[f"g{i}"]["finish_reason"]) == (answer, finish)
