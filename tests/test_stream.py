"""The streamed model must equal the plain in-memory transformers model, architecture by architecture."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun import StreamedModel

from batchrun.runtime import linear_kernels

from batchrun.runtime import stream
from batchrun.checkpoint.resolve import CheckpointError
from batchrun.runtime.loader import SLACK_BYTES, widen_in_place
from tests.tiny_models import TINY_ARCHS, build_large_llama, build_sharded_checkpoint

TOLERANCE = 1e-5


def reference(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def sample_ids(vocab: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    # longer than the tiny Gemma 3 sliding window, so windowed layers really differ from full ones
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def in_memory_logits(path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logits): sample ids for the checkpoint at `path` and what the plain in-memory model gives for them."""
    ref = reference(path)
    ids = sample_ids(ref.config.vocab_size)
    with torch.inference_mode():
        return ids, ref(ids).logits


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("prefetching", [True, False])
def test_streamed_logits_equal_in_memory(tiny_checkpoint, arch, prefetching):
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=prefetching) as streamed:
        got = streamed(ids).logits
        assert streamed.passes == 1
        # what a pass reads: every decoder layer once
        assert streamed.peak_materialised_layers <= 2
    assert (got - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_streamed_greedy_generate_equals_in_memory(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    ref = reference(path)
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
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=True) as streamed:
        counts = []

        def count_real(module, args):
            real = sum(1 for layer in streamed.layers for p in layer.parameters() if not p.is_meta)
            per_layer = len(list(streamed.layers[0].parameters()))
            prefetched = len(streamed._pending)
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
        # The slots hold the layer once each, and room to read every tensor from an aligned offset (uncached reads)
        layer_bytes = sum(p.numel() * 4 + SLACK_BYTES for p in streamed.layers[0].parameters())
        assert streamed.loader.buffer_bytes() == streamed.slots.count * layer_bytes


@pytest.mark.parametrize("count", [1, 5, 1000, 3 * 65536 + 7, 2_000_003])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_widening_in_place_equals_a_cast(count, source):
    values = torch.randn(count, generator=torch.Generator().manual_seed(count)).to(source)
    buffer = torch.full((count,), float("nan"))
    buffer.view(torch.uint8)[-count * source.itemsize:].copy_(values.view(torch.uint8))
    widen_in_place(buffer, source)
    assert torch.equal(buffer, values.float())


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


def test_pickle_only_checkpoint_is_refused_by_name(tmp_path, tiny_checkpoint):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(tiny_checkpoint("llama") / "config.json", path / "config.json")
    (path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin") as err:
        StreamedModel(path, device="cpu")
    assert "safetensors" in str(err.value)


def test_missing_path_is_refused_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match="nope"):
        StreamedModel(tmp_path / "nope", device="cpu")


def test_bf16_checkpoint_streams_into_float32(tmp_path, tiny_checkpoint):
    """Storage dtype differs from compute dtype: each tensor is read into its float32 buffer and widened there,
    so the layer slots are the only layer memory (no read buffer at the checkpoint dtype beside them)."""
    ref = reference(tiny_checkpoint("llama")).to(torch.bfloat16)
    path = tmp_path / "bf16"
    ref.save_pretrained(path)
    expected_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sample_ids(ref.config.vocab_size)
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
    reference(tiny_checkpoint(arch)).to(torch.bfloat16).save_pretrained(path)
    expected_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
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


def _edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of a single-shard checkpoint whose tensors pass through edit(dict of name -> tensor)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_layer_tensor_missing_from_the_checkpoint_is_an_error_not_uninitialised_memory(tmp_path, tiny_checkpoint):
    name = "model.layers.1.self_attn.q_proj.weight"
    path = _edited_copy(tiny_checkpoint("llama"), tmp_path / "missing", lambda tensors: tensors.pop(name))
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        with pytest.raises(CheckpointError, match=f"decoder layer 1 has no tensor in the checkpoint for {name}"):
            streamed(sample_ids(streamed.config.vocab_size))


def test_a_layer_tensor_of_the_right_size_but_wrong_shape_is_refused_not_reshaped(tmp_path, tiny_checkpoint):
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128] in the model

    def transpose(tensors):
        tensors[name] = tensors[name].t().contiguous()

    path = _edited_copy(tiny_checkpoint("llama"), tmp_path / "transposed", transpose)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        with pytest.raises(CheckpointError, match=rf"{name} has shape \(128, 64\) in the checkpoint, but the model "
                                                  rf"expects \(64, 128\)"):
            streamed(sample_ids(streamed.config.vocab_size))


