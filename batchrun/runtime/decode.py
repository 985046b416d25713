"""Decode passes: each micro-batch feeds its sequences' last tokens, merged into fewer micro-batches than the
prefill's where their caches allow, and shrunk as sequences finish.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from batchrun.runtime.caches import PrefixSharedLayer, RoomyLayer
from batchrun.runtime.handle import ModelHandle
from batchrun.runtime.prefill import MicroState, forward_call


def decode(handle: ModelHandle, states: list[MicroState], next_tokens: dict[int, int | list[int]],
           tokens_after: int = 0) -> dict[int, torch.Tensor]:
    """One decode pass: each micro-batch feeds its sequences' next token (or tokens). Returns index -> log-probs [V]
    after each sequence's last token.
    `tokens_after`: at most how many more decode passes follow, the room the caches keep for them."""
    calls = decode_calls(handle, states, next_tokens, tokens_after)
    return collect_decoded(states, handle.run_pass(calls, light=True))


def decode_calls(handle: ModelHandle, states: list[MicroState], next_tokens: dict[int, int | list[int]],
                 tokens_after: int = 0) -> list:
    """The forward calls of one decode step of every micro-batch (see decode). A sequence may feed several tokens
    (those a grammar forced): a micro-batch's call is as wide as its longest feed, each sequence's tokens
    right-aligned behind padding its mask hides, so every sequence's last token is at the last position; the hidden
    columns stay in the cache, never attended, like a merged micro-batch's padding."""
    make_room(states, tokens_after)
    calls = []
    for state in states:
        feeds = [[next_tokens[i]] if isinstance(next_tokens[i], int) else next_tokens[i] for i in state.members]
        width = max(len(feed) for feed in feeds)
        ids = torch.full((len(feeds), width), 0, dtype=torch.long)
        own = torch.zeros((len(feeds), width), dtype=state.mask.dtype)
        for row, feed in enumerate(feeds):
            ids[row, width - len(feed):] = torch.tensor(feed, dtype=torch.long)
            own[row, width - len(feed):] = 1
        state.mask = torch.cat([state.mask, own.to(handle.device)], dim=1)
        # [b, width]: a sequence's tokens continue its positions; its hidden columns take the first one's
        state.positions = state.positions[:, -1:] + own.cumsum(dim=1).clamp(min=1).to(handle.device)
        calls.append(forward_call(handle.model, ids.to(handle.device), state.mask, state.positions, 1, state.cache,
                                  True))
    return calls


def sliding_windows(model) -> list[int]:
    """The model's sliding-window sizes (none for full attention everywhere)."""
    probe = DynamicCache(config=model.config)
    return [layer.sliding_window for layer in probe.layers if getattr(layer, "is_sliding", False)]


def make_room(states: list[MicroState], tokens: int) -> None:
    """The caches of these micro-batches keep room for `tokens` more decode steps beyond the next one."""
    for state in states:
        for layer in getattr(state.cache, "layers", []):
            if isinstance(layer, RoomyLayer):
                layer.spare = max(0, tokens)


def collect_decoded(states: list[MicroState], outputs: list) -> dict[int, torch.Tensor]:
    """index -> log-probs [V] of one decode step, from the outputs of decode_calls (in order)."""
    result = {}
    for state, (lp, cache) in zip(states, outputs):
        state.cache = cache
        for row, index in enumerate(state.members):
            result[index] = lp[row, -1]
    return result


def merge_for_decode(states: list[MicroState], group_size: int | None) -> list[MicroState]:
    """Regroup the prefill's micro-batches into fewer, larger ones for decoding.

    A decode micro-batch feeds one token per sequence: its activations are tiny, but each forward call streams the
    layer's weights from RAM once, so on a CPU ten micro-batches make a decode pass ten times the memory traffic.
    Consecutive micro-batches are merged up to `group_size` sequences (None: all): their own keys and values are
    left-padded to a common length and stacked, their attention masks padded with zeros at the same columns, so the
    padding is never attended. Caches of other kinds (sliding windows) are left as they are.
    """
    if len(states) < 2 or not all(_mergeable(state.cache) for state in states):
        return states
    limit = group_size or sum(len(state.members) for state in states)
    groups: list[list[MicroState]] = []
    for state in states:
        if groups and sum(len(s.members) for s in groups[-1]) + len(state.members) <= limit:
            groups[-1].append(state)
        else:
            groups.append([state])
    return [_merge(group) if len(group) > 1 else group[0] for group in groups]


