"""The KV caches a pass's micro-batches keep between passes: full-attention layers that decode in place
(RoomyLayer), sliding-window layers that hold no more than their window (WindowLayer), and layers that hold a
shared prefix's keys and values once for the whole pass (PrefixSharedLayer, filled by prefill.SharedPrefix).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from batchrun.runtime import prefix_attention


class RoomyLayer(DynamicLayer):
    """A full-attention layer's cache that decodes in place: the first decode step moves its keys and values into
    buffers with room for the tokens still to come (`spare`), and each step then writes its tokens into them.

    transformers' DynamicLayer concatenates, copying the whole cache of the layer at every step
    (docs/streaming.md#decoding-without-copying-the-cache). The layer's `keys`/`values` stay [b, H, S, D] views of
    the buffers, so everything else that reads or replaces them (batch selection, merging micro-batches) works as on
    a DynamicLayer; a replaced tensor gets new room on the next step."""

    spare = 0  # tokens the buffers keep room for beyond the next one (decode.make_room sets it)
    _room: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values) buffers [b, H, room, D]

    def __setattr__(self, name, value):
        # Keys or values replaced from outside (rows dropped, micro-batches merged): the buffers they replaced go at
        # once, so a layer never holds its old buffers beside the new tensors.
        if name in ("keys", "values") and self._room is not None:
            room = self._room[0 if name == "keys" else 1]
            if value is None or value.data_ptr() != room.data_ptr():
                object.__setattr__(self, "_room", None)
        object.__setattr__(self, name, value)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.keys.dim() != 4:
            return super().update(key_states, value_states)  # a prefill: one concatenation onto nothing
        length, new = self.keys.shape[-2], key_states.shape[-2]  # new: 1, or the tokens a grammar forced
        if not self._has_room(length + new):
            room = tuple(_with_room(t, length + new + self.spare) for t in (self.keys, self.values))
            self.keys, self.values = room[0][:, :, :length], room[1][:, :, :length]  # frees the old ones
            self._room = room
        key_room, value_room = self._room
        key_room[:, :, length:length + new] = key_states
        value_room[:, :, length:length + new] = value_states
        self.keys, self.values = key_room[:, :, :length + new], value_room[:, :, :length + new]
        return self.keys, self.values

    def _has_room(self, needed: int) -> bool:
        return (self._room is not None and self._room[0].shape[-2] >= needed
                and self._room[0].shape[:2] == self.keys.shape[:2])


def _with_room(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """[b, H, S, D] -> a [b, H, tokens, D] buffer whose first S positions hold `tensor`."""
    room = tensor.new_empty(*tensor.shape[:2], tokens, tensor.shape[-1])
    room[:, :, :tensor.shape[-2]] = tensor
    return room


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer that holds only its window after a prefill. transformers keeps the window as a view of
    the whole prompt's keys and values, which stay alive until the first decode step; the plan counts the window."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        result = super().update(key_states, value_states, *args, **kwargs)
        if key_states.shape[-2] > 1 and self.keys.untyped_storage().nbytes() > self.keys.nbytes:
            self.keys, self.values = self.keys.clone(), self.values.clone()  # a prefill's tail: free the prompt
        return result


def roomy_cache(model, windows_as_full: bool = False):
    """A DynamicCache whose full-attention layers decode in place (RoomyLayer) and whose sliding-window layers keep
    no more than their window (WindowLayer). `windows_as_full`: every sequence the cache will hold, padding included,
    fits inside the model's smallest window (prefill.SharedPrefix.usable), so its windowed layers attend exactly as
    full ones and hold no more: they decode in place too, and the cache merges with others for decoding
    (decode.merge_for_decode), where windowed layers would leave every admission of a refilled pass its own decode
    call."""
    cache = DynamicCache(config=model.config)
    full = (DynamicLayer, DynamicSlidingWindowLayer) if windows_as_full else (DynamicLayer,)
    cache.layers = [RoomyLayer() if type(layer) in full else layer for layer in cache.layers]
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            layer.__class__ = WindowLayer  # same state, one method more: no constructor arguments to keep in step
    return cache


class PrefixSharedLayer(RoomyLayer):
    """One layer's cache for a micro-batch whose sequences share a prefix: the prefix's keys and values [1, H, P, D]
    are held once for the whole pass, each sequence keeps only its own tokens [b, H, S, D]. A prefill's attention gets
    their concatenation, a temporary of one layer and one micro-batch, so B sequences cost B suffixes, not B prompts;
    a decode step attends to the two in place where transformers' sdpa runs it (prefix_attention), which also runs a
    prefill's attention on a CPU without copying the keys and values per query head."""

    def __init__(self, prefix_length: int, marks_attention: bool = False, keeps_own: bool = True):
        super().__init__()
        self.prefix_length = prefix_length
        self.marks_attention = marks_attention  # the model attends through transformers' sdpa (prefix_attention)
        # A pass no decode follows (choice scoring) needs a layer's keys and values only inside that layer: holding
        # them for the whole stack would cost every sequence its full KV cache for nothing.
        self.keeps_own = keeps_own
        self.prefix_keys: torch.Tensor | None = None
        self.prefix_values: torch.Tensor | None = None

    def attach(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape[0] != 1 or keys.shape[-2] != self.prefix_length:
            raise RuntimeError(f"shared prefix: expected keys of 1 sequence x {self.prefix_length} tokens, got "
                               f"{tuple(keys.shape)}; run without prefix sharing")
        self.prefix_keys, self.prefix_values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.prefix_keys is None:
            raise RuntimeError("shared prefix: a layer ran before the prefix's keys and values reached it")
        if self.keeps_own:
            own_keys, own_values = super().update(key_states, value_states)  # [b, H, S, D]
        else:
            own_keys, own_values = key_states, value_states
        if self.marks_attention and key_states.shape[-2] == 1:
            prefix_attention.mark_next_call(self.prefix_keys, self.prefix_values, own_keys)
            return own_keys, own_values
        keys, values = prefix_attention.concatenate(self.prefix_keys, self.prefix_values, own_keys, own_values)
        if self.marks_attention:  # a prefill: attends to the concatenation without copying it per query head
            prefix_attention.mark_next_call(self.prefix_keys, self.prefix_values, keys)
        if not self.keeps_own:  # the layer's only step in the pass: a prefix held for this pass alone can go with it
            self.prefix_keys = self.prefix_values = None
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix_length + super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0
