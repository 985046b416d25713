"""Passes bounded by time: a crash loses the pass in flight, so the plan holds every pass to --pass-minutes and says
what that costs; and a long CPU pass's memory and time as the executor cuts its prefill into calls."""
from __future__ import annotations

import json

import pytest

from batchrun.plan import Bandwidth, RowCost, format_plan_table
from batchrun.plan.memory import activation_bytes_for_sequence, batch_bytes
from batchrun.plan.timing import batch_prefill_flops
from tests.support import TINY, invoke, plan, write_jsonl

# A large job on a tiny model: rows of varied lengths, so batches and calls differ.
CHOICE_ROWS = [RowCost(40 + i % 37, 0, (1, 1)) for i in range(5_000)]
GENERATION_ROWS = [RowCost(30 + i % 23, 4 + i % 5) for i in range(3_000)]
RATES = dict(sizes=TINY, compute_dtype="float32", compute_flops_per_s=2e9, memory_bytes_per_s=1e10)
SLOW_DISK = Bandwidth(1e6, "declared", "a slow disk")


def every_row_once(candidate, rows) -> bool:
    return sorted(i for batch in candidate.batching.batches for i in batch) == list(range(len(rows)))


@pytest.mark.parametrize("rows", [CHOICE_ROWS, GENERATION_ROWS], ids=["choices", "generation"])
def test_passes_bounded_by_pass_minutes(rows):
    unbounded = plan(rows=rows, pass_seconds=None, **RATES)
    longest = max(unbounded.time.pass_seconds)
    bound = longest / 5
    bounded = plan(rows=rows, pass_seconds=bound, **RATES)
    assert bounded.fits and every_row_once(bounded, rows)
    assert max(bounded.time.pass_seconds) <= bound < longest  # every pass within the bound
    assert bounded.batching.passes > unbounded.batching.passes == bounded.bound.unbounded_passes
    assert bounded.time.first_answer_seconds < unbounded.time.first_answer_seconds
    # What the bound costs is the difference between the two plans' passes, and the plan prints it.
    assert bounded.bound.bound_cost_seconds == pytest.approx(sum(bounded.time.pass_seconds)
                                                             - sum(unbounded.time.pass_seconds))
    line = next(line for line in format_plan_table(bounded.to_json()).splitlines() if line.startswith("pass bound"))
    assert f"{bounded.batching.passes:,} passes instead of {unbounded.batching.passes:,} cost" in line
    assert ("% of the job" in line) == (bounded.bound.bound_cost_seconds >= 5e-4 * sum(unbounded.time.pass_seconds))


def test_a_bound_the_passes_keep_changes_nothing():
    unbounded = plan(rows=CHOICE_ROWS, pass_seconds=None, **RATES)
    bounded = plan(rows=CHOICE_ROWS, pass_seconds=2 * max(unbounded.time.pass_seconds), **RATES)
    assert bounded.batching.batches == unbounded.batching.batches and bounded.bound.bound_cost_seconds == 0
    assert "no pass cut" in format_plan_table(bounded.to_json())


def test_a_streamed_pass_is_held_to_its_read_and_the_extra_reads_are_counted():
    """A streamed pass reads every layer however few rows it carries: a bound shorter than that read holds passes to
    the read, and each pass the bound adds reads the checkpoint again."""
    slow_disk = dict(RATES, streaming="always", bandwidth=SLOW_DISK)
    unbounded = plan(rows=CHOICE_ROWS, pass_seconds=None, **slow_disk)
    read = unbounded.time.io_seconds_per_pass
    bounded = plan(rows=CHOICE_ROWS, pass_seconds=read / 10, **slow_disk)
    assert max(bounded.time.pass_seconds) == pytest.approx(read) and bounded.batching.passes > unbounded.batching.passes
    assert any("reads every layer" in caveat and "held to that" in caveat for caveat in bounded.caveats)
    assert bounded.bound.bound_cost_seconds >= ((bounded.batching.passes - unbounded.batching.passes) * read
                                                - sum(unbounded.time.pass_seconds))
    assert "reads every layer again" in format_plan_table(bounded.to_json())


def test_the_cli_plan_keeps_every_pass_within_pass_minutes(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "many.jsonl", [
        {"id": i, "prompt": f"Review {i}: " + "fine kettle " * (i % 9), "choices": ["good", "bad"]}
        for i in range(600)])
    model = tiny_checkpoint("llama")

    def planned(minutes: float) -> dict:
        result = invoke("plan", spec, "--model", model, "--json", "--pass-minutes", minutes, "--streaming", "never")
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["candidates"][0]

    one = planned(10_000)
    minutes = one["longest_pass_seconds"] / 4 / 60
    bounded = planned(minutes)
    assert bounded["longest_pass_seconds"] <= minutes * 60 and bounded["passes"] > one["passes"]
    assert bounded["pass_bound_seconds"] == pytest.approx(minutes * 60)


def test_a_cpu_pass_holds_one_calls_activations_and_is_priced_at_its_calls_padding():
    """A CPU cuts even an unplanned prefill into calls by length: one call's activations are live at a time (every
    sequence keeps its log-probabilities), and padding is to each call's longest, not the batch's."""
    rows = CHOICE_ROWS[:2_000]
    batch = list(range(len(rows)))
    cpu, one_call = batch_bytes(TINY, 4, "cpu", rows, batch), batch_bytes(TINY, 4, "cuda", rows, batch)
    every_activation = len(rows) * activation_bytes_for_sequence(TINY, 4, "cpu", 78, 0)
    assert cpu < one_call and cpu < every_activation / 2
    assert cpu > len(rows) * 2 * TINY.vocab_size * 4  # the kept log-probabilities
    padded = batch_prefill_flops(TINY, rows, batch)
    assert batch_prefill_flops(TINY, rows, batch, cut=(None, "cpu")) < 0.9 * padded
    assert batch_prefill_flops(TINY, rows, batch, cut=(None, "cuda")) == padded  # one call, padded to the longest
