"""Read one decoder layer's weights from the original safetensors shards into reusable buffers.

The I/O path: each layer's tensors are read with large positional reads of their byte ranges
(coalesced per shard), never through a memory map, into buffers allocated once and reused for every
layer (allocating and first-touching fresh memory per layer costs more than the read itself, and
glibc would keep the freed pages). Once a layer's reads are done the kernel is advised to drop those
pages (one call per contiguous run): a streamed model does not fit in memory anyway, and the user's
other work keeps its cache.
"""
from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from batchrun.checkpoint import CheckpointError, TensorInfo
from batchrun.runtime.gguf_weights import QuantizedWeight
from batchrun.runtime.weights import SAFETENSORS_DTYPES, Recipe, coalesce, read_into, realize, tensor_from_bytes


@dataclass
class LayerWeights:
    """A loaded layer: parameter name within the layer -> tensor living in slot `slot`."""

    index: int
    slot: int
    tensors: dict[str, torch.Tensor]
    ready: torch.cuda.Event | None = None  # set when an asynchronous host->device copy is in flight
    # Host widenings still running when the reads finished: the reader moves on to the next layer at once, and
    # the layer's user waits for these (wait_widened) before the first forward that reads it.
    widenings: list[Future] = field(default_factory=list)
    # Linear weights kept at the checkpoint's narrower dtype (a narrow load): name -> the float32 buffer whose last
    # bytes hold them, should a pass need them widened after all (LayerLoader.widen_narrow).
    narrow: dict[str, torch.Tensor] = field(default_factory=dict)
    # Linear weights held as their GGUF blocks (gguf_weights.QuantizedWeight), dequantized as they multiply; their
    # parameters stay on the meta device.
    quantized: dict[str, object] = field(default_factory=dict)

    def wait_widened(self) -> None:
        """Block until every tensor is widened; a widening that failed fails here."""
        pending, self.widenings = self.widenings, []
        wait(pending)  # all of them, even when one failed: the caller may give the slot back next
        for widening in pending:
            widening.result()