def _mergeable(cache) -> bool:
    return cache is not None and all(type(layer) in (DynamicLayer, RoomyLayer, PrefixSharedLayer)
                                     and layer.is_initialized
                                     for layer in cache.layers)


def _merge(group: list[MicroState]) -> MicroState:
    width = max(state.mask.shape[1] for state in group)
    pads = [width - state.mask.shape[1] for state in group]
    merged = group[0].cache
    for index, layer in enumerate(merged.layers):
        parts = [state.cache.layers[index] for state in group]
        # [b, H, S, D] each -> [sum b, H, S_max, D], padding on the left like the masks
        layer.keys = torch.cat([torch.nn.functional.pad(p.keys, (0, 0, pad, 0)) for p, pad in zip(parts, pads)])
        layer.values = torch.cat([torch.nn.functional.pad(p.values, (0, 0, pad, 0)) for p, pad in zip(parts, pads)])
        for part in parts[1:]:  # free as we go: one layer's worth of extra memory at a time
            part.keys = part.values = None
    # The mask's columns are [shared prefix | own tokens]: the padding goes where the keys got it, before own tokens.
    shared = getattr(merged.layers[0], "prefix_length", 0)
    mask = torch.cat([torch.cat([state.mask[:, :shared], state.mask.new_zeros(len(state.members), pad),
                                 state.mask[:, shared:]], dim=1) for state, pad in zip(group, pads)])
    positions = torch.cat([state.positions[:, -1:] for state in group])
    return MicroState([i for state in group for i in state.members], merged, mask, positions)


def drop_finished(states: list[MicroState], finished: set[int]) -> list[MicroState]:
    """Finished sequences leave the pass: shrink each micro-batch's cache, mask and positions, and cut the padding
    that only the rows which left needed."""
    kept_states = []
    for state in states:
        keep = [row for row, index in enumerate(state.members) if index not in finished]
        if not keep:
            continue
        if len(keep) < len(state.members):
            rows = torch.tensor(keep, dtype=torch.long, device=state.mask.device)
            state.cache.batch_select_indices(rows)
            state.mask, state.positions = state.mask[rows], state.positions[rows]
            state.members = [state.members[row] for row in keep]
            _cut_leading_padding(state)
        kept_states.append(state)
    return kept_states


def _cut_leading_padding(state: MicroState) -> None:
    """Drop the own-token columns no remaining row attends. A merged micro-batch is left-padded to its longest row
    (_merge); once that row leaves, its width would otherwise stay, and grow by one column a pass for as long as
    rows keep being admitted beside live ones: more KV cache than the plan sized, and, where a shared prefix sits in
    front of sliding-window layers (SharedPrefix.usable), real tokens pushed out of the window. Only caches whose
    every layer holds one column per own mask column are cut (full-attention layers: _mergeable)."""
    if not _mergeable(state.cache):
        return
    shared = getattr(state.cache.layers[0], "prefix_length", 0)
    own = state.mask[:, shared:]  # [b, own columns]
    attended = own.any(dim=0).nonzero()
    cut = int(attended[0]) if len(attended) else 0
    if cut == 0 or any(layer.keys.shape[-2] != own.shape[1] for layer in state.cache.layers):
        return
    for layer in state.cache.layers:  # [b, H, S, D] -> [b, H, S - cut, D]
        layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
    state.mask = torch.cat([state.mask[:, :shared], own[:, cut:]], dim=1)
