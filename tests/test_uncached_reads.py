"""A long prefill on the CPU reads its layers around the page cache (O_DIRECT) and must compute exactly what cached
reads and the in-memory model compute, falling back to cached reads wherever O_DIRECT is refused."""
from __future__ import annotations

import errno
import fcntl
import mmap
import os

import pytest
import torch

from batchrun import StreamedModel

from batchrun.runtime import loader

from batchrun.runtime import stream
from batchrun.checkpoint.resolve import CheckpointError
from tests.test_stream import TOLERANCE, in_memory_logits
from tests.tiny_models import TINY_ARCHS


def o_direct_works(checkpoint) -> bool:
    """Whether the checkpoint's filesystem takes an aligned O_DIRECT read of its first shard (tmpfs before Linux 6.6
    and some FUSE mounts refuse it)."""
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    aligned = mmap.mmap(-1, loader.DIRECT_ALIGN)  # page-aligned memory
    try:
        fd = os.open(shard, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        return os.preadv(fd, [aligned], 0) > 0
    except OSError:
        return False
    finally:
        os.close(fd)


def record_reads(monkeypatch) -> list[bool]:
    """Whether each read of a layer tensor went through a descriptor opened with O_DIRECT."""
    uncached: list[bool] = []
    real_read = loader.read_into

    def read(fd, target, offset, file, needed=None):
        uncached.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
        return real_read(fd, target, offset, file, needed)

    monkeypatch.setattr(loader, "read_into", read)
    return uncached


def long_prefill(streamed: StreamedModel, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """One pass that counts as multiplying each layer by `rows` positions (what decides the read mode)."""
    [out] = streamed.run_pass([lambda: streamed.model(ids)], rows=rows)
    return out.logits


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_a_long_prefill_reads_uncached_and_gives_the_in_memory_logits(tiny_checkpoint, arch, monkeypatch):
    path = tiny_checkpoint(arch)
    ids, expected = in_memory_logits(path)
    uncached = record_reads(monkeypatch)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed:
        uncached.clear()  # the resident weights' reads at open
        got = long_prefill(streamed, ids, stream.UNCACHED_MIN_ROWS)
        first_pass = list(uncached)
        uncached.clear()
        short = long_prefill(streamed, ids, stream.UNCACHED_MIN_ROWS - 1)
        # Tensors read in place, at the compute dtype; others (experts fused at load time) pass through staging
        in_place = sum(len(streamed.loader._split(index)[0]) for index in range(streamed.num_layers))
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert torch.equal(got, short)  # the same bytes whichever way they were read
    assert in_place > 0
    if o_direct_works(path):
        assert sum(first_pass) >= in_place  # and the next pass's first layer, read ahead
    else:
        assert not any(first_pass)
    # A pass below the threshold reads cached, except the layers the long pass had already read ahead for it
    assert uncached and not all(uncached)


def test_a_filesystem_without_o_direct_is_read_cached(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    ids, expected = in_memory_logits(path)
    real_open = os.open

    def open_refusing_o_direct(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(loader.os, "open", open_refusing_o_direct)
    uncached = record_reads(monkeypatch)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed, torch.inference_mode():
        got = long_prefill(streamed, ids, stream.UNCACHED_MIN_ROWS)
        assert set(streamed.loader._uncached_fds.values()) == {None}  # asked once per file, then never again
    assert uncached and not any(uncached)
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_a_refused_o_direct_read_falls_back_for_that_file_and_a_real_fault_still_fails(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    ids, expected = in_memory_logits(path)
    real_read = loader.read_into
    refused: list[str] = []

    def read_refusing_aligned(fd, target, offset, file, needed=None):
        if needed is not None:  # an O_DIRECT read: the filesystem opened the file but refuses the read
            refused.append(str(file))
            raise CheckpointError(f"{file}: refused") from OSError(errno.EINVAL, "Invalid argument")
        return real_read(fd, target, offset, file, needed)

    monkeypatch.setattr(loader, "read_into", read_refusing_aligned)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed, torch.inference_mode():
        got = long_prefill(streamed, ids, stream.UNCACHED_MIN_ROWS)
        files = {str(recipe.sources[0].file) for recipes in streamed.loader.layer_recipes for recipe in recipes}
        assert sorted(refused) == sorted(files)  # once per file
    assert (got - expected).abs().max().item() <= TOLERANCE

    def read_failing_aligned(fd, target, offset, file, needed=None):
        if needed is not None:
            raise CheckpointError(f"{file}: could not read (Input/output error)") from OSError(errno.EIO, "I/O")
        return real_read(fd, target, offset, file, needed)

    monkeypatch.setattr(loader, "read_into", read_failing_aligned)
    with StreamedModel(path, device="cpu", dtype=torch.float32) as streamed, torch.inference_mode():
        if any(streamed.loader._uncached_fd(file) is not None for file in files):
            with pytest.raises(CheckpointError, match="Input/output error"):
                long_prefill(streamed, ids, stream.UNCACHED_MIN_ROWS)


def test_an_uncached_read_lands_whole_tensors_from_any_offset(tmp_path):
    """The tensor sits as far past the slot's aligned start as its file offset lies past an aligned one; the span
    read ends on an aligned byte and stays inside the slot's bytes."""
    tensors = {}
    layer = loader.LayerLoader([], [], [], device=torch.device("cpu"), model=None, config=None)
    like = torch.empty(3, 5, dtype=torch.bfloat16, device="meta")
    for misalign in (0, 2, 4094):
        tensor, span = layer._uncached_target(0, "weight", like, misalign)
        raw, start = layer._raw_bytes(0, "weight", like)
        assert tensor.data_ptr() - raw.data_ptr() == start + misalign
        assert (raw.data_ptr() + start) % loader.DIRECT_ALIGN == 0 and len(span) % loader.DIRECT_ALIGN == 0
        assert len(span) >= misalign + 30 and start + len(span) <= raw.numel()
        tensors[misalign] = tensor
    assert {t.shape for t in tensors.values()} == {torch.Size([3, 5])}
    layer.close()
