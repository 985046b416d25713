"""The oneDNN linear kernel must compute what F.linear computes, and only where it applies; the faster kernel, as
measured, is the one runs use."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from batchrun.runtime import linear_kernels

from batchrun import measure
from batchrun.measure import cache, compute
from batchrun.runtime import open_model
from tests.tiny_models import TINY_ARCHS

TOLERANCE = 1e-5
needs_onednn = pytest.mark.skipif(not linear_kernels.onednn_available(), reason="this torch has no oneDNN linear")


def _inputs(shape, seed=0, transpose=False):
    generator = torch.Generator().manual_seed(seed)
    if transpose:  # a non-contiguous view, as a permuted attention output can be
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator).transpose(-1, -2)
    return torch.randn(*shape, generator=generator)


@needs_onednn
@pytest.mark.parametrize("shape,transpose", [((5, 48), False), ((2, 7, 48), False), ((9, 48), True),
                                             ((2, 3, 48), True), ((0, 48), False), ((1, 1, 48), False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_linear_equals_f_linear(shape, transpose, with_bias):
    inputs = _inputs(shape, transpose=transpose)
    weight = _inputs((64, 48), seed=1)
    bias = _inputs((64,), seed=2) if with_bias else None
    got = linear_kernels.onednn_linear(inputs, weight, bias)
    expected = F.linear(inputs, weight, bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def onednn_calls(monkeypatch):
    calls = []
    real = linear_kernels.onednn_linear

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(linear_kernels, "onednn_linear", counted)
    return calls


@needs_onednn
@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "gpt2"])  # GPT-2's Conv1D is no nn.Linear
@pytest.mark.parametrize("mode", ["streamed", "resident"])
def test_a_model_on_onednn_linears_gives_the_plain_models_logits(tiny_checkpoint, arch, mode, onednn_calls):
    path = tiny_checkpoint(arch)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(ids).logits
    model = open_model(path, mode=mode, device="cpu", dtype=torch.float32, linear_kernel="onednn")
    try:
        got = model(ids).logits
    finally:
        model.close()
    linears = sum(type(m) is torch.nn.Linear for m in reference.modules())
    assert len(onednn_calls) >= linears > 0  # every projection and the head ran on oneDNN
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_gradients_other_dtypes_and_other_devices_keep_f_linear(onednn_calls):
    layer = torch.nn.Linear(8, 4)
    linear_kernels.route_linears(layer, "onednn")
    inputs = torch.randn(3, 8)
    layer(inputs).sum().backward()  # autograd: the oneDNN op records no gradient
    assert layer.weight.grad is not None
    with torch.inference_mode():
        assert layer.to(torch.bfloat16)(inputs.to(torch.bfloat16)).dtype == torch.bfloat16
        assert not linear_kernels.takes_onednn(inputs.to("meta"), layer.weight.float().to("meta"), None)
    assert onednn_calls == []


def test_routing_back_to_aten_computes_with_f_linear_again(onednn_calls):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    inputs = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(inputs)
        assert linear_kernels.route_linears(model, "onednn") == 2
        assert linear_kernels.route_linears(model, "aten") == 2
        assert torch.equal(model(inputs), expected)
    assert onednn_calls == []
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'"):
        linear_kernels.route_linears(model, "mkl")


@pytest.mark.parametrize("kernel", linear_kernels.KERNELS)
def test_a_strided_bfloat16_input_reaches_the_matmul_contiguous(kernel, monkeypatch):
    """The head's input is a strided view (the last position of each sequence); torch's CPU bfloat16 linear of a
    strided input expands the weight per sequence (+1 GB for 32 sequences and a 8192-token vocabulary)."""
    head = torch.nn.Linear(16, 32, bias=False).to(torch.bfloat16)
    hidden = torch.randn(4, 5, 16).to(torch.bfloat16)
    seen, real_linear = [], F.linear

    def recording_linear(inputs, weight, bias=None):
        seen.append(inputs.is_contiguous())
        return real_linear(inputs, weight, bias)

    float32 = real_linear(hidden[:, -1:, :].float(), head.weight.float())
    linear_kernels.route_linears(head, kernel)
    monkeypatch.setattr(linear_kernels.F, "linear", recording_linear)
    with torch.inference_mode():
        got = head(hidden[:, -1:, :])
    assert seen == [True]
    assert got.shape == (4, 1, 32)
    assert (got.float() - float32).abs().max().item() <= 0.05 * float32.abs().max().item()  # bfloat16 rounding


def test_a_routed_model_is_freed_when_its_last_reference_goes():
    """No reference cycle through the routing: a closed model's weights go at once, not at the next cyclic GC."""
    import gc
    import weakref

    gc.disable()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        linear_kernels.route_linears(model, "onednn")
        weight = weakref.ref(model[0].weight)
        del model
        assert weight() is None
    finally:
        gc.enable()


