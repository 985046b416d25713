"""The plain transformers model, every weight loaded once, run as a streamed model is (handle.ModelHandle)."""
from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from batchrun.checkpoint import TokenizerOnDemand, is_gguf_file, load_config, read_tensor_infos, storage_dtype
from batchrun.host import glibc, keep_heap_flat, return_freed_memory
from batchrun.runtime.devices import resolve_dtype
from batchrun.runtime.gguf_weights import load_gguf_model, model_config
from batchrun.runtime.stream import find_decoder_stack, text_config
from batchrun.runtime.turns import PassProgress, TurnCallback


class ResidentModel(TokenizerOnDemand):
    """The plain transformers model, weights loaded once: a ModelHandle (handle.py), as StreamedModel is."""

    def __init__(self, checkpoint: Path, *, device: str, dtype=None, trust_remote_code: bool = False):
        load_config(checkpoint, trust_remote_code=trust_remote_code)
        infos = read_tensor_infos(checkpoint)  # same refusals as streaming: pickle-only, truncated, missing shards
        self.checkpoint = Path(checkpoint)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device, storage_dtype(infos))
        keep_heap_flat()  # before the first weight is allocated, so no heap grows under the model
        if is_gguf_file(checkpoint):  # dequantized as read into process memory: nothing stays mapped
            self.model = load_gguf_model(self.checkpoint, model_config(self.checkpoint), dtype=self.dtype,
                                         device=self.device)
        else:
            self.model = _load_safetensors(self.checkpoint, self.dtype, self.device, trust_remote_code,
                                           {info.file for info in infos.values()})
        self.model.eval()
        self.config = self.model.config
        self._trust_remote_code = trust_remote_code
        self.passes = 0
        self.bytes_read = sum(info.nbytes for info in infos.values())  # every weight, read once at load
        _, self.layers = find_decoder_stack(self.model, text_config(self.config).num_hidden_layers)
        self._in_pass = False
        self._micro = 0
        self._before_layer = None
        self._on_turn: TurnCallback | None = None
        self._progress: PassProgress | None = None
        self._hooks = [self.model.register_forward_pre_hook(self._count_pass)]
        self._hooks += [layer.register_forward_pre_hook(self._make_layer_hook(i))
                        for i, layer in enumerate(self.layers)]
        self._hooks += [layer.register_forward_hook(self._turn_done) for layer in self.layers]
        if self.device.type == "cpu":  # see host.heap.keep_heap_flat
            self._hooks += [layer.register_forward_hook(_return_freed_memory) for layer in self.layers]

    def _count_pass(self, module, args):
        if not self._in_pass:
            self.passes += 1

    def _turn_done(self, module, args, output) -> None:
        if self._progress is not None:
            self._progress.turn_done()

    def _make_layer_hook(self, index: int):
        def hook(module, args):
            if self._before_layer is not None:
                self._before_layer(index, self._micro)
        return hook

    def run_pass(self, calls, before_layer=None, *, light: bool = False, rows: int = 0) -> list:
        """Micro-batches of one pass. Resident weights cost no reads, so they simply run in turn (and every core
        computes: `light` and `rows` matter only to a streamed model)."""
        self.passes += 1
        self._in_pass, self._before_layer = True, before_layer
        self._progress = PassProgress.of(self._on_turn, len(calls), len(self.layers))
        try:
            results = []
            for micro, call in enumerate(calls):
                self._micro = micro
                with torch.inference_mode():
                    results.append(call())
            return results
        finally:
            self._in_pass, self._before_layer, self._micro, self._progress = False, None, 0, None

    def report_turns(self, on_turn: TurnCallback | None) -> None:
        """Tell `on_turn` of each layer turn of the passes run_pass runs from now on (turns.PassProgress)."""
        self._on_turn = on_turn

    def use_prefill_read_ahead_in_decode(self) -> None:
        """Nothing to do: resident weights are not read ahead."""

    @property
    def max_seq_len(self) -> int | None:
        return getattr(text_config(self.config), "max_position_embeddings", None)

    def __call__(self, *args, **kwargs):
        with torch.inference_mode():
            return self.model(*args, **kwargs)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _load_safetensors(checkpoint: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool,
                      files) -> torch.nn.Module:
    _read_sequentially(files)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype,
                                                 trust_remote_code=trust_remote_code).to(device)
    if device.type == "cpu":
        copy_out_of_file_mappings(model, files)
    return model


def _return_freed_memory(module, args, output) -> None:
    return_freed_memory()


def _read_sequentially(files, chunk: int = 16 << 20) -> None:
    """Pull the shards into the page cache with large reads before transformers maps them.

    transformers 5 memory-maps safetensors; from a cold cache the first pass would then fault the
    weights in 4 KiB at a time, several times slower (docs/performance.md#resident-loads)."""
    buffer = bytearray(chunk)
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def copy_out_of_file_mappings(model: torch.nn.Module, files) -> int:
    """Resident means resident: copy tensors that still point into a memory map of one of the checkpoint's `files`
    into process memory, so the kernel cannot drop them and fault them back in from disk in the middle of a job.
    Tensors transformers already converted (a bf16 checkpoint computed in float32) live in process memory, and
    copying them again costs a large share of the load (docs/performance.md#resident-loads). Where /proc/self/maps
    cannot tell which memory is mapped from a file (not Linux), every tensor is copied. Returns how many were."""
    mapped = file_mapped_ranges(files)
    copied = 0
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if mapped is None or lies_in(tensor, mapped):
                tensor.data = copy_releasing_pages(tensor.data) if mapped is not None else tensor.data.clone()
                copied += 1
    model.tie_weights()
    return copied


COPY_CHUNK_BYTES = 16 << 20


def copy_releasing_pages(original: torch.Tensor) -> torch.Tensor:
    """A copy of a file-mapped tensor, made COPY_CHUNK_BYTES at a time, each chunk's file pages unmapped once copied:
    a whole-tensor copy would hold the tensor twice at its end, a spike at load (docs/performance.md#resident-loads)."""
    if not original.is_contiguous():  # a view: its byte span may hold other tensors' bytes, so nothing is released
        return original.clone()
    copy = torch.empty_like(original)
    source, target = original.view(-1), copy.view(-1)
    step = max(1, COPY_CHUNK_BYTES // original.element_size())
    for start in range(0, source.numel(), step):
        chunk = source[start:start + step]
        target[start:start + step].copy_(chunk)
        release_mapped_pages(chunk.data_ptr(), chunk.numel() * chunk.element_size())
    release_mapped_pages(original.data_ptr(), original.numel() * original.element_size())  # pages chunks shared
    return copy


MADV_DONTNEED = 4  # Linux


def release_mapped_pages(address: int, nbytes: int) -> None:
    """Unmap from this process the file pages wholly inside [address, address + nbytes) of a tensor copied out:
    the file mapping stays until its last tensor is copied, and meanwhile every page the copies read would stay
    resident beside the copies (docs/streaming.md#resident-runs). Pages a
    neighbouring tensor shares are kept; the page cache keeps them all, and the mapping faults a page back in from
    it if anything reads it again. Only the copied tensor's own pages go, so whatever was written there is in its
    copy."""
    libc = glibc()
    page = mmap.PAGESIZE
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    if libc is not None and end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def file_mapped_ranges(files, maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]] | None:
    """Address ranges [start, end) this process maps from `files`; None where the maps file cannot be read."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    wanted = {str(Path(file).resolve()) for file in files}  # the maps name the file itself, not a symlink to it
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in wanted:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def lies_in(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether any byte of the tensor's storage lies in one of the address ranges."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    return any(low < end and start < high for low, high in ranges)
