"""The streamed model must equal the plain in-memory transformers model, architecture by architecture: its logits and
greedy generation, at most two layers in memory, narrow decode passes, packed long prefills, its build and close."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import StreamedModel
from batchrun.runtime import LayerReads, linear_kernels, stream
from tests.reference import TOLERANCE, reference_model
from tests.support import bfloat16_copy, in_memory_logits, sample_ids
from tests.tiny_models import TINY_ARCHS, build_sharded_checkpoint


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("prefetching", [True, False])
def test_streamed_logits_equal_in_memory(tiny_checkpoint, arch, prefetching):
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=prefetching)) as streamed:
        got = streamed(ids).logits
        assert streamed.passes == 1
        # what a pass reads: every decoder layer once
        assert streamed.peak_materialised_layers <= 2
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_greedy_generate_equals_in_memory(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    ref = reference_model(path)
    ids = sample_ids(ref.config.vocab_size, batch=1, length=12)
    with torch.inference_mode():
        expected = ref.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        got = streamed.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert streamed.passes == 10  # one pass per generated token, the prompt rides in the first
    assert torch.equal(got, expected)


def test_at_most_two_layers_materialised_during_a_pass(tiny_checkpoint):
    """Count materialised layer parameters from inside every layer's forward."""
    path = tiny_checkpoint("llama")
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=True)) as streamed:
        counts = []

        def count_real(module, args):
            real = sum(1 for layer in streamed.layers for p in layer.parameters() if not p.is_meta)
            per_layer = len(list(streamed.layers[0].parameters()))
            prefetched = len(streamed.reader.pending)
            counts.append(real / per_layer + prefetched)

        hooks = [layer.register_forward_pre_hook(count_real) for layer in streamed.layers]
        streamed(sample_ids(streamed.model.config.vocab_size))
        for hook in hooks:
            hook.remove()
        assert len(counts) == len(streamed.layers)
        assert max(counts) <= 2
        assert streamed.peak_materialised_layers == 2
        # released after the pass: nothing left on real memory in the decoder stack
        assert all(p.is_meta for p in streamed.layers.parameters())


def test_sharded_checkpoint_streams_exactly(tmp_path):
    path = build_sharded_checkpoint("qwen2", tmp_path)
    assert len(list(path.glob("*.safetensors"))) > 1
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        assert (streamed(ids).logits - expected).abs().max().item() <= TOLERANCE
        # The slots hold the layer once each
        layer_bytes = sum(p.numel() * 4 for p in streamed.layers[0].parameters())
        assert streamed.loader.buffer_bytes() == streamed.slots.count * layer_bytes


def test_building_costs_no_layer_memory_and_resident_parts_are_real(tiny_checkpoint):
    with StreamedModel(tiny_checkpoint("gemma3"), device="cpu", dtype=torch.float32) as streamed:
        assert all(p.is_meta for p in streamed.layers.parameters())
        outside = [p for n, p in streamed.model.named_parameters() if not n.startswith(streamed.layers_path)]
        assert outside and not any(p.is_meta for p in outside)
        assert not any(b.is_meta for b in streamed.model.buffers())
        # tied embeddings stay tied
        assert streamed.model.get_output_embeddings().weight is streamed.model.get_input_embeddings().weight


def test_close_is_idempotent_and_tokenizer_attached(tiny_checkpoint):
    streamed = StreamedModel(tiny_checkpoint("llama"), device="cpu")
    assert streamed.tokenizer is not None
    assert streamed.device == torch.device("cpu")
    assert streamed.dtype == torch.float32  # float32 on CPU by default
    streamed.close()
    streamed.close()
    with pytest.raises(RuntimeError, match="this StreamedModel is closed"):
        streamed.model(input_ids=torch.tensor([[1, 2]]))


