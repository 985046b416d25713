"""Generated answers end to end (batchrun.job.submit) equal greedy generate() on each row alone: batches by
answer length, bfloat16 checkpoints, stop strings and EOS ids, places refilled as rows end, empty answers."""
from __future__ import annotations

import json

import pytest
import torch

from batchrun.job import JobOptions
from batchrun.plan import RowCost
from batchrun.plan import passes_for, refill_schedule
from tests.support import (REVIEWS, bfloat16_copy, generation_spec, plain_transformers, prompt_ids,
                           reference_generation, run_job, write_jsonl)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("streaming,batch_size", [("never", None), ("always", 1), ("always", None)])
def test_generation_equals_greedy_generate(tmp_path, tiny_checkpoint, arch, streaming, batch_size):
    path = tiny_checkpoint(arch)
    model, tokenizer = plain_transformers(path)
    summary, rows = run_job(generation_spec(tmp_path), tmp_path, path, "gen", streaming=streaming,
                            batch_size=batch_size)
    for row, text in zip(rows, REVIEWS):
        answer, finish = reference_generation(model, tokenizer, f"Summarise: {text}", 6)
        assert (row["answer"], row["finish_reason"]) == (answer, finish)
    if batch_size is None:
        assert summary.passes_now == 6  # every row in one batch: one pass per new token


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied, tied
def test_generation_equals_greedy_generate_with_the_embedding_and_head_streamed(tmp_path, tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, tokenizer = plain_transformers(path)
    _, rows = run_job(generation_spec(tmp_path), tmp_path, path, "gen", streaming="always", micro_batch=2,
                      token_matrices="streamed")
    for row, text in zip(rows, REVIEWS):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, f"Summarise: {text}", 6)


def test_answers_of_different_lengths_share_batches_with_their_own_kind(tmp_path, tiny_checkpoint):
    """Rows asking for 1 and for 5 new tokens, two a batch: packed by answer length, two 1-token rows share a pass and
    the rest make two batches of 5 passes (11 passes), where batches by prompt length alone made 15 here, each
    waiting for a 5-token answer. Answers unchanged."""
    path = tiny_checkpoint("llama")
    model, tokenizer = plain_transformers(path)
    budgets = [5, 1, 5, 1, 5, 1]
    spec = write_jsonl(tmp_path / "mixed.jsonl", [{"id": i, "prompt": f"Summarise: {text}", "max_new_tokens": n}
                                                   for i, (text, n) in enumerate(zip(REVIEWS, budgets))])
    plans = []
    summary, rows = run_job(spec, tmp_path, path, "mixed", streaming="always", batch_size=2, on_plan=plans.append)
    assert summary.passes_now == plans[0].batching.passes == 1 + 5 + 5
    for row, text, budget in zip(rows, REVIEWS, budgets):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, f"Summarise: {text}",
                                                                             budget)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("batch_size", [1, None])
def test_a_bf16_checkpoint_streamed_in_float32_generates_as_in_memory(tmp_path, tiny_checkpoint, arch, batch_size,
                                                                     monkeypatch):
    """Decode passes multiply the checkpoint's bf16 linear weights as they lie (linear_kernels.widening_linear), the
    prefill the weights widened in their slots: the answers are plain transformers' in float32."""
    from batchrun.runtime import linear_kernels

    path = bfloat16_copy(tiny_checkpoint(arch), tmp_path / "bf16")
    model, tokenizer = plain_transformers(path)
    narrow_calls = []  # the tile workers each narrow linear shared its tiles among
    real = linear_kernels.widening_linear
    def recording(*args):
        narrow_calls.append(getattr(linear_kernels._sharing, "workers", 1))
        return real(*args)

    monkeypatch.setattr(linear_kernels, "widening_linear", recording)
    threads = torch.get_num_threads()
    summary, rows = run_job(generation_spec(tmp_path), tmp_path, path, "gen", streaming="always",
                            batch_size=batch_size, dtype="float32")
    assert summary.mode == "streamed" and set(narrow_calls) == {threads}  # every core, the reader's too
    for row, text in zip(rows, REVIEWS):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, f"Summarise: {text}", 6)


