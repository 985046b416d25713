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