def test_subclasses_of_linear_keep_their_own_forward():
    class Scaled(torch.nn.Linear):
        def forward(self, inputs):
            return 2 * super().forward(inputs)

    model = torch.nn.Sequential(Scaled(4, 4))
    assert linear_kernels.route_linears(model, "onednn") == 0


def _timed_by_kernel(seconds_by_kernel, monkeypatch):
    """Replace timing with fixed seconds per kernel, so which one is faster is known."""
    def fake_rounds(works, wait):
        return {name: [seconds_by_kernel[name]] * compute.COMPUTE_REPEATS for name in works}

    monkeypatch.setattr(compute, "_interleaved_seconds", fake_rounds)


def test_kernels_are_timed_in_turn_round_by_round(monkeypatch):
    """A stretch of noise on a shared machine must slow every kernel compared, not whichever was being timed."""
    clock, calls = [0.0], []

    def work(name, seconds):
        def run():
            calls.append(name)
            clock[0] += seconds
        return run

    monkeypatch.setattr(compute.time, "perf_counter", lambda: clock[0])
    rounds = compute._interleaved_seconds({"plain": work("plain", 2.0), "packed": work("packed", 1.0)}, lambda: None)
    assert rounds == {"plain": [2.0] * compute.COMPUTE_REPEATS, "packed": [1.0] * compute.COMPUTE_REPEATS}
    assert calls == ["plain", "packed"] * (1 + compute.COMPUTE_REPEATS)  # one untimed round first


@needs_onednn
@pytest.mark.parametrize("faster", ["aten", "onednn"])
def test_the_kernel_measured_faster_is_cached_and_used(monkeypatch, faster):
    monkeypatch.delenv(linear_kernels.KERNEL_ENV, raising=False)
    _timed_by_kernel({"aten": 1.0 if faster == "aten" else 2.0, "onednn": 1.0 if faster == "onednn" else 2.0},
                     monkeypatch)
    rate = measure.measure_compute_rate("float32", "cpu")
    rows, inner, cols = compute.COMPUTE_SHAPE
    assert rate == 2 * rows * inner * cols / 1.0  # the plan assumes the rate of the kernel it gets
    assert measure.linear_kernel("float32", "cpu") == faster
    assert measure.linear_kernel("float32", "cuda:0") == "aten"


@needs_onednn
def test_an_entry_cached_before_kernels_were_compared_is_measured_again(monkeypatch):
    monkeypatch.delenv(linear_kernels.KERNEL_ENV, raising=False)
    cache.store("compute", f"cpu:float32:threads={torch.get_num_threads()}", {"flops_per_s": 1.0})
    _timed_by_kernel({"aten": 2.0, "onednn": 1.0}, monkeypatch)
    assert measure.linear_kernel("float32", "cpu") == "onednn"


def test_the_environment_overrides_the_measured_choice(monkeypatch):
    _timed_by_kernel({"aten": 2.0, "onednn": 1.0}, monkeypatch)
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "aten")
    assert measure.linear_kernel("float32", "cpu") == "aten"
    if linear_kernels.onednn_available():
        monkeypatch.setenv(linear_kernels.KERNEL_ENV, "onednn")
        assert measure.linear_kernel("float32", "cuda:0") == "aten"  # oneDNN's op here is a CPU kernel
        assert measure.linear_kernel("bfloat16", "cpu") == "aten"  # and it takes float32 only
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "mkl")
    with pytest.raises(ValueError, match="BATCHRUN_LINEAR_KERNEL='mkl': expected one of aten, onednn"):
        measure.linear_kernel("float32", "cpu")



