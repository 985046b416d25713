"""The benchmarks' process measurements: what a measured child really held, not its parent."""
from __future__ import annotations

import sys

from benchmarks import harness

CHILD_MB = 64


def test_a_childs_peak_is_its_own_not_the_parents_it_was_spawned_from():
    """Linux keeps the pre-exec high-water mark, so wait4's ru_maxrss reports the parent's RSS for a small child."""
    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touched: the parent's RSS is at least 400 MB
    # The child holds its memory a moment: the poll (every RSS_POLL_SECONDS) is what sees a short-lived peak.
    command = [sys.executable, "-c", f"import time; x = bytearray({CHILD_MB} * 2**20); "
               "x[::4096] = b'1' * len(x[::4096]); time.sleep(0.3)"]
    run = harness.run_measured(command)
    assert run.returncode == 0
    assert run.ru_maxrss_bytes >= 400 * 2**20  # the quirk this guards against
    assert CHILD_MB * 2**20 <= run.peak_rss_bytes < 200 * 2**20
    del ballast


def test_a_child_above_its_parent_keeps_the_exact_wait4_figure():
    assert harness.child_peak_rss(polled_hwm=900, ru_maxrss=1_000, parent_hwm=500) == 1_000
    assert harness.child_peak_rss(polled_hwm=300, ru_maxrss=1_000, parent_hwm=1_000) == 300


def test_the_bounds_matmul_rate_multiplies_the_checkpoints_own_layer_matrices(tiny_checkpoint):
    """The throughput bound's compute rate is timed on decoder layer 0's 2-D weights, in their [out, in] shapes."""
    import json
    import math

    from benchmarks.baselines import layer_rate

    checkpoint = tiny_checkpoint("llama")
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    queries, keys = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    assert sorted(layer_rate.layer_matrix_shapes(checkpoint)) == sorted(
        [(queries, hidden), (keys, hidden), (keys, hidden), (hidden, queries), (inner, hidden), (inner, hidden),
         (hidden, inner)])
    rate = layer_rate.layer_matmul_rate(checkpoint, "float32", "aten", tokens=16, repeats=1)
    assert math.isfinite(rate) and rate > 0
    from batchrun import linear_kernels

    if linear_kernels.packing_available():  # the bound's bfloat16 rate on packed weights
        packed = layer_rate.layer_matmul_rate(checkpoint, "bfloat16", "packed", tokens=16, repeats=1)
        assert math.isfinite(packed) and packed > 0


def test_the_bounds_attention_flops_count_every_decoder_layer(tiny_checkpoint):
    """A token at position p attends in each layer: q.k over p + 1 keys and the weighted sum of p + 1 values, each a
    multiply and an add per query channel. Counted once instead of once per layer, the bound was too strict."""
    import json

    from benchmarks.baselines.bounds import ModelShape

    checkpoint = tiny_checkpoint("llama")
    config = json.loads((checkpoint / "config.json").read_text())
    shape = ModelShape.of(checkpoint)
    assert shape.num_layers == config["num_hidden_layers"]
    width = shape.attention_width
    by_position = sum(config["num_hidden_layers"] * 2 * 2 * width * (p + 1) for p in range(5, 12))
    assert shape.attention_flops(5, 12) == by_position
    assert shape.attention_flops(0, 12) == shape.attention_flops(0, 5) + shape.attention_flops(5, 12)
