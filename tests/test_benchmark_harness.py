"""The benchmarks' process measurements: what a measured child really held, not its parent."""
from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from benchmarks import harness

CHILD_MB = 64


def test_a_childs_peak_is_its_own_not_the_parents_it_was_spawned_from():
    """Linux keeps the pre-exec high-water mark in wait4's ru_maxrss: forked from this process, a small child would
    report this process's RSS. The launcher forks it from a small process instead."""
    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # touched: the parent's RSS is at least 400 MB
    command = [sys.executable, "-c", f"x = bytearray({CHILD_MB} * 2**20); x[::4096] = b'1' * len(x[::4096])"]
    run = harness.run_measured(command)
    assert run.returncode == 0
    assert CHILD_MB * 2**20 <= run.peak_rss_bytes < 200 * 2**20
    del ballast


def test_a_peak_the_child_freed_before_it_exited_still_counts():
    """The peak is what the OOM killer would have seen at the worst moment, however briefly it lasted."""
    command = [sys.executable, "-c", "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); del x; "
               "print('{\"done\": 1}')"]
    run = harness.run_measured(command)
    assert run.returncode == 0 and run.json_stdout() == {"done": 1}
    assert run.peak_rss_bytes >= 300 * 2**20


def test_exit_status_output_and_time_are_the_commands():
    run = harness.run_measured([sys.executable, "-c", "import sys, time; time.sleep(0.3); "
                                "print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (run.returncode, run.stdout.strip(), run.stderr.strip()) == (3, "out", "err")
    assert run.wall_seconds >= 0.3  # at least the command's own sleep


def test_a_command_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    """The command's own child (a worker it spawned) dies with it: nothing stays behind to load the machine."""
    marker = tmp_path / "grandchild.pid"
    command = [sys.executable, "-c", "import subprocess, sys, time; "
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)"]
    run = harness.run_measured(command, timeout=3)
    assert run.returncode == -signal.SIGKILL  # killed at the timeout, not ended after its 60 s sleep
    grandchild = int(marker.read_text())
    for _ in range(50):  # reaped by init a moment after the kill
        try:
            if "State:\tZ" in Path(f"/proc/{grandchild}/status").read_text():  # dead, not yet reaped
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"pid {grandchild} outlived the timeout")


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
    from batchrun.runtime import linear_kernels

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


def test_results_are_named_by_the_class_of_machine_they_come_from(tmp_path, monkeypatch):
    def cpuinfo(model: str, flags: str) -> Path:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: fpu sse2 {flags}\n")
        return path

    assert harness.machine_class(cpuinfo("AMD EPYC 9B14 96-Core Processor", "avx2 avx512f avx512_bf16")) == \
        "epyc-avx512bf16"
    assert harness.machine_class(cpuinfo("Intel(R) Xeon(R) Platinum 8481C", "avx2 avx512f amx_bf16")) == "xeon-amx"
    assert harness.machine_class(cpuinfo("AMD EPYC 7B12", "avx2")) == "epyc-avx2"
    monkeypatch.setattr(harness, "machine_class", lambda: "epyc-avx2")
    assert harness.result_stem("throughput") == "throughput-epyc-avx2"
    assert harness.result_stem("throughput-3gb-llama-epyc-avx2") == "throughput-3gb-llama-epyc-avx2"


def test_a_checkpoints_bytes_are_its_shards_or_its_one_gguf_file(tmp_path):
    # a cap or a bandwidth sample sized from 0 bytes would mean nothing
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "model-00001.safetensors").write_bytes(b"x" * 300)
    (folder / "model-00002.safetensors").write_bytes(b"x" * 200)
    (folder / "tokenizer.json").write_bytes(b"x" * 1000)
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"x" * 700)
    assert harness.checkpoint_bytes(folder) == 500
    assert harness.checkpoint_bytes(gguf) == 700