@needs_onednn
def test_the_memory_read_rate_is_timed_on_the_kernel_runs_use_and_again_when_that_changes(monkeypatch):
    used = []
    monkeypatch.setattr(compute, "_linear_kernels", lambda torch, tokens, weight: {
        name: (lambda *args, name=name: used.append(name)) for name in linear_kernels.KERNELS})
    monkeypatch.setattr(compute, "_median_seconds", lambda work, wait: (work(), 1.0)[1])
    key = f"cpu:float32:threads={torch.get_num_threads()}"
    cache.store("memory", key, {"bytes_per_s": 1.0})  # cached before rates named their kernel
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "onednn")
    rate = measure.memory_read_rate("float32", "cpu")
    assert used == ["onednn"] * compute.DECODE_MATRICES
    rows, inner, cols = compute.DECODE_SHAPE
    assert rate == compute.DECODE_MATRICES * cols * inner * 4  # bytes streamed in the (faked) one second
    assert measure.memory_read_rate("float32", "cpu") == rate and len(used) == compute.DECODE_MATRICES  # cached
    monkeypatch.setenv(linear_kernels.KERNEL_ENV, "aten")
    measure.memory_read_rate("float32", "cpu")
    assert used[compute.DECODE_MATRICES:] == ["aten"] * compute.DECODE_MATRICES


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,transpose", [((5, 48), False), ((2, 7, 48), False), ((9, 48), True),
                                             ((0, 48), False), ((1, 1, 48), False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_narrow_weight_multiplies_tile_by_tile_as_the_widened_weight_does(source, shape, transpose, with_bias,
                                                                           monkeypatch):
    """Tiles of 5 rows: 64 output features cross 13 tiles, the last one short."""
    monkeypatch.setattr(linear_kernels, "WIDEN_TILE_BYTES", 5 * 48 * 4)
    inputs = _inputs(shape, transpose=transpose)
    weight = _inputs((64, 48), seed=1).to(source)
    bias = _inputs((64,), seed=2) if with_bias else None
    got = linear_kernels.widening_linear(inputs, weight, bias)
    expected = F.linear(inputs, weight.float(), bias)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_the_widening_tile_serves_calls_in_and_out_of_inference_mode(monkeypatch):
    """The tile is kept per thread across calls: one made under inference_mode must not refuse a later plain call."""
    monkeypatch.setattr(linear_kernels._tiles, "buffer", None, raising=False)
    inputs, weight = _inputs((3, 48)), _inputs((64, 48), seed=1).to(torch.bfloat16)
    expected = F.linear(inputs, weight.float())
    with torch.inference_mode():
        inside = linear_kernels.widening_linear(inputs, weight)
    outside = linear_kernels.widening_linear(inputs, weight)
    assert torch.allclose(inside, expected, rtol=1e-5, atol=1e-5) and torch.equal(inside, outside)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("inference", [True, False])
def test_tiles_shared_by_workers_give_the_one_worker_result_bit_for_bit(workers, inference, monkeypatch):
    """Each worker multiplies whole tiles single-threaded, so who took a tile changes no bit of the output; every
    worker starts and a helper thread really runs (the pool may hand two helpers' turns to one idle thread), and
    torch's thread count is back afterwards."""
    monkeypatch.setattr(linear_kernels, "WIDEN_TILE_BYTES", 3 * 48 * 4)  # 64 features: 22 tiles
    inputs, weight, bias = _inputs((2, 7, 48)), _inputs((64, 48), seed=1).to(torch.bfloat16), _inputs((64,), seed=2)
    alone = linear_kernels.widening_linear(inputs, weight, bias)
    started = []
    real_tile = linear_kernels._tile
    monkeypatch.setattr(linear_kernels, "_tile",
                        lambda *args: started.append(threading.current_thread().name) or real_tile(*args))
    threads = torch.get_num_threads()
    with torch.inference_mode(inference), linear_kernels.sharing_tiles(workers):
        shared = linear_kernels.widening_linear(inputs, weight, bias)
    assert torch.equal(shared, alone) and shared.is_inference() == inference
    assert len(started) == workers and len(set(started)) >= 2 and torch.get_num_threads() == threads
    assert torch.allclose(alone, F.linear(inputs, weight.float(), bias), rtol=1e-5, atol=1e-5)


def test_a_tile_that_fails_on_a_helper_fails_the_linear(monkeypatch):
    monkeypatch.setattr(linear_kernels, "WIDEN_TILE_BYTES", 3 * 48 * 4)
    real_tile = linear_kernels._tile

    def helpers_fail(*args):
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("no tile for a helper")
        return real_tile(*args)

    monkeypatch.setattr(linear_kernels, "_tile", helpers_fail)
    threads = torch.get_num_threads()
    with linear_kernels.sharing_tiles(2), pytest.raises(MemoryError, match="no tile for a helper"):
        linear_kernels.widening_linear(_inputs((3, 48)), _inputs((64, 48), seed=1).to(torch.bfloat16))
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("kernel", linear_kernels.KERNELS)
def test_a_routed_linear_widens_only_a_narrow_weight_under_float32_inputs(kernel, monkeypatch):
    widened = []
    real = linear_kernels.widening_linear
    monkeypatch.setattr(linear_kernels, "widening_linear", lambda *args: widened.append(1) or real(*args))
    layer = torch.nn.Linear(48, 64)
    inputs = _inputs((3, 48))
    with torch.inference_mode():
        expected = layer(inputs)
        linear_kernels.route_linears(layer, kernel)
        layer.weight = torch.nn.Parameter(layer.weight.to(torch.bfloat16), requires_grad=False)
        got = layer(inputs)
        assert widened == [1] and got.dtype == torch.float32
        assert (got - F.linear(inputs, layer.weight.float(), layer.bias)).abs().max().item() <= TOLERANCE
        assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()  # the weight's rounding
        assert layer.to(torch.bfloat16)(inputs.to(torch.bfloat16)).dtype == torch.bfloat16  # bf16 compute: F.linear
    assert widened == [1]


def test_the_weights_a_layer_may_keep_narrow_are_its_routed_linears_only():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4))

    block = Block()
    assert linear_kernels.routed_weight_names(block) == frozenset()
    linear_kernels.route_linears(block, "aten")
    assert linear_kernels.routed_weight_names(block) == {"proj.weight", "inner.0.weight"}


