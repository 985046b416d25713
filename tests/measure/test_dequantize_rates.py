"""GGUF dequantization rates: measured once per type, dtype and thread count, then read from the cache."""
from __future__ import annotations

from batchrun import measure
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