def test_stop_string_ends_generation_and_is_cut(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = plain_transformers(path)
    free, _ = reference_generation(model, tokenizer, "Summarise: " + REVIEWS[0], 8)
    stop = free.strip()[2:4] if len(free.strip()) >= 4 else None
    if not stop:
        pytest.skip("the tiny model's free answer is too short to cut")
    rows = [{"id": 0, "prompt": "Summarise: " + REVIEWS[0], "max_new_tokens": 8, "stop": [stop]}]
    _, out = run_job(write_jsonl(tmp_path / "stop.jsonl", rows), tmp_path, path, "stop")
    assert out[0]["finish_reason"] == "stop"
    assert out[0]["answer"] == free[:free.find(stop)]


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_eos_ids_from_generation_config_stop_rows_in_both_modes(tmp_path, tiny_checkpoint, streaming):
    """generation_config.json may list EOS ids config.json lacks (Llama 3's <|eot_id|>): both modes stop there."""
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    model, tokenizer = plain_transformers(path)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids(tokenizer, f"Summarise: {REVIEWS[0]}")])
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    stop_at = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    eos_ids = [tokenizer.eos_token_id, greedy[stop_at]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    spec = write_jsonl(tmp_path / "one.jsonl", [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 6}])
    _, rows = run_job(spec, tmp_path, path, "eos", streaming=streaming)
    assert rows[0]["finish_reason"] == "stop"
    assert rows[0]["answer"] == tokenizer.decode(greedy[:stop_at], skip_special_tokens=True)


@pytest.mark.parametrize("arch,streaming", [("llama", "always"), ("llama", "never"), ("gpt_neox", "always"),
                                             ("phi3", "always"), ("gemma3", "always")])
def test_places_of_rows_that_stop_early_are_taken_by_waiting_rows(tmp_path, tiny_checkpoint, arch, streaming):
    """Two rows a pass, 18 rows of up to 8 new tokens, several of which reach an end-of-sequence token early:
    each pass admits the next waiting row into a place a row left (refill.py), so the job takes the passes of that
    schedule, fewer than batches that each wait for their last row, and every answer is the one generate() gives."""
    import shutil

    path = shutil.copytree(tiny_checkpoint(arch), tmp_path / arch)
    model, tokenizer = plain_transformers(path)
    prompts = [f"You are a careful assistant. Read the customer review below and summarise it in a few words, "
               f"nothing else. Review: {text} {extra}" for text in REVIEWS for extra in ("Briefly.", "In one line.",
                                                                                        "Now.")]
    greedy = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)])
            greedy.append(model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                         pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist())
    # a token some rows emit early (not first) and others not at all: as an end-of-sequence token it stops the first
    stopped_by = {token: sum(token in tokens[1:5] and token != tokens[0] for tokens in greedy)
                  for tokens in greedy for token in tokens[1:5]}
    stop = max(stopped_by, key=lambda token: min(stopped_by[token], len(greedy) - stopped_by[token]))
    eos_ids = [tokenizer.eos_token_id, stop]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    lengths = [next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), 8) for tokens in greedy]
    assert sum(n < 8 for n in lengths) >= 2
    spec = write_jsonl(tmp_path / "early.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 8}
                                                   for i, p in enumerate(prompts)])
    plans = []
    summary, rows = run_job(spec, tmp_path, path, "early", streaming=streaming, batch_size=2, on_plan=plans.append)
    # Later rows attend to the prefix the first pass computed; the tiny Gemma 3's sliding window is shorter than
    # these rows, so it shares none and refills without one.
    assert (plans[0].batching.shared_prefix_tokens >= 16) == (arch != "gemma3")
    for row, tokens, length in zip(rows, greedy, lengths):
        stopped = tokens[length - 1] in eos_ids
        assert row["finish_reason"] == ("stop" if stopped else "length")
        assert row["answer"] == tokenizer.decode(tokens[:length - 1 if stopped else length], skip_special_tokens=True)
    actual = [RowCost(1, n) for n in lengths]
    order = [i for batch in plans[0].batching.batches for i in batch]
    if arch == "gemma3":  # rows past its window cannot decode in one call once admitted apart: batch after batch
        assert summary.passes_now == passes_for(actual, plans[0].batching.batches) < plans[0].batching.passes == 9 * 8
        return
    assert summary.passes_now == len(refill_schedule(actual, order, 2, 10**9)) < plans[0].batching.passes == 9 * 8
    assert summary.passes_now < passes_for(actual, plans[0].batching.batches)  # batches waiting for their last row


