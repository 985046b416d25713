"""GGUF dequantization rates: measured once per type, dtype and thread count, then read from the cache; a run's own
decodes replace a figure they contradict, and the next plan prices with it."""
from __future__ import annotations

import json

from batchrun import measure
from batchrun.measure import cache, dequantize
from batchrun.measure.cache import load


def test_dequantize_rates_are_measured_once_per_type_and_cached():
    rates = measure.dequantize_rates(["Q4_K", "Q8_0", "Q4_K"], "float32")
    assert sorted(rates) == ["Q4_K", "Q8_0"] and all(rate > 0 for rate in rates.values())
    cached = load()["dequantize"]
    assert sorted(key.rsplit("|", 1)[-1] for key in cached) == ["Q4_K", "Q8_0"]
    assert measure.dequantize_rates(["Q8_0"], "float32") == {"Q8_0": rates["Q8_0"]}  # the cached figure
    assert set(measure.dequantize_rates(["Q8_0", "F16"], "bfloat16")) == {"Q8_0", "F16"}
    assert len(load()["dequantize"]) == 4  # bfloat16 is measured on its own


def test_a_runs_decodes_replace_a_cached_rate_they_contradict_and_leave_one_they_confirm(monkeypatch):
    import torch

    from batchrun.measure.compute import RATE_DISPUTED_BEYOND
    from batchrun.measure.dequantize import JUDGED_DEQUANTIZE_MIN_SECONDS

    threads = torch.get_num_threads()
    measured = measure.dequantize_rates(["Q4_1", "Q8_0"], "float32")
    seconds = JUDGED_DEQUANTIZE_MIN_SECONDS * 2
    slow = int(measured["Q4_1"] / RATE_DISPUTED_BEYOND / 2 * seconds)  # half the slowest rate the cache stands for
    near = int(measured["Q8_0"] * 1.1 * seconds)  # within what the cache stands for
    short = {"Q4_1": (slow, JUDGED_DEQUANTIZE_MIN_SECONDS / 2)}  # too little decoding to judge by
    assert measure.judge_dequantize_rates(short, "float32", "cpu", threads, job="j0") == set()
    observed = {"Q4_1": (slow, seconds), "Q8_0": (near, seconds)}

    assert measure.judge_dequantize_rates(observed, "float32", "cpu", threads, job="j1") == {"Q4_1", "Q8_0"}
    rates = measure.dequantize_rates(["Q4_1", "Q8_0"], "float32")  # what the next plan prices with
    assert rates == {"Q4_1": slow / seconds, "Q8_0": measured["Q8_0"]}
    entry = load()["dequantize"][f"cpu:float32:threads={threads}|Q4_1"]
    assert entry["observed"] == {"job": "j1", "weights": slow, "seconds": seconds}
    # a run that finds the machine fast again heals the figure back
    fast = {"Q4_1": (int(measured["Q4_1"] * seconds), seconds)}
    measure.judge_dequantize_rates(fast, "float32", "cpu", threads, job="j2")
    assert measure.dequantize_rates(["Q4_1"], "float32") == {"Q4_1": int(measured["Q4_1"] * seconds) / seconds}


def test_a_streamed_run_on_a_gguf_records_the_dequantization_rates_the_next_plan_prices_with(
        default_gguf, tmp_path, monkeypatch):
    from batchrun.checkpoint import checkpoint_sizes
    from tests.support import REPO_ROOT, invoke

    file = default_gguf[0]
    reviews = tmp_path / "reviews.jsonl"  # the first 8 rows of the review job: one pass
    reviews.write_text("".join((REPO_ROOT / "jobs" / "review-sentiment.jsonl").read_text().splitlines(True)[:8]))
    args = ("--model", file, "--streaming", "always", "--dtype", "float32")

    def planned() -> dict:
        result = invoke("plan", reviews, *args, "--json")
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["candidates"][0]

    measured = planned()  # measures each type's rate
    measurements = cache.load()
    for entry in measurements["dequantize"].values():  # as if measured while the machine ran far faster
        entry["weights_per_s"] *= 1000
    cache.write(measurements)
    flattered = planned()
    # a streamed layer holds its blocks: each call through it dequantizes them, a cost of the pass's compute
    assert flattered["compute_seconds_per_pass"] < measured["compute_seconds_per_pass"]

    monkeypatch.setattr(dequantize, "JUDGED_DEQUANTIZE_MIN_SECONDS", 0.0)  # a short run's decodes are enough here
    run = invoke("submit", reviews, *args, "--db", tmp_path / "j.db", "-o", tmp_path / "a.parquet", "--json")
    assert run.exit_code == 0, run.output
    job_id = json.loads(run.stdout)["job_id"]
    cached = {key.rsplit("|", 1)[1]: entry for key, entry in cache.load()["dequantize"].items()
              if ":float32:" in key}
    for ggml_type in checkpoint_sizes(file).layer_params_by_type:  # every type its layers stream in
        assert cached[ggml_type]["observed"]["job"] == job_id, ggml_type
    # the next plan prices the run's rate
    assert planned()["compute_seconds_per_pass"] > flattered["compute_seconds_per_pass"]