needs_packing = pytest.mark.skipif(not linear_kernels.packing_available(),
                                   reason="this torch's oneDNN packs no bfloat16 weights on this CPU")


@pytest.fixture
def packed_calls(monkeypatch):
    """How many routed forwards multiplied a packed weight."""
    calls = []
    real = linear_kernels._packed_weight

    def counted(module, inputs):
        packed = real(module, inputs)
        if packed is not None:
            calls.append(tuple(inputs.shape))
        return packed

    monkeypatch.setattr(linear_kernels, "_packed_weight", counted)
    return calls


def _bfloat16_linear(in_features: int, out_features: int, bias: bool, kernel: str = "aten") -> torch.nn.Linear:
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_inputs((out_features, in_features), seed=3))
        if bias:
            layer.bias.copy_(_inputs((out_features,), seed=4))
    layer = layer.to(torch.bfloat16).requires_grad_(False)
    linear_kernels.route_linears(layer, kernel)
    return layer


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(64, 48), (100, 37), (256, 512)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("kernel", linear_kernels.KERNELS)
def test_a_packed_bfloat16_weight_gives_f_linears_bits(rows, out_features, in_features, with_bias, kernel,
                                                        packed_calls):
    """Packing changes the weight's layout in memory, not the arithmetic: the same bits as the plain weight (a
    strided input is made contiguous first either way: dense_if_strided_bfloat16)."""
    layer = _bfloat16_linear(in_features, out_features, with_bias, kernel)
    inputs = _inputs((rows, in_features), seed=5).to(torch.bfloat16)
    batched = _inputs((2, rows, in_features), seed=6).to(torch.bfloat16)
    strided = _inputs((2, rows, in_features), seed=7, transpose=True).to(torch.bfloat16)
    with torch.inference_mode():
        expected = [F.linear(x.contiguous(), layer.weight, layer.bias) for x in (inputs, batched, strided)]
        assert all(torch.equal(layer(x), reference) for x, reference in zip((inputs, batched, strided), expected))
        assert linear_kernels.pack_weights(layer) == layer.weight.nbytes
        got = [layer(x) for x in (inputs, batched, strided)]
    assert len(packed_calls) == 3
    for value, reference in zip(got, expected):
        assert value.dtype == torch.bfloat16 and value.shape == reference.shape
        assert torch.equal(value, reference)