def test_bf16_checkpoint_streams_into_float32(tmp_path, tiny_checkpoint):
    """Storage dtype differs from compute dtype: each tensor is read into its float32 buffer and widened there,
    so the layer slots are the only layer memory (no read buffer at the checkpoint dtype beside them)."""
    path = bfloat16_copy(tiny_checkpoint("llama"), tmp_path / "bf16")
    expected_model = reference_model(path)
    ids = sample_ids(expected_model.config.vocab_size)
    with torch.inference_mode():
        expected = expected_model(ids).logits
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        assert (streamed(ids).logits - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_decode_pass_keeps_linear_weights_narrow_and_equals_in_memory(tmp_path, tiny_checkpoint, arch):
    """A light pass (a decode step) multiplies the bf16 linear weights as they lie in the checkpoint, widening them
    tile by tile; everything else is widened into its slot. A full pass after it finds the layers read ahead for it
    narrow and widens them: both give the float32 model's logits."""
    path = tmp_path / "bf16"
    bfloat16_copy(tiny_checkpoint(arch), path)
    expected_model = reference_model(path)
    ids = sample_ids(expected_model.config.vocab_size)
    with torch.inference_mode():
        expected = expected_model(ids).logits
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        seen: list[dict[str, torch.dtype]] = []
        for layer in streamed.layers:  # after the streaming hook that assigns the layer's weights
            layer.register_forward_pre_hook(lambda module, args: seen.append(
                {name: p.dtype for name, p in module.named_parameters()}))
        narrowable = streamed.loader.narrowable[0]
        light = streamed.run_pass([lambda: streamed.model(ids).logits], light=True)[0]
        assert (light - expected).abs().max().item() <= TOLERANCE
        for dtypes in seen:
            assert {name for name, dtype in dtypes.items() if dtype == torch.bfloat16} == narrowable
        assert bool(narrowable) == (arch != "gpt2")  # GPT-2's Conv1D is no nn.Linear: it stays widened
        seen.clear()
        full = streamed.run_pass([lambda: streamed.model(ids).logits])[0]
        assert all(dtype == torch.float32 for dtypes in seen for dtype in dtypes.values())
        assert (full - expected).abs().max().item() <= TOLERANCE
        assert streamed.passes == 2


@pytest.mark.skipif(not linear_kernels.packing_available(), reason="no bfloat16 weight packing on this CPU")
@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "gpt2"])  # GPT-2's Conv1D is no nn.Linear
def test_a_long_bfloat16_prefill_packs_each_layer_once_and_gives_the_same_logits(tmp_path, tiny_checkpoint, arch,
                                                                                   monkeypatch):
    """From PACK_MIN_ROWS rows a bfloat16 pass packs each layer's linear weights once for all its micro-batches,
    gives the unpacked pass's logits bit for bit, and keeps no packed copy after the pass; a decode pass never
    packs, nor a model opened without pack_weights."""
    path = tmp_path / "bf16"
    bfloat16_copy(tiny_checkpoint(arch), path)
    expected_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = sample_ids(expected_model.config.vocab_size, batch=3)
    packed_layers, packed_uses = [], []
    real_pack, real_use = linear_kernels.pack_weights, linear_kernels._packed_weight
    monkeypatch.setattr("batchrun.runtime.streamed_layer.pack_weights",
                        lambda module: packed_layers.append(module) or real_pack(module))

    def counted_use(module, inputs):
        packed_weight = real_use(module, inputs)
        packed_uses.extend([module] if packed_weight is not None else [])
        return packed_weight

    monkeypatch.setattr(linear_kernels, "_packed_weight", counted_use)
    with StreamedModel(path, device="cpu", dtype=torch.bfloat16, reads=LayerReads(pack_weights=True)) as streamed:
        calls = [lambda: streamed.model(ids[:1]).logits, lambda: streamed.model(ids[1:]).logits]
        plain = streamed.run_pass(calls, rows=stream.PACK_MIN_ROWS - 1)
        assert packed_layers == [] and packed_uses == []
        packed = streamed.run_pass(calls, rows=stream.PACK_MIN_ROWS)
        assert packed_layers == list(streamed.layers)  # each once, in order, for both micro-batches
        layer_linears = {m for layer in streamed.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)}
        assert packed_uses and set(packed_uses) == layer_linears  # every decoder linear multiplied its pack
        assert len(packed_uses) == 2 * len(layer_linears)  # once per micro-batch
        assert all(torch.equal(a, b) for a, b in zip(plain, packed))
        assert not any("_packed" in module.__dict__ for module in streamed.model.modules())
        streamed.run_pass(calls, rows=stream.PACK_MIN_ROWS, light=True)
        assert len(packed_layers) == streamed.num_layers and len(packed_uses) == 2 * len(layer_linears)
        streamed.may_pack = False  # where the packed kernel measured slower (measure.packs_weights)
        assert torch.equal(torch.cat(streamed.run_pass(calls, rows=stream.PACK_MIN_ROWS)), torch.cat(plain))
        assert len(packed_layers) == streamed.num_layers
    with torch.inference_mode():
        expected = expected_model(ids).logits
    got = torch.cat(packed)  # the in-memory bfloat16 model's logits, to a bfloat16 rounding of the largest (the same
    # bits on the AVX512-BF16 machine this was written on)
    assert (got.float() - expected.float()).abs().max().item() <= 2 ** -8 * expected.float().abs().max().item()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_long_prefill_gives_the_in_memory_logits(tiny_checkpoint, arch):
    """A pass counted as a long prefill (run_pass(rows=...) from PACK_MIN_ROWS) reads its layers as any other pass
    does and computes the in-memory model's logits, the same bits as a short pass, whose first layers the long pass
    read ahead."""
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        [long] = streamed.run_pass([lambda: streamed.model(ids).logits], rows=stream.PACK_MIN_ROWS)
        [short] = streamed.run_pass([lambda: streamed.model(ids).logits], rows=stream.PACK_MIN_ROWS - 1)
    assert (long - expected).abs().max().item() <= TOLERANCE
    assert torch.equal(long, short)
