"""A prompt head rows share, computed once a pass: the plan sizes the prefix the run shares, sliding-window
models share it only where rows fit the window, and a model that cannot read it in place decodes as planned."""
from __future__ import annotations

import pytest

from batchrun.job import JobOptions, submit
from tests.support import (REVIEWS, copy_checkpoint, plain_transformers, record_shared_prefixes, reference_choice_probs,
                           reference_generation, run_job, write_jsonl)


@pytest.mark.parametrize("choices", [("yes", "no"), ("very positive indeed", "no")])
def test_plan_shares_the_prefix_the_run_shares(tmp_path, tiny_checkpoint, monkeypatch, choices):
    """Rows with the same prompt share all of it but the positions whose logits the pass keeps (the longest choice
    + 1 when a choice has several tokens): the plan sizes memory for the prefix the run really shares."""
    shared_at_run = record_shared_prefixes(monkeypatch)
    prompt = "Review: " + " ".join(REVIEWS) + "\nIs it positive or negative?"
    # the choices in two orders: otherwise the rows would repeat each other, and be computed once
    spec = write_jsonl(tmp_path / "same.jsonl", [{"id": i, "prompt": prompt, "choices": list(choices)[::(-1) ** i]}
                                                 for i in range(4)])
    planned = []
    submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=tmp_path / "o.parquet",
           db=tmp_path / "j.db", on_plan=planned.append)
    assert shared_at_run and planned[0].batching.shared_prefix_tokens == shared_at_run[0] > 16


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_sliding_window_model_shares_the_prefix_of_rows_that_fit_its_window(tmp_path, tiny_checkpoint, monkeypatch,
                                                                              streaming):
    """Gemma-style models (sliding and full layers) share an instruction head when every row, answer included, fits
    the smallest window, where windowed layers attend like full ones: the answers stay the reference's. Rows that
    reach past the window compute the head each, and the plan says why."""
    shared_at_run = record_shared_prefixes(monkeypatch)
    wide = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "gemma3-window-128", config={"sliding_window": 128})
    instruction = "Read the customer review below and decide whether the customer is happy with the product. "
    choices, generations = [], []
    for i, text in enumerate(REVIEWS):
        choices.append({"id": f"c{i}", "prompt": instruction + text, "choices": ["positive", "negative"]})
        generations.append({"id": f"g{i}", "prompt": instruction + text, "max_new_tokens": 6})
    model, tokenizer = plain_transformers(wide)
    planned = []
    summary, rows = run_job(write_jsonl(tmp_path / "c.jsonl", choices), tmp_path, wide, "c", streaming=streaming,
                            on_plan=planned.append)
    assert planned[0].batching.shared_prefix_tokens == shared_at_run[0] > 16
    for row, spec_row in zip(rows, choices):
        expected = reference_choice_probs(model, tokenizer, spec_row["prompt"], spec_row["choices"])
        assert all(dict(row["choice_probs"])[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())
    shared_at_run.clear()
    _, rows = run_job(write_jsonl(tmp_path / "g.jsonl", generations), tmp_path, wide, "g", streaming=streaming)
    assert shared_at_run and shared_at_run[0] > 16
    for row, spec_row in zip(rows, generations):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, spec_row["prompt"], 6)
    # The tiny model's own window (8 tokens) is shorter than any row: nothing shared, and the plan says why.
    shared_at_run.clear()
    planned.clear()
    run_job(write_jsonl(tmp_path / "c8.jsonl", choices), tmp_path, tiny_checkpoint("gemma3"), "c8",
            streaming=streaming, on_plan=planned.append)
    assert not shared_at_run and planned[0].batching.shared_prefix_tokens == 0
    assert any("sliding window" in caveat and "prompt head" in caveat for caveat in planned[0].caveats)


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_model_that_does_not_attend_in_place_as_planned_decodes_with_the_prefills_settings(
        tmp_path, tiny_checkpoint, monkeypatch, streaming):
    """The plan sizes decode calls as reading keys and values in place when the model's class attends through sdpa.
    Should the built model not (here: told so), the run says so, decodes with the prefill's micro-batches and
    read-ahead, which the plan sized, and its answers are still greedy generate's."""
    from batchrun.job import execute
    from batchrun.runtime import open_model

    path = tiny_checkpoint("llama")
    instruction = "Read the customer review below and write a short summary of what the customer thinks of it."
    prompts = [f"{instruction} Summarise: {text}" for text in REVIEWS]
    spec = write_jsonl(tmp_path / "prefixed.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 4}
                                                      for i, p in enumerate(prompts)])
    opened, plans = [], []
    monkeypatch.setattr(execute, "open_model", lambda *a, **k: opened.append(open_model(*a, **k)) or opened[-1])
    monkeypatch.setattr("batchrun.runtime.prefix_attention.reads_prefix_in_place", lambda model: False)
    monkeypatch.setattr(execute, "reads_prefix_in_place", lambda model: False)
    summary, rows = run_job(spec, tmp_path, path, "prefixed", on_plan=plans.append, streaming=streaming, micro_batch=2)
    assert plans[0].batching.decode_in_place and plans[0].batching.shared_prefix_tokens > 0
    assert any("does not attend through transformers' sdpa" in note for note in summary.notes)
    if streaming == "always":
        assert opened[0].decode_prefetch_depth == opened[0].prefetch_depth == 1
    model, tokenizer = plain_transformers(path)
    for row, prompt in zip(rows, prompts):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, prompt, 4)