@needs_packing
def test_a_pack_serves_only_the_weight_it_was_made_from_and_goes_when_dropped(packed_calls):
    layer = _bfloat16_linear(48, 64, bias=False)
    inputs = _inputs((5, 48)).to(torch.bfloat16)
    with torch.inference_mode():
        linear_kernels.pack_weights(layer)
        layer.weight = torch.nn.Parameter(layer.weight * 2, requires_grad=False)  # a streamed layer's next weights
        assert torch.equal(layer(inputs), F.linear(inputs, layer.weight))
        assert packed_calls == []  # the stale pack was not used
        linear_kernels.pack_weights(layer)
        layer(inputs)
        assert len(packed_calls) == 1
        linear_kernels.drop_packed_weights(layer)
        assert "_packed" not in layer.__dict__
        assert torch.equal(layer(inputs), F.linear(inputs, layer.weight))
    assert len(packed_calls) == 1


@needs_packing
def test_only_routed_bfloat16_linears_pack_and_only_bfloat16_inference_inputs_use_a_pack(packed_calls):
    block = torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    unrouted = torch.nn.Linear(8, 8).to(torch.bfloat16)
    linear_kernels.route_linears(block, "aten")
    block.append(unrouted)  # added after routing: torch's own forward
    assert linear_kernels.pack_weights(block) == 0  # float32 weights: nothing to pack
    block.to(torch.bfloat16)
    assert linear_kernels.pack_weights(block) == (64 * 48 + 8 * 64) * 2
    assert "_packed" not in unrouted.__dict__
    inputs = _inputs((3, 48), seed=8).to(torch.bfloat16)
    with torch.inference_mode():
        block[0](inputs)
        assert block[0](inputs.float()).dtype == torch.float32  # float32 inputs widen the weight instead
    assert len(packed_calls) == 1
    tracked = inputs.clone().requires_grad_(True)
    block[0](tracked)  # a gradient to record: oneDNN's op records none
    assert len(packed_calls) == 1


@needs_packing
@pytest.mark.parametrize("packed_faster", [True, False])
def test_long_prefills_pack_only_where_the_packed_kernel_measured_faster(monkeypatch, packed_faster):
    """A 2-core AMX Xeon runs small prefill calls slower on packed weights: the machine decides."""
    _timed_by_kernel({"aten": 2.0 if packed_faster else 1.0, "packed": 1.0 if packed_faster else 2.0}, monkeypatch)
    # an entry cached before packing was timed is measured again, and so is one whose choice came from medians
    # (noise could flip that choice, and the cache would keep it)
    key = f"cpu:bfloat16:threads={torch.get_num_threads()}"
    cache.store("compute", key, {"flops_per_s": 1.0})
    assert measure.packs_weights("bfloat16", "cpu") == packed_faster
    cache.store("compute", key, {"flops_per_s": 1.0, "packed_flops_per_s": 0.5 if packed_faster else 2.0,
                                    "timed_in_turn": True})  # what the releases that chose by medians cached
    assert measure.packs_weights("bfloat16", "cpu") == packed_faster
    measure.measure_compute_rate("bfloat16", "cpu")
    assert measure.packs_weights("bfloat16", "cpu") == packed_faster
    assert not measure.packs_weights("float32", "cpu")
    assert not measure.packs_weights("bfloat16", "cuda:0")


@needs_packing
def test_packing_is_decided_by_each_kernels_fastest_round_not_by_a_median_noise_slowed(monkeypatch):
    """Packed truly faster, but a stretch of noise landed on most of its rounds: its median reads slower, its
    fastest round does not. Noise only slows rounds down, so the choice (which the cache keeps) follows the fastest."""
    packed_rounds = [1.0, 1.0, 1.0] + [1.6] * (compute.COMPUTE_REPEATS - 3)
    monkeypatch.setattr(compute, "_interleaved_seconds", lambda works, wait: {
        name: list(packed_rounds) if name == compute.PACKED else [1.2] * compute.COMPUTE_REPEATS for name in works})
    measure.measure_compute_rate("bfloat16", "cpu")
    entry = compute._compute_entry("bfloat16", "cpu")
    assert entry["packed_flops_per_s"] < entry["flops_per_s"]  # by medians plain would have won
    assert measure.packs_weights("bfloat16", "cpu")