def test_a_disk_error_names_the_file(tmp_path, tiny_checkpoint, monkeypatch):
    import errno
    import os

    from batchrun.runtime import weights

    def failing_disk(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with StreamedModel(tiny_checkpoint("llama"), device="cpu", dtype=torch.float32) as streamed:
        monkeypatch.setattr(weights.os, "preadv", failing_disk)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: could not read bytes \d+\.\.\d+ "
                                                  r"\(Input/output error\)"):
            streamed(sample_ids(streamed.config.vocab_size))


def test_contiguous_runs_merge_back_to_back_ranges_of_one_file_only():
    from batchrun.runtime.loader import contiguous_runs

    def info(file, offset, nbytes):
        return SimpleNamespace(file=Path(file), offset=offset, nbytes=nbytes)

    infos = [info("b", 0, 4), info("a", 10, 5), info("a", 0, 10), info("a", 16, 4), info("b", 4, 2)]
    assert contiguous_runs(infos) == [(Path("a"), 0, 15), (Path("a"), 16, 20), (Path("b"), 0, 6)]
    assert contiguous_runs([]) == []


def test_each_layer_read_is_dropped_from_the_page_cache_in_one_advice(tiny_checkpoint, monkeypatch):
    """While streaming, the kernel is told to drop the bytes just read (the model does not fit anyway, and the
    user's other work keeps its cache): every byte of every layer, one call per contiguous run (a layer's tensors
    are back to back in a safetensors file), not one per tensor."""
    from batchrun.runtime import loader

    advised = []
    real = loader.os.posix_fadvise

    def record(fd, offset, length, advice):
        advised.append((offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(loader.os, "posix_fadvise", record)
    path = tiny_checkpoint("llama")
    ids = sample_ids(reference(path).config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=False) as streamed:
        streamed(ids)
        layers = [[recipe.sources[0] for recipe in recipes] for recipes in streamed.loader.layer_recipes]
    assert len(advised) == len(layers)
    assert advised == [(min(i.offset for i in infos), sum(i.nbytes for i in infos)) for infos in layers]


def test_a_failed_read_surfaces_only_after_the_layers_widenings_stop_writing_into_its_slot(tmp_path, tiny_checkpoint,
                                                                                           monkeypatch):
    """Widenings run beside the reads; a load that fails gives its slot back, so none may still be writing there."""
    import threading
    import time

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    reference(tiny_checkpoint("llama")).to(torch.bfloat16).save_pretrained(path)
    running, reads = [], []
    real_read, real_widen = loader.read_into, loader.widen_in_place

    def slow_widen(buffer, source):
        running.append(threading.get_ident())
        time.sleep(0.2)
        real_widen(buffer, source)
        running.pop()

    def read_then_fail(*args):
        reads.append(args)
        if len(reads) == 3:
            raise CheckpointError("disk gone")
        real_read(*args)

    monkeypatch.setattr(loader, "widen_in_place", slow_widen)
    monkeypatch.setattr(loader, "read_into", read_then_fail)
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=False) as streamed:
        with pytest.raises(CheckpointError, match="disk gone"):
            streamed(sample_ids(streamed.config.vocab_size))
        assert running == []  # both widenings submitted before the failure had finished
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=False) as streamed:  # loads in the
        monkeypatch.setattr(loader, "read_into", real_read)  # forward's thread, its slots inference tensors
        expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = sample_ids(streamed.config.vocab_size)
        with torch.inference_mode():
            assert (streamed(ids).logits - expected(ids).logits).abs().max().item() <= TOLERANCE


def store_tensors_in_reverse_name_order(shard: Path) -> None:
    """Rewrite a safetensors shard with its tensors' bytes in reverse name order: a valid file whose storage order is
    not the order the model's parameters are listed in (writers other than safetensors' own choose their order)."""
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    pieces, cursor = [], 0
    for name in sorted((name for name in header if name != "__metadata__"), reverse=True):
        start, end = header[name]["data_offsets"]
        pieces.append(data[start:end])
        header[name]["data_offsets"] = [cursor, cursor + end - start]
        cursor += end - start
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(pieces))


def test_a_layer_is_read_in_the_order_its_bytes_lie_in_the_shard(tmp_path, tiny_checkpoint, monkeypatch):
    """Reads follow the file, not the parameter list: readahead serves a sequential reader (loader.py)."""
    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    reference(tiny_checkpoint("llama")).to(torch.bfloat16).save_pretrained(path)
    for shard in path.glob("*.safetensors"):
        store_tensors_in_reverse_name_order(shard)
    per_load: list[list[tuple[str, int]]] = []
    real_read, real_load = loader.read_into, loader.LayerLoader._load

    def load(self, *args):
        per_load.append([])
        return real_load(self, *args)

    def read(fd, target, offset, file, needed=None):
        if per_load:
            per_load[-1].append((str(file), offset))
        real_read(fd, target, offset, file, needed)

    monkeypatch.setattr(loader.LayerLoader, "_load", load)
    monkeypatch.setattr(loader, "read_into", read)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sample_ids(expected.config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32, prefetching=False) as streamed, torch.inference_mode():
        assert (streamed(ids).logits - expected(ids).logits).abs().max().item() <= TOLERANCE
        assert len(per_load) == streamed.num_layers
    assert all(len(reads) > 1 and reads == sorted(reads) for reads in per_load)


