"""Refilled passes end to end (GreedyPool): a pool whose rows keep being admitted beside live ones must keep
each decode micro-batch's cache as wide as its longest live row, and answer as generate() does."""
from __future__ import annotations

import pytest

from batchrun.runtime import GreedyPool
from tests.support import copy_checkpoint, plain_transformers, prompt_ids, reference_generation, run_job, write_jsonl

INSTRUCTION = ("You are a careful assistant. Read the customer review below and summarise it in a few words, "
               "nothing else. ")


def staggered_rows(count: int) -> list[dict]:
    """Rows sharing an instruction; the first ends two tokens before the others, so from then on every pass that
    admits a row does so beside a live one, and the pool never empties until the end."""
    return [{"id": i, "prompt": f"{INSTRUCTION}Review {i:02d}", "max_new_tokens": 2 if i == 0 else 4}
            for i in range(count)]


def record_widths(monkeypatch) -> list[tuple[int, int]]:
    """After every pass, each live micro-batch's (cache columns, columns its longest row fills): prompt and the
    tokens fed back so far (the last one generated is fed in the next pass)."""
    widths = []
    step = GreedyPool.step

    def recording_step(self):
        finished = step(self)
        for state in self.states:
            filled = max(len(self.sequences[i].row.prompt_ids) + len(self.sequences[i].generated) - 1
                         for i in state.members)
            widths.append((state.mask.shape[1], filled))
        return finished

    monkeypatch.setattr(GreedyPool, "step", recording_step)
    return widths


def assert_answers_as_generate(path, rows: list[dict], answers: list[dict]) -> None:
    model, tokenizer = plain_transformers(path)
    for row, answer in zip(rows, answers):
        assert (answer["answer"], answer["finish_reason"]) == reference_generation(
            model, tokenizer, row["prompt"], row["max_new_tokens"])


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_pool_that_never_empties_keeps_its_cache_as_wide_as_its_longest_live_row(tmp_path, tiny_checkpoint,
                                                                                   monkeypatch, streaming):
    """A merged micro-batch is padded to its longest row; when that row leaves, the padding must go with it. It
    stayed before, and grew a column a pass (91 columns for rows of 76 after 16 rows): KV cache the plan never
    sized, unbounded over a long job."""
    widths = record_widths(monkeypatch)
    path = tiny_checkpoint("llama")
    rows = staggered_rows(16)
    summary, out = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "w", streaming=streaming,
                           batch_size=2)
    assert summary.passes_now > 2 * 4 and len(widths) > 10
    assert all(width == filled for width, filled in widths), widths
    assert_answers_as_generate(path, rows, out)


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_sliding_window_model_sharing_its_prefix_answers_as_generate_after_many_admissions(
        tmp_path, tiny_checkpoint, streaming):
    """A shared prefix in front of sliding-window layers is allowed only where every row fits inside the window
    (prefill.SharedPrefix.usable). Padding left behind by departed rows pushed real tokens out of the window, and
    rows admitted late answered differently from generate()."""
    rows = staggered_rows(24)
    _, tokenizer = plain_transformers(tiny_checkpoint("gemma3"))
    window = max(len(prompt_ids(tokenizer, row["prompt"])) for row in rows) + 4  # the longest row fits exactly
    path = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "gemma3", config={"sliding_window": window})
    plans = []
    _, out = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "w", streaming=streaming, batch_size=2,
                     on_plan=plans.append)
    assert plans[0].batching.shared_prefix_tokens > 0
    assert_answers_as_generate(path, rows, out)


def test_rows_inside_a_sliding_window_merge_into_one_decode_call_whatever_pass_admitted_them(tmp_path,
                                                                                           tiny_checkpoint,
                                                                                           monkeypatch):
    """Windowed layers cannot be padded and stacked, so every admission of a refilled pass kept its own decode call:
    one more read of each layer's weights from RAM per call. Where every row fits inside the window the layers
    attend as full ones, cache as full ones, and the pool decodes in one call."""
    calls = []
    step = GreedyPool.step

    def recording_step(self):
        finished = step(self)
        calls.append(len(self.states))
        return finished

    monkeypatch.setattr(GreedyPool, "step", recording_step)
    rows = [{"id": i, "prompt": f"{word} review {i}: fine", "max_new_tokens": 2 + i % 3}  # nothing shared
            for i, word in enumerate(["Short", "Odd", "Long", "Brief", "Plain", "Late", "Other", "Final", "Extra"])]
    _, tokenizer = plain_transformers(tiny_checkpoint("gemma3"))
    window = max(len(prompt_ids(tokenizer, row["prompt"])) + row["max_new_tokens"] for row in rows)
    path = copy_checkpoint(tiny_checkpoint("gemma3"), tmp_path / "gemma3", config={"sliding_window": window})
    plans = []
    _, out = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "w", streaming="always", batch_size=2,
                     on_plan=plans.append)
    # never empty till the end
    assert plans[0].batching.shared_prefix_tokens == 0 and len(calls) > 4 and 0 not in calls[:-1]
    assert max(calls) == 1, calls
    assert_answers_as_generate(path, rows, out)


def test_rows_past_a_sliding_window_wait_for_an_empty_pool_and_decode_in_their_batchs_calls(tmp_path,
                                                                                          tiny_checkpoint,
                                                                                          monkeypatch):
    """Windowed caches of rows longer than the window cannot merge: admitted beside live rows, every admission would
    keep a decode call of its own (helper review: 4 calls a pass at 6 rows a pass). Such rows are admitted only
    into an empty pool, batch after batch, as the plan schedules them, and answer as generate() does."""
    passes = []  # (rows live before the pass, rows it admitted, decode micro-batches after it)
    step = GreedyPool.step

    def recording_step(self):
        live, queued = len(self.live), len(self.queue)
        finished = step(self)
        passes.append((live, queued - len(self.queue), len(self.states)))
        return finished

    monkeypatch.setattr(GreedyPool, "step", recording_step)
    path = tiny_checkpoint("gemma3")  # its window (8 tokens) is shorter than every row
    rows = staggered_rows(8)
    plans = []
    summary, out = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "w", streaming="always",
                           batch_size=3, on_plan=plans.append)
    assert summary.passes_now == plans[0].batching.passes == len(passes)
    assert not [p for p in passes if p[0] and p[1]], passes  # nobody admitted beside live rows
    assert sum(admitted for _, admitted, _ in passes) == len(rows) and max(states for *_, states in passes) <= 3
    assert_answers_as_generate(path, rows, out)