def test_answers_empty_at_their_first_token_are_counted_and_explained(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = plain_transformers(path)
    first = reference_generation(model, tokenizer, f"Summarise: {REVIEWS[0]}", 1)[0]
    assert first  # its first token has text: make that text the stop
    rows = [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 3, "stop": [first]}]
    summary, out = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "empty")
    assert out[0]["answer"] == "" and out[0]["finish_reason"] == "stop"
    assert summary.empty_answers == 1 and any("answer(s) are empty" in note for note in summary.notes)
    assert not any("base model" in note for note in summary.notes)  # a chat template ran: no base-model hint
    raw_first = tokenizer.decode(model.generate(torch.tensor([tokenizer(f"Summarise: {REVIEWS[0]}")["input_ids"]]),
                                                max_new_tokens=1, do_sample=False)[0, -1:])
    rows = [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 3, "stop": [raw_first]}]
    summary, out = run_job(write_jsonl(tmp_path / "r.jsonl", rows), tmp_path, path, "raw-empty", raw=True)
    assert out[0]["answer"] == "" and any("base model" in note for note in summary.notes)


def test_rows_that_repeat_another_exactly_are_computed_once(tmp_path, tiny_checkpoint):
    """A corpus's repeated documents (same prompt and settings, other ids) are computed once and answered alike; a
    row that differs only in its settings is its own. The answers are plain transformers' ones."""
    path = tiny_checkpoint("llama")
    model, tokenizer = plain_transformers(path)
    rows = [{"id": f"g{i}", "prompt": f"Summarise: {REVIEWS[i % 2]}", "max_new_tokens": 4} for i in range(4)]
    rows += [{"id": "g-longer", "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 5}]
    rows += [{"id": f"c{i}", "prompt": f"Review: {REVIEWS[2]}", "choices": ["positive", "negative"]} for i in range(3)]
    from batchrun.job import plan_report
    from batchrun.plan import format_plan_table

    spec = write_jsonl(tmp_path / "rep.jsonl", rows)
    report = plan_report(spec, [str(path)], JobOptions(model=str(path)))
    assert report["repeated_rows"] == 4 and "4 repeat another row exactly (computed once)" in format_plan_table(report)
    summary, out = run_job(spec, tmp_path, path, "rep")
    assert summary.rows_computed_now == 4 and summary.rows_done == 8  # g0, g1, g-longer, c0
    assert any("4 row(s) repeat another row of this job exactly" in note for note in summary.notes)
    by_id = {row["id"]: row for row in out}
    for i in range(4):
        expected = reference_generation(model, tokenizer, f"Summarise: {REVIEWS[i % 2]}", 4)
        assert (by_id[f"g{i}"]["answer"], by_id[f"g{i}"]["finish_reason"]) == expected
    assert by_id["g-longer"]["answer"] == reference_generation(model, tokenizer, f"Summarise: {REVIEWS[0]}", 5)[0]
    assert by_id["c0"]["choice_probs"] == by_id["c1"]["choice_probs"] == by_id["c2"]["choice_probs"]
