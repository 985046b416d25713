"""Decoder layers read ahead of the one computing: a worker thread reads each into a buffer slot (loader.py) while
earlier layers compute, as many layers ahead as the pass in flight has slots for.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from batchrun.host import return_freed_memory
from batchrun.runtime.linear_kernels import sharing_tiles
from batchrun.runtime.loader import LayerLoader, LayerWeights, SlotPool


class ReadAhead:
    """Which layers a streamed model has asked for and not run yet (pending), which its modules hold (in use), how
    far ahead prefills and decode passes read, and whether the pass in flight leaves linear weights narrow.
    Without prefetch each layer is read when it runs, on the forward's thread, into the one slot."""

    def __init__(self, loader: LayerLoader, num_layers: int, *, prefetch: bool, depth: int,
                 decode_depth: int | None = None):
        self.loader, self.num_layers, self.device = loader, num_layers, loader.device
        self.prefetching = prefetch
        self.prefill_depth = max(1, depth) if prefetch else 0
        # Decode passes (begin_pass(light=True)) may read further ahead: the plan gives them the slot the prefill's
        # activations no longer need (plan.make_plan, decode_prefetch_depth).
        self.decode_depth = max(self.prefill_depth, decode_depth or 0) if prefetch else 0
        self.depth = self.prefill_depth  # the depth of the pass in flight
        self.narrow = False  # whether the pass in flight leaves linear weights narrow (a decode pass)
        self.slots = SlotPool(self.depth + 1)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchrun-prefetch") \
            if prefetch else None
        self.pending: dict[int, Future] = {}
        self.in_use: set[int] = set()  # layers whose modules hold their weights now

    def begin_pass(self, light: bool) -> None:
        """Before a pass: `light` (a decode pass) reads decode_depth layers ahead and leaves weights narrow."""
        self.narrow = light
        self._use_depth(self.decode_depth if light else self.prefill_depth)

    def _use_depth(self, depth: int) -> None:
        """Read `depth` layers ahead from now on. A pass starts at layer 0, and the previous one left layers 0..old
        depth read ahead; shrinking gives back those beyond the new depth (a wasted read each, once per switch) and
        frees the buffers of the slots that leaves unused, before this pass's activations need them."""
        if depth == self.depth or self._executor is None:
            return
        if depth < self.depth:
            self._give_back_pending(keep=range(depth + 1))
            for slot in self.slots.retire_free(depth + 1):
                self.loader.forget_slot(slot)
            return_freed_memory()
        else:
            self.slots.grow(depth + 1)
        self.depth = depth

    @contextlib.contextmanager
    def leaving_a_core(self, light: bool):
        """A decode pass computes on one thread fewer: with every core, the matmuls keep stalling on the one that the
        reader's page-cache copy and the widening are using (docs/streaming.md#what-bounds-a-pass). A prefill keeps
        every core: its compute outlasts the reads. The widening linears' tiles, most of a decode pass's compute,
        still go to every core, a tile per worker at a time (linear_kernels.sharing_tiles): a worker the reader
        delays holds up no other."""
        threads = torch.get_num_threads()
        if not (light and self.device.type == "cpu" and self._executor is not None and threads > 1):
            yield
            return
        torch.set_num_threads(threads - 1)
        try:
            with sharing_tiles(threads):
                yield
        finally:
            torch.set_num_threads(threads)

    def take(self, index: int) -> LayerWeights:
        """Layer `index`'s weights, ready to compute from: read ahead, or read now (giving back what was read ahead
        of an out-of-order request)."""
        future = self.pending.pop(index, None)
        if future is None and self._executor is not None:
            self._give_back_pending(keep=(index,))
            future = self._executor.submit(self._load, index, self.narrow)
        weights = future.result() if future is not None else self._load(index, self.narrow)
        try:
            if weights.narrow and not self.narrow:  # read ahead for a decode pass, needed by a prefill
                self.loader.widen_narrow(weights)
            weights.wait_widened()
        except BaseException:
            self.slots.give(weights.slot)  # a failed widening fails this pass, not the slot pool
            raise
        if weights.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(weights.ready)
        self.in_use.add(index)
        return weights

    def ask_ahead_of(self, index: int) -> None:
        """Layer `index` is starting: the `depth` layers after it are asked for, those not asked for already."""
        if self._executor is not None:
            for ahead in range(1, self.depth + 1):
                self._schedule((index + ahead) % self.num_layers)

    def ask_after(self, index: int) -> None:
        """Layer `index` gave its slot back: the slot takes the next layer not yet asked for now, not when the next
        layer starts, so the reader never waits for the forward thread while a slot is free."""
        if self._executor is not None:
            self._schedule((index + self.depth + 1) % self.num_layers)

    def give(self, weights: LayerWeights) -> None:
        """A layer's weights are off its module: its slot goes back to the pool."""
        self.in_use.discard(weights.index)
        if self.device.type == "cuda":  # the layer's kernels may still be queued: the next copy into its slot waits
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.loader.slot_in_use_until(weights.slot, done)
        self.slots.give(weights.slot)

    def _schedule(self, index: int) -> None:
        if index in self.pending or index in self.in_use:
            return
        self.pending[index] = self._executor.submit(self._load, index, self.narrow)

    def _load(self, index: int, narrow: bool) -> LayerWeights:
        slot = self.slots.take()
        try:
            return self.loader.load(index, slot, narrow)
        except BaseException:
            self.slots.give(slot)
            raise

    def _give_back_pending(self, keep) -> None:
        """Give back the slots of layers read ahead that nobody will run next (an out-of-order request, a shallower
        read-ahead): all pending but those in `keep`."""
        for index, future in list(self.pending.items()):
            if index not in keep:
                del self.pending[index]
                weights = future.result()
                try:
                    weights.wait_widened()  # nothing may still write into a slot given back
                finally:
                    self.slots.give(weights.slot)

    def stop(self) -> None:
        """No more reads: those asked for are cancelled, the worker thread ends."""
        if self._executor is not None:
            for future in self.pending.values():
                future.cancel()
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