class LayerLoader:
    """Loads layer `i` into buffer slot `s`; slots are owned by the caller (see SlotPool)."""

    def __init__(self, layer_recipes: list[list[Recipe]], layer_prefixes: list[str], meta_params: list[dict],
                 *, device: torch.device, model, config, drop_page_cache: bool = True,
                 narrowable: list[frozenset[str]] | None = None):
        self.layer_recipes = layer_recipes
        self.layer_prefixes = layer_prefixes
        self.meta_params = meta_params  # per layer: relative name -> meta tensor (shape, dtype of the target)
        # per layer: the names whose module computes from a narrower weight as it would from the widened one
        # (linear_kernels.widening_linear); a narrow load leaves these unwidened
        self.narrowable = narrowable or [frozenset() for _ in layer_prefixes]
        self.device = device
        self.model = model
        self.config = config
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self._fds: dict[str, int] = {}
        self._buffers: dict[tuple[int, str, tuple, torch.dtype], torch.Tensor] = {}
        self._read_targets: dict[tuple, tuple[torch.Tensor, memoryview, torch.Tensor]] = {}
        # One raw byte buffer (pinned on CUDA) serves every slot: loads run one at a time under the lock, and each
        # finishes its cast (CPU) or waits for its copy (CUDA) before the next load reuses the buffer.
        self._staging: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # slot -> the compute that last read it (CUDA); its own lock: a release must not wait for a load in progress
        self._slot_busy_until: dict[int, torch.cuda.Event] = {}
        self._busy_lock = threading.Lock()
        self._widen_pool: ThreadPoolExecutor | None = None
        self.bytes_read = 0

    # -- buffers -------------------------------------------------------------------------------
    def _buffer(self, slot: int, name: str, like: torch.Tensor) -> torch.Tensor:
        key = (slot, name, tuple(like.shape), like.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return buf

    def _read_target(self, slot: int, name: str, like: torch.Tensor, source: torch.dtype
                     ) -> tuple[torch.Tensor, memoryview, torch.Tensor]:
        """The slot's buffer for `name`, a view of its last bytes (where the read of `source` values lands, so a
        widening can run front to back) and those values as a tensor of `like`'s shape, made once per slot: every
        torch call on the reader thread gives the GIL up and waits to get it back from the forward thread, leaving
        the disk idle meanwhile (docs/performance.md#reading-a-layer)."""
        key = (slot, name, tuple(like.shape), like.dtype, source)
        cached = self._read_targets.get(key)
        if cached is None:
            buf = self._buffer(slot, name, like)
            tail = buf.view(-1).view(torch.uint8)[-like.numel() * source.itemsize:]
            cached = self._read_targets[key] = (buf, memoryview(tail.numpy()), tail.view(source).view(like.shape))
        return cached

    def slot_in_use_until(self, slot: int, event: torch.cuda.Event) -> None:
        """The compute stream reads `slot` until `event`: the next asynchronous copy into it waits for that."""
        with self._busy_lock:
            self._slot_busy_until[slot] = event

    def forget_slot(self, slot: int) -> None:
        """Free a retired slot's buffers (nothing may be loading into it or computing from it)."""
        with self._lock:
            for cache in (self._read_targets, self._buffers):  # the targets' views hold the buffers too
                for key in [key for key in cache if key[0] == slot]:
                    del cache[key]

    def _staging_bytes(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the larger
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._staging

    def _widener(self) -> ThreadPoolExecutor:
        if self._widen_pool is None:
            self._widen_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchrun-widen")
        return self._widen_pool

    def _fd(self, path) -> int:
        key = str(path)
        fd = self._fds.get(key)
        if fd is None:
            fd = os.open(key, os.O_RDONLY)
            self._fds[key] = fd
        return fd

    # -- loading -------------------------------------------------------------------------------
    def load(self, index: int, slot: int, narrow: bool = False) -> LayerWeights:
        """Layer `index` into `slot`. `narrow`: leave the narrowable weights at the checkpoint's dtype (read as they
        lie, not widened), for a pass whose linears widen them as they multiply."""
        with self._lock:
            return self._load(index, slot, narrow)

    def _load(self, index: int, slot: int, narrow: bool) -> LayerWeights:
        prefix = self.layer_prefixes[index]
        metas = self.meta_params[index]
        direct, widened, staged, blocks = self._split(index)
        narrowable = self.narrowable[index] if narrow else frozenset()
        tensors: dict[str, torch.Tensor] = {}
        narrowed: dict[str, torch.Tensor] = {}
        quantized: dict[str, QuantizedWeight] = {}
        widenings: list[Future] = []
        try:
            read: list[TensorInfo] = []
            # CPU: read straight into the parameter's buffer, in the order the bytes lie in the shards. The kernel's
            # readahead follows a sequential reader, and reads in module order (q, k, v, o, gate, up, down) run far
            # slower (docs/performance.md#reading-a-layer). Checkpoints store a layer's tensors in whatever order
            # their writer chose.
            for recipe in sorted(direct + widened + blocks, key=_file_position):
                name = recipe.target[len(prefix):]
                info = recipe.sources[0]
                if recipe in blocks:  # a GGUF linear weight: its blocks are what the slot holds
                    quantized[name] = self._read_blocks(slot, name, recipe, metas[name])
                    read.append(info)
                    continue
                source = SAFETENSORS_DTYPES[info.dtype]
                buf, target, values = self._read_target(slot, name, metas[name], source)
                read_into(self._fd(info.file), target, info.offset, info.file)
                read.append(info)
                self.bytes_read += info.nbytes
                if recipe in widened and name in narrowable:
                    tensors[name], narrowed[name] = values, buf  # widened as it multiplies, or by widen_narrow
                    continue
                tensors[name] = buf
                if recipe in widened:
                    # Widened on its own thread while the next tensor is read: done in turn, a widening would leave
                    # the disk idle for much of a short pass (docs/performance.md#widening-tiles).
                    widenings.append(self._widener().submit(_widen_on_thread, buf, source))
            for path, start, end in contiguous_runs(read):
                self._advise_dropped(path, start, end - start)
            # Gaps between staged tensors are read along with them, unless what lies there was read already.
            ready = self._load_staged(staged, prefix, metas, slot, tensors, gaps=not blocks) if staged else None
            missing = sorted(set(metas) - set(tensors) - set(quantized))
            if missing:  # left on the meta device, a parameter would compute on uninitialised memory
                recipes = self.layer_recipes[index]
                where = recipes[0].sources[0].file.parent if recipes else "the checkpoint"
                raise CheckpointError(f"{where}: decoder layer {index} has no tensor in the checkpoint for "
                                      + ", ".join(prefix + name for name in missing))
        except BaseException:
            wait(widenings)  # a failed load gives its slot back: nothing may still be writing into it
            raise
        # Not waited for here: the last widenings of a layer end shortly after its last read, time in which the reader
        # would leave the disk idle before the next layer.
        return LayerWeights(index=index, slot=slot, tensors=tensors, ready=ready, widenings=widenings, narrow=narrowed,
                            quantized=quantized)

    def _read_blocks(self, slot: int, name: str, recipe: Recipe, meta: torch.Tensor) -> QuantizedWeight:
        """A GGUF tensor's blocks read as they lie into the slot's byte buffer for them."""
        info = recipe.sources[0]
        if tuple(recipe.decode.shape) != tuple(meta.shape):
            raise CheckpointError(f"{info.file}: {recipe.target} has shape {recipe.decode.shape} in the GGUF file, "
                                  f"but the model expects {tuple(meta.shape)}")
        # One buffer per slot and weight, grown to the largest of the layers' (a Q4_K_M file stores a weight in
        # other types in other layers); a layer's blocks are its first bytes.
        key = (slot, name, "blocks")
        cached = self._read_targets.get(key)
        if cached is None or cached[0].numel() < info.nbytes:
            self._read_targets.pop(key, None)
            self._buffers.pop((slot, f"{name}#blocks"), None)
            buf = self._buffers[(slot, f"{name}#blocks")] = torch.empty(info.nbytes, dtype=torch.uint8)
            cached = self._read_targets[key] = (buf, memoryview(buf.numpy()), buf)
        buf = cached[0][:info.nbytes]
        target = cached[1][:info.nbytes]
        read_into(self._fd(info.file), target, info.offset, info.file)
        self.bytes_read += info.nbytes
        return QuantizedWeight(buf, recipe.decode)

    def widen_narrow(self, weights: LayerWeights) -> None:
        """Widen a narrow load's weights in their slot after all (a pass that multiplies float32 weights reuses a
        layer read ahead for a decode pass); wait_widened then waits for them."""
        for name, buf in weights.narrow.items():
            source = weights.tensors[name].dtype
            weights.widenings.append(self._widener().submit(_widen_on_thread, buf, source))
            weights.tensors[name] = buf
        weights.narrow = {}

    def _split(self, index: int) -> tuple[list[Recipe], list[Recipe], list[Recipe], list[Recipe]]:
        """(read as is, read then widened in place, read into the staging buffer then converted or copied, GGUF
        linear weights held as their blocks)."""
        direct, widened, staged, blocks = [], [], [], []
        prefix = self.layer_prefixes[index]
        for recipe in self.layer_recipes[index]:
            name = recipe.target[len(prefix):]
            meta = self.meta_params[index].get(name)
            if (recipe.decode is not None and self.device.type == "cpu" and name in self.narrowable[index]
                    and len(recipe.decode.shape) == 2):
                blocks.append(recipe)
                continue
            source = SAFETENSORS_DTYPES.get(recipe.sources[0].dtype)
            in_place = (recipe.is_plain and meta is not None and source is not None and self.device.type == "cpu"
                        and tuple(meta.shape) == recipe.sources[0].shape)
            if in_place and source == meta.dtype:
                direct.append(recipe)
            elif in_place and can_widen(source, meta.dtype):
                widened.append(recipe)
            else:
                staged.append(recipe)
        return direct, widened, staged, blocks

    def _load_staged(self, recipes: list[Recipe], prefix: str, metas: dict, slot: int,
                     tensors: dict[str, torch.Tensor], gaps: bool = True):
        infos: list[TensorInfo] = [info for r in recipes for info in r.sources]
        by_file: dict[str, list[TensorInfo]] = {}
        for info in infos:
            by_file.setdefault(str(info.file), []).append(info)
        spans = [(path, span) for path, members in by_file.items()
                 for span in (coalesce(members) if gaps else coalesce(members, max_gap=0))]
        total = sum(end - start for _, (start, end, _) in spans)
        staging = self._staging_bytes(total)
        raw: dict[str, torch.Tensor] = {}
        cursor = 0
        for path, (start, end, members) in spans:
            length = end - start
            read_into(self._fd(path), memoryview(staging[cursor:cursor + length].numpy()), start, path)
            self._advise_dropped(path, start, length)
            self.bytes_read += length
            for info in members:
                begin = cursor + info.offset - start
                raw[info.name] = tensor_from_bytes(staging[begin:begin + info.nbytes], info)
            cursor += length
        stream_ctx = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else _null_context()
        with stream_ctx:
            with self._busy_lock:
                busy = self._slot_busy_until.pop(slot, None)
            if busy is not None:  # released by the forward thread while its kernels may still be reading
                self._copy_stream.wait_event(busy)
            for recipe in recipes:
                if recipe.decode is not None:  # a GGUF tensor, decoded chunk by chunk straight into its slot
                    name = recipe.target[len(prefix):]
                    tensors[name] = self._decode_into_slot(recipe, raw[recipe.sources[0].name],
                                                           self._buffer(slot, name, metas[name]))
                    continue
                produced = realize(recipe, [raw[i.name] for i in recipe.sources], self.model, self.config)
                for target, value in produced.items():
                    name = target[len(prefix):]
                    buf = self._buffer(slot, name, metas[name])
                    if tuple(value.shape) != tuple(buf.shape):  # never reshape: same size, other layout is wrong
                        raise CheckpointError(f"{recipe.sources[0].file}: {target} has shape {tuple(value.shape)} in "
                                              f"the checkpoint, but the model expects {tuple(buf.shape)}")
                    # copy_ casts to the compute dtype; on CUDA it overlaps with compute on the main stream
                    buf.copy_(value, non_blocking=self._copy_stream is not None)
                    tensors[name] = buf
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        # The staging slot is reused by the next load into this slot: wait here (worker thread) so the
        # main stream never waits on a copy that has not been issued.
        event.synchronize()
        return event

    @staticmethod
    def _decode_into_slot(recipe: Recipe, blocks: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        if tuple(recipe.decode.shape) != tuple(buf.shape):
            raise CheckpointError(f"{recipe.sources[0].file}: {recipe.target} has shape {recipe.decode.shape} in the "
                                  f"GGUF file, but the model expects {tuple(buf.shape)}")
        recipe.decode.into(blocks, buf)
        return buf

    def _advise_dropped(self, path, offset: int, length: int) -> None:
        if self.drop_page_cache:
            os.posix_fadvise(self._fd(path), offset, length, os.POSIX_FADV_DONTNEED)

    def buffer_bytes(self) -> int:
        staging = self._staging.numel() if self._staging is not None else 0
        return sum(b.numel() * b.element_size() for b in self._buffers.values()) + staging

    def close(self) -> None:
        if self._widen_pool is not None:
            self._widen_pool.shutdown(wait=True)
            self._widen_pool = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()
        self._read_targets.clear()  # their views hold the buffers too
        self._staging = None


# Below this many elements left, the widening finishes through a small temporary (its steps would only shrink).
WIDEN_TAIL_ELEMENTS = 1 << 16


def _file_position(recipe: Recipe) -> tuple[str, int]:
    return str(recipe.sources[0].file), recipe.sources[0].offset


def contiguous_runs(infos: list[TensorInfo]) -> list[tuple[object, int, int]]:
    """(file, start, end) of each run of back-to-back byte ranges: one page-cache advice per run, not per tensor
    (each call costs time, and a GIL round trip; docs/performance.md#reading-a-layer)."""
    runs: list[tuple[object, int, int]] = []
    for info in sorted(infos, key=lambda i: (str(i.file), i.offset)):
        end = info.offset + info.nbytes
        if runs and runs[-1][0] == info.file and runs[-1][2] == info.offset:
            runs[-1] = (info.file, runs[-1][1], end)
        else:
            runs.append((info.file, info.offset, end))
    return runs


def _widen_on_thread(buffer: torch.Tensor, source: torch.dtype) -> None:
    # Inference mode is per thread: a slot allocated by a load on the forward thread is an inference tensor, which
    # only inference mode may update in place.
    with torch.inference_mode():
        widen_in_place(buffer, source)


def can_widen(source: torch.dtype, target: torch.dtype) -> bool:
    """Floating types only, to a wider one of a whole multiple of the size (bf16/f16 -> f32)."""
    wider, narrower = target.itemsize, source.itemsize
    return (source.is_floating_point and target.is_floating_point and wider > narrower and wider % narrower == 0)


def widen_in_place(buffer: torch.Tensor, source: torch.dtype) -> None:
    """Cast the narrower values stored in the last bytes of `buffer` into the whole of it, front to back.

    Saves the separate read buffer a cast needs (a layer at its checkpoint dtype). Writing element j only
    overwrites source bytes of elements already read, as long as each step's output ends before the first
    unread source byte; every step is a plain copy between disjoint ranges.
    """
    flat = buffer.view(-1)
    count, wide, narrow = flat.numel(), flat.element_size(), source.itemsize
    start = count * (wide - narrow)  # byte offset of the source values
    values = flat.view(torch.uint8)[start:].view(source)
    done = 0
    while done < count:
        end = min(count, (start + narrow * done) // wide)
        if end - done < WIDEN_TAIL_ELEMENTS:
            flat[done:].copy_(values[done:].clone())
            return
        flat[done:end].copy_(values[done:end])
        done = end


class _null_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class SlotPool:
    """Buffer slots; at most `count` layers are materialised at any moment. The pool grows by new slots and shrinks
    by retiring free ones, whose buffers the caller then frees."""

    def __init__(self, count: int):
        self._cond = threading.Condition()
        self._free = collections.deque(range(count))
        self._next_slot = count
        self.count = count
        self.in_use = 0
        self.peak_in_use = 0

    def take(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            return self._free.popleft()

    def give(self, slot: int) -> None:
        with self._cond:
            self.in_use -= 1
            self._free.append(slot)
            self._cond.notify()

    def grow(self, count: int) -> None:
        with self._cond:
            while self.count < count:
                self._free.append(self._next_slot)
                self._next_slot += 1
                self.count += 1
            self._cond.notify_all()

    def retire_free(self, count: int) -> list[int]:
        """Take free slots out of the pool until it has `count`; returns them (fewer if not enough are free)."""
        retired = []
        with self._cond:
            while self.count > count and self._free:
                retired.append(self._free.pop())
                self.count -= 1
        return retired