def test_the_reader_moves_on_while_a_layer_widens_and_the_forward_waits_for_it(tmp_path, tiny_checkpoint, monkeypatch):
    """A load returns once its reads are done; the widenings still running are awaited by the forward that needs
    the layer, never skipped: slow widenings give the same logits."""
    import time

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    reference(tiny_checkpoint("llama")).to(torch.bfloat16).save_pretrained(path)
    real_widen, returned_unwidened = loader.widen_in_place, []

    def slow_widen(*args):
        time.sleep(0.05)
        real_widen(*args)

    real_load = loader.LayerLoader._load

    def load(self, *args):
        weights = real_load(self, *args)
        returned_unwidened.append(any(not w.done() for w in weights.widenings))
        return weights

    monkeypatch.setattr(loader, "widen_in_place", slow_widen)
    monkeypatch.setattr(loader.LayerLoader, "_load", load)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sample_ids(expected.config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed, torch.inference_mode():
        assert (streamed(ids).logits - expected(ids).logits).abs().max().item() <= TOLERANCE
    assert any(returned_unwidened)


def test_a_released_slot_starts_the_next_read_before_the_next_layer_runs(tmp_path, tiny_checkpoint):
    """With prefetch depth 1, layer i+2 is asked for when layer i gives its slot back, not when layer i+1 starts:
    the reader does not wait for the forward while a slot is free."""
    path = build_large_llama(tmp_path / "deep", 2_000_000, dtype="float32", num_layers=5, vocab_size=512)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        layers = len(streamed.layers)
        asked_before_start = []
        for index in range(1, layers - 1):
            streamed.layers[index].register_forward_pre_hook(
                lambda module, args, ahead=index + 1: asked_before_start.append(
                    ahead in streamed._pending or ahead in streamed._active), prepend=True)
        streamed(sample_ids(512))
        assert asked_before_start == [True] * (layers - 2)


def test_a_failed_widening_fails_the_pass_and_gives_its_slot_back(tmp_path, tiny_checkpoint, monkeypatch):
    import threading

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    reference(tiny_checkpoint("llama")).to(torch.bfloat16).save_pretrained(path)
    real_widen = loader.widen_in_place
    broken = [True]

    def widen(*args):
        if broken[0]:
            raise RuntimeError("widening broke")
        real_widen(*args)

    monkeypatch.setattr(loader, "widen_in_place", widen)
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = sample_ids(expected.config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        with pytest.raises(RuntimeError, match="widening broke"):
            streamed(ids)
        broken[0] = False
        result = []
        # A slot kept by the failed layer would leave the next pass waiting for it forever.
        again = threading.Thread(target=lambda: result.append(streamed(ids).logits), daemon=True)
        again.start()
        again.join(timeout=60)
        assert result, "the pass after a failed widening never finished: a slot was not given back"
        with torch.inference_mode():
            assert (result[0] - expected(ids).logits).abs().max().item() <= TOLERANCE


@pytest.mark.skipif(not linear_kernels.packing_available(), reason="no bfloat16 weight packing on this CPU")
@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "gpt2"])  # GPT-2's Conv1D is no nn.Linear
def test_a_long_bfloat16_prefill_packs_each_layer_once_and_gives_the_same_logits(tmp_path, tiny_checkpoint, arch,
                                                                                   monkeypatch):
    """From PACK_MIN_ROWS rows a bfloat16 pass packs each layer's linear weights once for all its micro-batches,
    gives the unpacked pass's logits bit for bit, and keeps no packed copy after the pass; a decode pass never
    packs, nor a model opened without pack_weights."""
    path = tmp_path / "bf16"
    reference(tiny_checkpoint(arch)).to(torch.bfloat16).save_pretrained(path)
    expected_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = sample_ids(expected_model.config.vocab_size, batch=3)
    packed_layers, packed_uses = [], []
    real_pack, real_use = stream.pack_weights, linear_kernels._packed_weight
    monkeypatch.setattr(stream, "pack_weights", lambda module: packed_layers.append(module) or real_pack(module))

    def counted_use(module, inputs):
        packed_weight = real_use(module, inputs)
        packed_uses.extend([module] if packed_weight is not None else [])
        return packed_weight

    monkeypatch.setattr(linear_kernels, "_packed_weight", counted_use)
    with StreamedModel(path, device="cpu", dtype=torch.bfloat16, pack_weights=True) as streamed:
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
