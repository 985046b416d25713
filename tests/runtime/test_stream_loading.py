"""How the streamed model reads its layers: widened in place, read in the order the file holds them, dropped from the
page cache, read ahead into free slots while widenings run; and what a bad checkpoint or a failing disk gives."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from batchrun import StreamedModel
from batchrun.checkpoint import CheckpointError
from batchrun.runtime import LayerReads
from batchrun.runtime.loader import widen_in_place
from tests.reference import TOLERANCE, reference_model
from tests.support import bfloat16_copy, sample_ids
from tests.tiny_models import build_large_llama


@pytest.mark.parametrize("count", [1, 5, 1000, 3 * 65536 + 7, 2_000_003])
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_widening_in_place_equals_a_cast(count, source):
    values = torch.randn(count, generator=torch.Generator().manual_seed(count)).to(source)
    buffer = torch.full((count,), float("nan"))
    buffer.view(torch.uint8)[-count * source.itemsize:].copy_(values.view(torch.uint8))
    widen_in_place(buffer, source)
    assert torch.equal(buffer, values.float())


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
    ids = sample_ids(reference_model(path).config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=False)) as streamed:
        streamed(ids)
        layers = [[recipe.sources[0] for recipe in recipes] for recipes in streamed.loader.layer_recipes]
    assert len(advised) == len(layers)
    assert advised == [(min(i.offset for i in infos), sum(i.nbytes for i in infos)) for infos in layers]


def test_a_failed_read_surfaces_only_after_the_layers_widenings_stop_writing_into_its_slot(tmp_path, tiny_checkpoint,
                                                                                           monkeypatch):
    """Widenings run beside the reads; a load that fails gives its slot back, so none may still be writing there.
    The read fails while a widening runs, and that widening is held until the loader waits for it: a loader that
    did not wait would surface the failure with the widening still writing, however fast the machine."""
    import threading

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    bfloat16_copy(tiny_checkpoint("llama"), path)
    running, reads = [], []
    widening, awaited = threading.Event(), threading.Event()
    real_read, real_widen, real_wait = loader.read_into, loader.widen_in_place, loader.wait

    def held_widen(buffer, source):
        running.append(threading.get_ident())
        widening.set()
        awaited.wait(timeout=60)  # the timeout only stops a hung test
        real_widen(buffer, source)
        running.pop()

    def read_then_fail(*args):
        reads.append(args)
        if len(reads) == 3:
            assert widening.wait(timeout=60), "no widening ran beside the reads"
            raise CheckpointError("disk gone")
        real_read(*args)

    def wait_for(futures):
        awaited.set()
        return real_wait(futures)

    monkeypatch.setattr(loader, "widen_in_place", held_widen)
    monkeypatch.setattr(loader, "read_into", read_then_fail)
    monkeypatch.setattr(loader, "wait", wait_for)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=False)) as streamed:
        try:
            with pytest.raises(CheckpointError, match="disk gone"):
                streamed(sample_ids(streamed.config.vocab_size))
            assert running == []  # the widening in flight at the failure had finished
        finally:
            awaited.set()  # a loader that did not wait left the widening held
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=False)) as streamed:  # loads in the
        monkeypatch.setattr(loader, "read_into", real_read)  # forward's thread, its slots inference tensors
        expected = reference_model(path)
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
    bfloat16_copy(tiny_checkpoint("llama"), path)
    for shard in path.glob("*.safetensors"):
        store_tensors_in_reverse_name_order(shard)
    per_load: list[list[tuple[str, int]]] = []
    real_read, real_load = loader.read_into, loader.LayerLoader._load

    def load(self, *args):
        per_load.append([])
        return real_load(self, *args)

    def read(fd, target, offset, file):
        if per_load:
            per_load[-1].append((str(file), offset))
        real_read(fd, target, offset, file)

    monkeypatch.setattr(loader.LayerLoader, "_load", load)
    monkeypatch.setattr(loader, "read_into", read)
    expected = reference_model(path)
    ids = sample_ids(expected.config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32, reads=LayerReads(prefetch=False)) as streamed, torch.inference_mode():
        assert (streamed(ids).logits - expected(ids).logits).abs().max().item() <= TOLERANCE
        assert len(per_load) == streamed.num_layers
    assert all(len(reads) > 1 and reads == sorted(reads) for reads in per_load)


def test_the_reader_moves_on_while_a_layer_widens_and_the_forward_waits_for_it(tmp_path, tiny_checkpoint, monkeypatch):
    """A load returns once its reads are done; the widenings still running are awaited by the forward that needs
    the layer, never skipped. Each widening is held until the load that asked for it has returned: a load that
    waited for its widenings would never return (the test fails at the safety timeout instead of hanging)."""
    import threading

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    bfloat16_copy(tiny_checkpoint("llama"), path)
    returned = threading.Condition()
    loads_returned = [0]
    widenings_of: dict[int, list] = {}  # layer -> the widenings its load left running
    unwidened_at_return: list[bool] = []
    widened_before_forward: list[tuple[int, bool]] = []
    gave_up: list[bool] = []

    class HeldWidener:
        """The loader's widening thread, each widening held until the load submitting it has returned."""

        def __init__(self, pool):
            self.pool = pool

        def submit(self, fn, *args):
            submitted_during = loads_returned[0]  # this load has not returned yet

            def held():
                with returned:
                    # The timeout only stops a hung test; once one widening gave up, the rest fail at once.
                    if gave_up or not returned.wait_for(lambda: loads_returned[0] > submitted_during, timeout=60):
                        gave_up.append(True)
                        raise AssertionError("the load that asked for this widening never returned: it waited "
                                             "for its own widenings")
                return fn(*args)

            return self.pool.submit(held)

    real_load, real_widener = loader.LayerLoader._load, loader.LayerLoader._widener

    def load(self, index, *args):
        weights = real_load(self, index, *args)
        unwidened_at_return.append(any(not widening.done() for widening in weights.widenings))
        widenings_of[index] = list(weights.widenings)
        with returned:
            loads_returned[0] += 1
            returned.notify_all()
        return weights

    monkeypatch.setattr(loader.LayerLoader, "_load", load)
    monkeypatch.setattr(loader.LayerLoader, "_widener", lambda self: HeldWidener(real_widener(self)))
    expected = reference_model(path)
    ids = sample_ids(expected.config.vocab_size)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed, torch.inference_mode():
        for index, layer in enumerate(streamed.layers):  # after the model's own hook, which acquires the layer
            layer.register_forward_pre_hook(lambda module, args, index=index: widened_before_forward.append(
                (index, all(widening.done() for widening in widenings_of[index]))))
        assert (streamed(ids).logits - expected(ids).logits).abs().max().item() <= TOLERANCE
    # Every load (the pass's, and the next pass's read ahead) returned before its widenings ended.
    assert len(unwidened_at_return) >= streamed.num_layers and all(unwidened_at_return)
    assert widened_before_forward == [(index, True) for index in range(streamed.num_layers)]


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
                    ahead in streamed.reader.pending or ahead in streamed.reader.in_use), prepend=True)
        streamed(sample_ids(512))
        assert asked_before_start == [True] * (layers - 2)


def test_a_failed_widening_fails_the_pass_and_gives_its_slot_back(tmp_path, tiny_checkpoint, monkeypatch):
    import threading

    from batchrun.runtime import loader

    path = tmp_path / "bf16"
    bfloat16_copy(tiny_checkpoint("llama"), path)
    real_widen = loader.widen_in_place
    broken = [True]

    def widen(*args):
        if broken[0]:
            raise RuntimeError("widening broke")
        real_widen(*args)

    monkeypatch.setattr(loader, "widen_in_place", widen)
    expected = reference_model(path)
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
