"""Measurements of this machine: read bandwidth, compute rate, runtime overhead."""
from __future__ import annotations

import json
import os
import sys

import pytest

from batchrun.measure import layer_call as layer_overhead

from batchrun import measure
from batchrun.measure import cache, compute, disk, overhead
from batchrun.host import state_dir



@pytest.fixture(autouse=True)
def no_seeded_measurements(isolated_state):
    """Tests that run a model get the session's measurements seeded in their home (conftest); these start from none."""
    (isolated_state / measure.MEASUREMENTS_FILE).unlink(missing_ok=True)


def cached_measurements() -> dict:
    return json.loads((state_dir() / measure.MEASUREMENTS_FILE).read_text())


def write_file(path, size: int):
    with open(path, "wb") as handle:  # real bytes, so the read touches the disk rather than a sparse hole
        chunk = os.urandom(1 << 20)
        for _ in range(size >> 20):
            handle.write(chunk)
    return path


def test_bandwidth_of_a_checkpoint_is_measured_across_its_shards_and_cached_per_filesystem(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    write_file(checkpoint / "model-00001-of-00002.safetensors", disk.MIN_CACHED_SAMPLE_BYTES // 2)
    write_file(checkpoint / "model-00002-of-00002.safetensors", disk.MIN_CACHED_SAMPLE_BYTES // 2)
    assert measure.cached_bandwidth(checkpoint) is None
    result = measure.measure_read_bandwidth(checkpoint)
    assert result.basis == "measured" and result.bytes_per_s > 0
    assert "64.0 MiB" in result.how and f"2 files from {checkpoint}" in result.how
    assert result.how.startswith("sequential reads after posix_fadvise(DONTNEED)")
    entry = cached_measurements()["bandwidth"][str(os.stat(checkpoint).st_dev)]
    assert entry["bytes_per_s"] == result.bytes_per_s and entry["bytes_read"] == disk.MIN_CACHED_SAMPLE_BYTES
    cached = measure.cached_bandwidth(checkpoint / "model-00002-of-00002.safetensors")  # same filesystem
    assert cached.bytes_per_s == result.bytes_per_s and cached.basis == "measured"


def test_read_stops_at_max_bytes_even_inside_a_chunk(tmp_path):
    file = write_file(tmp_path / "big.safetensors", 4 * disk.READ_CHUNK_BYTES)
    result = measure.measure_read_bandwidth(file, max_bytes=2 * disk.READ_CHUNK_BYTES)
    assert "32.0 MiB" in result.how
    result = measure.measure_read_bandwidth(file, max_bytes=disk.READ_CHUNK_BYTES + (1 << 20))
    assert "17.0 MiB" in result.how


def test_only_the_shards_actually_read_are_named(tmp_path):
    for name in ("a", "b", "c"):
        write_file(tmp_path / f"{name}.safetensors", 2 << 20)
    assert "2 files from" in measure.measure_read_bandwidth(tmp_path, max_bytes=3 << 20).how
    assert "3 files from" in measure.measure_read_bandwidth(tmp_path, max_bytes=6 << 20).how
    assert str(tmp_path / "a.safetensors") in measure.measure_read_bandwidth(tmp_path, max_bytes=1 << 20).how


def test_a_small_sample_is_reported_but_not_cached_for_the_filesystem(tmp_path):
    result = measure.measure_read_bandwidth(write_file(tmp_path / "tiny.bin", 1 << 20))
    assert result.bytes_per_s > 0 and "too small to cache" in result.how
    assert measure.cached_bandwidth(tmp_path) is None


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux/BSD only")
def test_every_file_is_dropped_from_the_page_cache_before_the_clock_starts_and_each_chunk_after(tmp_path,
                                                                                                 monkeypatch):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    write_file(checkpoint / "a.safetensors", 2 * disk.READ_CHUNK_BYTES)
    write_file(checkpoint / "b.safetensors", disk.READ_CHUNK_BYTES)
    events = []
    real_fadvise, real_preadv = os.posix_fadvise, os.preadv
    monkeypatch.setattr(disk.os, "posix_fadvise",
                        lambda fd, offset, length, advice: events.append(("drop", fd, offset, length))
                        or real_fadvise(fd, offset, length, advice))
    monkeypatch.setattr(disk.os, "preadv",
                        lambda fd, buffers, offset: events.append(("read", fd, offset)) or real_preadv(fd, buffers,
                                                                                                       offset))
    measure.measure_read_bandwidth(checkpoint)
    first_read = next(i for i, e in enumerate(events) if e[0] == "read")
    assert [e[2:] for e in events[:first_read]] == [(0, 0), (0, 0)]  # both whole files, before any read
    chunk = disk.READ_CHUNK_BYTES
    reads_and_drops = [e[0] if e[0] == "read" else (e[2], e[3]) for e in events[first_read:]]
    # a: two chunks, each dropped once read, then its end; b: one chunk, dropped, then its end
    assert reads_and_drops == ["read", (0, chunk), "read", (chunk, chunk), "read",
                               "read", (0, chunk), "read"]


def test_compute_rate_is_measured_once_and_then_read_from_the_cache(monkeypatch):
    import torch

    rate = measure.compute_rate("float32", "cpu")
    assert 1e8 < rate < 1e15
    key = f"cpu:float32:threads={torch.get_num_threads()}"
    assert cached_measurements()["compute"][key]["flops_per_s"] == rate

    def must_not_measure(*args):
        raise AssertionError("measured again despite a cached rate")

    monkeypatch.setattr(compute, "measure_compute_rate", must_not_measure)
    assert measure.compute_rate("float32", "cpu") == rate


def test_runtime_overhead_is_measured_in_a_subprocess_and_cached(monkeypatch):
    measured = measure.runtime_overhead_bytes()
    assert 100 << 20 < measured < 8 << 30  # torch + transformers imported: hundreds of MiB
    assert cached_measurements()["runtime_overhead"][sys.executable]["bytes"] == measured
    monkeypatch.setattr(overhead.subprocess, "run", lambda *a, **k: pytest.fail("probe ran again"))
    assert measure.runtime_overhead_bytes() == measured
    assert 0.1 < measure.runtime_import_seconds() < 120  # the same probe timed its imports: torch takes a while


def test_a_rate_is_timed_over_enough_rounds_to_outlast_a_burst_of_other_work(monkeypatch):
    monkeypatch.setattr(compute, "MEASURE_MIN_SECONDS", 0.2)
    rounds = compute._interleaved_seconds({"work": lambda: compute.time.sleep(0.002)}, lambda: None)["work"]
    assert len(rounds) > 2 * compute.COMPUTE_REPEATS  # ~100 rounds of 2 ms, not the 9 a quick matmul would give
    assert sum(rounds) >= 0.19


def test_a_disputed_rate_is_measured_again_and_the_new_figure_is_trusted(monkeypatch):
    import torch

    key = f"cpu:float32:threads={torch.get_num_threads()}"
    cache.store("compute", key, {"flops_per_s": 1e9, "linear_kernel": "aten", "packs_weights": False})
    assert measure.compute_rate("float32", "cpu") == 1e9
    assert measure.dispute_compute_rate("float32", "cpu", {"pass_seconds": 1.0, "planned_seconds": 9.0})
    entry = cached_measurements()["compute"][key]
    assert entry["flops_per_s"] == 1e9 and entry["disputed"]["planned_seconds"] == 9.0  # the evidence is kept
    assert not measure.dispute_compute_rate("float32", "cpu", {})  # already disputed: nothing more to mark
    monkeypatch.setattr(compute, "measure_compute_rate",
                        lambda dtype, device: cache.store("compute", key, {"flops_per_s": 5e10}) or 5e10)
    assert measure.compute_rate("float32", "cpu") == 5e10
    assert "disputed" not in cached_measurements()["compute"][key]


def test_memory_read_rate_is_measured_once_and_then_read_from_the_cache(monkeypatch):
    import torch

    rate = measure.memory_read_rate("float32", "cpu")
    assert 1e8 < rate < 1e13  # bytes/s of weights a decode-shaped matmul streams from RAM
    key = f"cpu:float32:threads={torch.get_num_threads()}"
    assert cached_measurements()["memory"][key]["bytes_per_s"] == rate
    monkeypatch.setattr(compute, "measure_memory_read_rate", lambda *a: pytest.fail("measured again"))
    assert measure.memory_read_rate("float32", "cpu") == rate


def test_a_layer_calls_fixed_cost_is_measured_once_and_then_read_from_the_cache(monkeypatch):
    import torch

    seconds = measure.layer_call_seconds("cpu")
    assert 0 < seconds < float("inf")  # a cost was measured; its size is the machine's, not the test's
    key = f"cpu:float32:threads={torch.get_num_threads()}"
    entry = cached_measurements()["layer_call"][key]
    assert entry["seconds"] == seconds and entry["machine"]["transformers"]
    monkeypatch.setattr(layer_overhead, "seconds_per_layer_call", lambda *a: pytest.fail("measured again"))
    assert measure.layer_call_seconds("cpu") == seconds


def test_the_layer_probe_counts_what_a_layer_adds_not_the_model_around_it():
    """The probe's two models differ only in depth: a layer's cost is their fastest rounds apart over the layers
    they differ by (a slowed round counts for nothing), and never negative."""
    fewer, more = layer_overhead.PROBE_LAYERS
    assert layer_overhead.cost_per_layer({fewer: [2.0, 1.0, 1.5], more: [9.0, 5.0, 30.0]}) == pytest.approx(
        (5.0 - 1.0) / (more - fewer))
    assert layer_overhead.cost_per_layer({fewer: [1.0], more: [0.9]}) == 0.0


def test_the_layer_probe_times_on_one_thread_and_gives_the_others_back(monkeypatch):
    """Python and dispatch are what it times; a team of threads waiting on a core another process holds would
    multiply them (2.76 ms a layer measured once that way, 0.17 idle)."""
    import torch

    seen = []
    fewer, more = layer_overhead.PROBE_LAYERS

    def rounds(device):
        seen.append(torch.get_num_threads())
        return {fewer: [1.0], more: [2.0]}

    monkeypatch.setattr(layer_overhead, "_timed_rounds", rounds)
    before = torch.get_num_threads()
    assert layer_overhead.seconds_per_layer_call() == pytest.approx(1.0 / (more - fewer))
    assert seen == [1] and torch.get_num_threads() == before


def test_a_runtime_overhead_measured_by_an_older_probe_is_measured_again(monkeypatch):
    cache.store("runtime_overhead", sys.executable, {"bytes": 123, "probe": "an older probe"})
    monkeypatch.setattr(overhead.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": "456789 3.25\n"})())
    assert measure.runtime_overhead_bytes() == 456789
    assert measure.runtime_import_seconds() == 3.25
    assert cached_measurements()["runtime_overhead"][sys.executable]["bytes"] == 456789


def test_a_run_counts_only_the_kernel_cache_of_its_own_dtype(monkeypatch):
    """The probe fills float32 (oneDNN) and half-precision (ideep) linear kernel caches and prints each one's growth:
    a run of one dtype fills only its own."""
    monkeypatch.setattr(overhead.subprocess, "run",
                        lambda *a, **k: type("Done", (), {"stdout": "500000000 3.0 50000000 45000000\n"})())
    assert measure.runtime_overhead_bytes() == 500_000_000
    assert measure.runtime_overhead_bytes("float32") == 455_000_000
    assert measure.runtime_overhead_bytes("bfloat16") == measure.runtime_overhead_bytes("float16") == 450_000_000


def test_the_probe_measures_both_kernel_caches_apart():
    measure.runtime_overhead_bytes()
    entry = cached_measurements()["runtime_overhead"][sys.executable]
    assert 0 <= entry["float32_kernel_bytes"] < entry["bytes"] and 0 < entry["half_kernel_bytes"] < entry["bytes"]


def test_runtime_overhead_falls_back_to_the_labelled_constant_when_the_probe_fails(monkeypatch):
    monkeypatch.setattr(overhead, "_RUNTIME_PROBE", "raise SystemExit(3)")
    assert measure.runtime_overhead_bytes() == overhead.RUNTIME_OVERHEAD_FALLBACK_BYTES
    assert "runtime_overhead" not in cache.load()  # a failure is not cached: the next call tries again


def test_damaged_measurement_file_is_replaced_by_the_next_measurement(tmp_path):
    (state_dir() / measure.MEASUREMENTS_FILE).write_text("{not json")
    assert measure.cached_bandwidth(tmp_path) is None
    cache.store("compute", "cpu:float32:threads=1", {"flops_per_s": 1.0})
    assert cached_measurements()["compute"]["cpu:float32:threads=1"]["flops_per_s"] == 1.0


# --- measurements of another machine ----------------------------------------------------------------------------


def _measured_elsewhere(section: str, key: str, **differences) -> None:
    """Rewrite a cached entry's identity as another machine's."""
    measurements = cached_measurements()
    measurements[section][key]["machine"].update(differences)
    (state_dir() / measure.MEASUREMENTS_FILE).write_text(json.dumps(measurements))


def test_a_rate_measured_on_another_processor_or_torch_is_measured_again(monkeypatch):
    import torch

    key = f"cpu:float32:threads={torch.get_num_threads()}"
    cache.store("compute", key, {"flops_per_s": 1.0, "linear_kernel": "aten"})
    assert measure.compute_rate("float32", "cpu") == 1.0
    monkeypatch.setattr(compute, "measure_compute_rate", lambda *a: 2.0)
    _measured_elsewhere("compute", key, cpu="AMD EPYC 7B13")
    assert measure.compute_rate("float32", "cpu") == 2.0
    cache.store("compute", key, {"flops_per_s": 1.0, "linear_kernel": "aten"})
    _measured_elsewhere("compute", key, torch="1.13.0")
    assert measure.compute_rate("float32", "cpu") == 2.0


def test_a_rate_cached_before_measurements_carried_their_machine_is_measured_again(monkeypatch):
    import torch

    key = f"cpu:float32:threads={torch.get_num_threads()}"
    measurements = {"memory": {key: {"bytes_per_s": 1.0, "linear_kernel": measure.linear_kernel("float32")}}}
    (state_dir() / measure.MEASUREMENTS_FILE).write_text(json.dumps(measurements))
    monkeypatch.setattr(compute, "measure_memory_read_rate", lambda *a: 3.0)
    assert measure.memory_read_rate("float32", "cpu") == 3.0


def test_a_bandwidth_measured_on_another_mount_or_machine_is_not_used(tmp_path):
    write_file(tmp_path / "model.safetensors", disk.MIN_CACHED_SAMPLE_BYTES)
    measured = measure.measure_read_bandwidth(tmp_path)
    assert measure.cached_bandwidth(tmp_path).bytes_per_s == measured.bytes_per_s
    key = str(os.stat(tmp_path).st_dev)
    _measured_elsewhere("bandwidth", key, filesystem="ext4 /dev/nvme1n1")
    assert measure.cached_bandwidth(tmp_path) is None
    measure.measure_read_bandwidth(tmp_path)
    _measured_elsewhere("bandwidth", key, cpu="Ampere Altra")
    assert measure.cached_bandwidth(tmp_path) is None


def test_the_runtime_overhead_is_measured_again_when_a_native_cache_setting_changes(monkeypatch):
    answers = iter(["456789 3.0\n", "567890 3.0\n"])
    monkeypatch.setattr(overhead.subprocess, "run", lambda *a, **k: type("Done", (), {"stdout": next(answers)})())
    assert measure.runtime_overhead_bytes() == 456789
    assert measure.runtime_overhead_bytes() == 456789  # cached
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    assert measure.runtime_overhead_bytes() == 567890


def test_an_accelerators_rates_are_kept_apart_by_its_name(monkeypatch):
    monkeypatch.setattr(cache, "_accelerator_name", lambda device: f"H200 at {device}")
    assert cache.identity("compute", "cuda:1:bfloat16:threads=2")["accelerator"] == "H200 at cuda:1"
    assert "accelerator" not in cache.identity("memory", "cpu:float32:threads=2")


# --- decode rates of the checkpoint's own layer matrices --------------------------------------------------------


def test_a_checkpoints_layer_matrices_are_timed_by_row_count_once(tiny_checkpoint, monkeypatch):
    from batchrun.checkpoint import checkpoint_sizes

    sizes = checkpoint_sizes(tiny_checkpoint("llama"))
    assert sizes.layer_matrices and all(len(shape) == 2 for shape in sizes.layer_matrices)
    assert (sizes.hidden_size, sizes.intermediate_size) in sizes.layer_matrices  # down_proj's [out, in]
    rates = measure.decode_rates(sizes.layer_matrices, sizes.num_layers, "float32")
    assert sorted(rates) == list(compute.DECODE_ROWS) and all(rate > 0 for rate in rates.values())
    from batchrun.measure import layer_rates

    monkeypatch.setattr(layer_rates, "weight_read_rates", lambda *a, **k: pytest.fail("measured again"))
    assert measure.decode_rates(sizes.layer_matrices, sizes.num_layers, "float32") == rates
    monkeypatch.setattr(layer_rates, "weight_read_rates", lambda *a, **k: {1: 7.0})
    assert measure.decode_rates(((32, 64),), sizes.num_layers, "float32") == {1: 7.0}  # other shapes: their own
    assert measure.decode_rates((), sizes.num_layers, "float32") is None  # sizes estimated from a config


def test_the_matrices_timed_are_the_models_working_set_or_a_bounded_slice_of_it():
    from batchrun.measure.layer_rates import cycled_shapes

    small = [(64, 64), (128, 64)]  # 48 KiB a layer in float32
    assert cycled_shapes(small, 4, num_layers=3) == small * 3  # the whole decoder: what its passes meet
    assert cycled_shapes(small, 4, num_layers=10 ** 6, cycled_bytes=100 << 10) == small * 3  # 3 x 48 KiB > 100 KiB
    huge = [(8192, 8192), (1024, 8192), (28672, 8192)]  # a 70B layer, bfloat16: 128, 16 and 448 MiB
    assert cycled_shapes(huge, 2, num_layers=80, cycled_bytes=256 << 20) == [(8192, 8192), (1024, 8192)]
    assert cycled_shapes(huge[2:], 2, num_layers=80, cycled_bytes=256 << 20) == [(28672, 8192)]  # at least one


def test_generation_passes_that_disagree_with_their_plan_dispute_every_rate_that_priced_them():
    """Rates measured while the machine was busy price decode passes far too slow: once the passes add up to a
    judgeable time, every figure behind them is disputed, so the next plan measures them again on the machine as it
    is; passes close to their plan, or too short to judge, dispute nothing."""
    import torch

    key = f"cpu:float32:threads={torch.get_num_threads()}"
    decode_key = f"{key}|0123456789abcdef"

    def seed():
        cache.store("compute", key, {"flops_per_s": 1e9, "linear_kernel": "aten", "packs_weights": False})
        cache.store("memory", key, {"bytes_per_s": 1e9, "linear_kernel": "aten"})
        cache.store("layer_call", key, {"seconds": 1e-3})
        cache.store("decode", decode_key, {"bytes_per_s": {"1": 1e9}, "linear_kernel": "aten"})
        cache.store("decode", "cpu:bfloat16:threads=1|0123456789abcdef", {"bytes_per_s": {"1": 1e9}})

    def disputed() -> set[str]:
        return {f"{section}:{name}" for section, entries in cached_measurements().items()
                for name, entry in entries.items() if entry.get("disputed")}

    seed()
    assert not measure.judge_generation_rates("float32", "cpu", 0.3, 1.2, job="j")  # too short to judge
    assert measure.judge_generation_rates("float32", "cpu", 2.4, 3.0, job="j")  # judged: close enough
    assert disputed() == set()
    assert measure.judge_generation_rates("float32", "cpu", 2.7, 116.0, job="j")
    assert disputed() == {f"compute:{key}", f"memory:{key}", f"layer_call:{key}", f"decode:{decode_key}"}
    assert cached_measurements()["decode"][decode_key]["disputed"]["planned_seconds"] == 116.0
    seed()
    assert measure.judge_generation_rates("float32", "cpu", 9.0, 3.0, job="j")  # too slow: disputed as well
    assert f"layer_call:{key}" in disputed()


def test_the_import_time_an_eta_counts_is_the_median_of_recent_starts_and_leaves_the_memory_alone():
    entry = {"bytes": 500 << 20, "import_seconds": 9.0, "probe": overhead._probe_digest()}
    cache.store("runtime_overhead", sys.executable, entry)  # probed while the machine was busy
    assert measure.record_runtime_import(3.0) == 6.0  # the probe's 9 s and one start's 3 s
    assert measure.record_runtime_import(3.2) == 3.2
    for seconds in (3.1, 2.9, 30.0, 3.0):  # a cold start after a boot moves it little
        figure = measure.record_runtime_import(seconds)
    assert figure == 3.1 and measure.runtime_import_seconds() == 3.1
    kept = cached_measurements()["runtime_overhead"][sys.executable]
    assert kept["import_observed"] == [3.2, 3.1, 2.9, 30.0, 3.0] and kept["bytes"] == 500 << 20


def test_a_start_with_nothing_cached_records_nothing_and_the_first_plan_probes():
    assert measure.record_runtime_import(3.0) is None
    assert not (state_dir() / measure.MEASUREMENTS_FILE).exists()
