"""Forward passes over micro-batches, and a shared prompt prefix computed once per pass.

A pass carries B sequences split into micro-batches (one forward call each, taking turns at every
layer: see runtime/turns.py). When the sequences of a pass start with the same tokens (a system prompt,
instructions, a template head), the prefix is computed once, as an extra micro-batch of one
sequence that goes first at every layer; before each other micro-batch enters layer i, its cache
receives the prefix's keys and values for layer i by reference. The suffixes then attend to the prefix
as if they had computed it themselves: same positions, same keys, one computation and one copy of
the prefix's KV instead of B.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from batchrun.plan import prefill_groups, shared_prefix_tokens
from batchrun.runtime import prefix_attention
from batchrun.runtime.token_matrices import CALL_PICKS, PickedLogprobs


@dataclass
class MicroState:
    """One micro-batch between passes: its KV cache, attention mask and positions [b, ...]."""

    members: list[int]  # indices into the pass's sequences
    cache: object
    mask: torch.Tensor
    positions: torch.Tensor


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad so every sequence ends at the last position: input_ids, attention_mask, position_ids [B, S]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def cache_argument(model) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache`; accept either release."""
    return _cache_argument_of(type(model))


@functools.cache  # per model class: inspecting the signature on every forward call of every pass is wasted work
def _cache_argument_of(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def forward(model, ids, mask, positions, *, keep: int, cache=None, use_cache: bool = False,
            picks: torch.Tensor | None = None):
    """One forward call. Returns float32 log-probs of the last `keep` positions [b, keep, V] and the cache; with
    `picks` ([b, keep, T] token ids) only those tokens' log-probs [b, keep, T], so the call's vocabulary rows go
    with it instead of staying until the pass ends."""
    request = PickedLogprobs(picks) if picks is not None else None
    token = CALL_PICKS.set(request)  # a streamed head reads it (token_matrices.StreamedHead)
    try:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=use_cache,
                    logits_to_keep=keep, **{cache_argument(model): cache})
    finally:
        CALL_PICKS.reset(token)
    if request is not None and request.reduced:  # the head gave the picks' log-probs, chunk by chunk
        return out.logits, output_cache(out)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [b, keep, V]
    if picks is not None:
        logprobs = logprobs.gather(-1, picks.to(logprobs.device))  # [b, keep, T]
    return logprobs, output_cache(out)


def output_cache(out):
    """The cache a forward call returned. Outputs of 5.2x have `cache`; reading their deprecated `past_key_values`
    alias logs a warning."""
    return out.cache if hasattr(out, "cache") else getattr(out, "past_key_values", None)


class SharedPrefix:
    """The prefix's KV, computed by micro-batch 0 of the pass and shared with the others' caches."""

    def __init__(self, model, prefix: list[int], device):
        self.model, self.prefix, self.device = model, prefix, device
        self.cache = DynamicCache(config=model.config)
        self.targets: dict[int, object] = {}  # micro-batch -> its placeholder cache, in the pass computing the prefix
        self.computed = False  # the pass that computes the prefix is over: every layer's keys and values are here

    def pass_done(self) -> None:
        """The pass that ran the prefix's call, or one that attached it, is over."""
        self.computed, self.targets = True, {}

    @staticmethod
    def usable(model, columns: int) -> bool:
        """Whether a pass whose rows span at most `columns` cache positions ([prefix | padding | own tokens | tokens
        decoded later]) can share: always with full attention only. A sliding window counts positions in the cache,
        padding included, so it would see fewer of a row's tokens than the row alone does; but where every row fits
        inside the smallest window, no window cuts anything (transformers masks key k from query q when
        q - k >= window) and the windowed layers attend exactly like full ones."""
        probe = DynamicCache(config=model.config)
        windows = [layer.sliding_window for layer in probe.layers if getattr(layer, "is_sliding", False)]
        return not windows or columns <= min(windows)

    def prefix_call(self):
        ids = torch.tensor([self.prefix], dtype=torch.long, device=self.device)
        mask = torch.ones_like(ids)
        positions = torch.arange(len(self.prefix), device=self.device)[None]
        return lambda: forward(self.model, ids, mask, positions, keep=1, cache=self.cache, use_cache=True)

    def placeholder_cache(self, micro: int, batch: int, keeps_own: bool = True):
        """A cache that already counts `len(prefix)` tokens, so the model builds the suffix's masks and positions
        after them; its layers receive the prefix's keys and values by reference (see PrefixSharedLayer): layer by
        layer in the pass that computes the prefix (inject), all at once after it.
        `keeps_own=False` (a pass no decode follows): each layer's own keys and values go when the layer is done."""
        cache = DynamicCache(config=self.model.config)
        marks = prefix_attention.reads_prefix_in_place(self.model)
        cache.layers = [PrefixSharedLayer(len(self.prefix), marks_attention=marks, keeps_own=keeps_own)
                        for _ in range(len(cache.layers))]
        if self.computed:  # an earlier pass computed the prefix: every layer's keys and values are ready
            for target, source in zip(cache.layers, self.cache.layers):
                target.attach(source.keys, source.values)
        else:
            self.targets[micro] = cache
        return cache

    def inject(self, layer: int, micro: int) -> None:
        target = self.targets.get(micro)
        if target is None:
            return
        source = self.cache.layers[layer]
        target.layers[layer].attach(source.keys, source.values)


class RoomyLayer(DynamicLayer):
    """A full-attention layer's cache that decodes in place: the first decode step moves its keys and values into
    buffers with room for the tokens still to come (`spare`), and each step then writes one token into them.

    transformers' DynamicLayer concatenates, copying the whole cache of the layer at every step
    (docs/streaming.md#decoding-without-copying-the-cache). The layer's `keys`/`values` stay [b, H, S, D] views of
    the buffers, so everything else that reads or replaces them (batch selection, merging micro-batches) works as on
    a DynamicLayer; a replaced tensor gets new room on the next step."""

    spare = 0  # tokens the buffers keep room for beyond the next one (decode sets it)
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
        if not self.is_initialized or key_states.shape[-2] != 1 or self.keys.dim() != 4:
            return super().update(key_states, value_states)  # a prefill: one concatenation onto nothing
        length = self.keys.shape[-2]
        if not self._has_room(length + 1):
            room = tuple(_with_room(t, length + 1 + self.spare) for t in (self.keys, self.values))
            self.keys, self.values = room[0][:, :, :length], room[1][:, :, :length]  # frees the old ones
            self._room = room
        key_room, value_room = self._room
        key_room[:, :, length:length + 1] = key_states
        value_room[:, :, length:length + 1] = value_states
        self.keys, self.values = key_room[:, :, :length + 1], value_room[:, :, :length + 1]
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
    fits inside the model's smallest window (SharedPrefix.usable), so its windowed layers attend exactly as full ones
    and hold no more: they decode in place too, and the cache merges with others for decoding (merge_for_decode),
    where windowed layers would leave every admission of a refilled pass its own decode call."""
    cache = DynamicCache(config=model.config)
    full = (DynamicLayer, DynamicSlidingWindowLayer) if windows_as_full else (DynamicLayer,)
    cache.layers = [RoomyLayer() if type(layer) in full else layer for layer in cache.layers]
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            layer.__class__ = WindowLayer  # same state, one method more: no constructor arguments to keep in step
    return cache


def make_room(states: list[MicroState], tokens: int) -> None:
    """The caches of these micro-batches keep room for `tokens` more decode steps beyond the next one."""
    for state in states:
        for layer in getattr(state.cache, "layers", []):
            if isinstance(layer, RoomyLayer):
                layer.spare = max(0, tokens)


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
        return keys, values

    def get_seq_length(self) -> int:
        return self.prefix_length + super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


def prefill(handle, seqs: Sequence[Sequence[int]], pad_id: int, *, keep: int, micro_batch: int | None,
            use_cache: bool, share_prefix: bool = True, decode_tokens: int = 0,
            picks: Sequence[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[MicroState]]:
    """The first pass over `seqs`: log-probs of the last `keep` positions of each, and the micro-batch states.
    `decode_tokens`: at most how many tokens decode passes will append to these sequences (0 for choices).
    `picks`: per sequence, the token ids [keep, T] whose log-probs are all it needs (a choice's tokens).

    Returns per-sequence log-probs [keep, V], or [keep, T] with `picks` (in the order of `seqs`), and one
    MicroState per micro-batch.
    """
    model, device = handle.model, handle.device
    # A micro-batch spans the shared prefix plus its longest own part (the longest sequence at most), then grows by
    # a position per decode step; merging micro-batches for decoding pads to the longest of them, no further.
    columns = max((len(seq) for seq in seqs), default=0) + decode_tokens
    sharing = share_prefix and len(seqs) > 1 and SharedPrefix.usable(model, columns)
    shared = shared_prefix_tokens(seqs, sharing, own_tokens=keep)
    prefix = SharedPrefix(model, list(seqs[0][:shared]), device) if shared else None
    prefill_pass = PrefillCalls.build(handle, seqs, pad_id, keep=keep, micro_batch=micro_batch, use_cache=use_cache,
                                      prefix=prefix, picks=picks)
    outputs = handle.run_pass(prefill_pass.calls, before_layer=prefill_pass.before_layer, rows=prefill_pass.rows)
    return prefill_pass.collect(outputs), prefill_pass.states


@dataclass
class PrefillCalls:
    """The forward calls that prefill some sequences, ready to run as the first micro-batches of a pass (other calls
    may follow them in it: the decode steps of sequences prefilled earlier, score.GreedyPool)."""

    calls: list
    states: list[MicroState]
    rows: int  # positions each layer multiplies, padding included
    prefix: SharedPrefix | None
    computes_prefix: bool  # the first call computes the prefix
    count: int  # sequences

    @property
    def before_layer(self):
        """The hook that hands the prefix's keys and values over, where this pass computes the prefix."""
        return self.prefix.inject if self.computes_prefix else None

    @classmethod
    def build(cls, handle, seqs: Sequence[Sequence[int]], pad_id: int, *, keep: int, micro_batch: int | None,
              use_cache: bool, prefix: SharedPrefix | None = None, windows_as_full: bool = False,
              picks: Sequence[torch.Tensor] | None = None) -> PrefillCalls:
        """Calls for `seqs`, every one of which starts with `prefix` (None: no sharing). A prefix not computed yet is
        computed by the first call, before the others at every layer; one computed by an earlier pass is attached
        to the new caches as it is. `windows_as_full`: see roomy_cache. `picks`: see prefill."""
        model, device = handle.model, handle.device
        shared = len(prefix.prefix) if prefix is not None else 0
        groups = prefill_groups([len(seq) - shared for seq in seqs], micro_batch, device)
        computing = prefix is not None and not prefix.computed
        calls, states = ([prefix.prefix_call()] if computing else []), []
        rows = shared if computing else 0
        for members in groups:
            ids, mask, positions = left_pad([seqs[i][shared:] for i in members], pad_id, device)
            rows += ids.numel()
            cache = roomy_cache(model, windows_as_full) if use_cache and prefix is None else None
            if prefix is not None:
                cache = prefix.placeholder_cache(len(calls), len(members), keeps_own=use_cache)
                mask = torch.cat([torch.ones(len(members), shared, dtype=mask.dtype, device=device), mask], dim=1)
                positions = positions + shared
            states.append(MicroState(members, cache, mask, positions))
            picked = stacked_picks([picks[i] for i in members]) if picks is not None else None
            calls.append(_call(model, ids, mask, positions, keep, cache, use_cache or prefix is not None, picked))
        return cls(calls, states, rows, prefix, computing, len(seqs))

    def collect(self, outputs: list) -> list[torch.Tensor]:
        """Per-sequence log-probs [keep, V] from this pass's outputs (the first len(calls) of them), each state given
        its cache. A prefix computed by the pass is complete now: later passes attach it as it is."""
        outputs = outputs[1 if self.computes_prefix else 0:len(self.calls)]
        if self.prefix is not None:
            self.prefix.pass_done()
        logprobs: list[torch.Tensor] = [None] * self.count  # type: ignore[list-item]
        for state, (lp, cache) in zip(self.states, outputs):
            state.cache = cache
            for row, index in enumerate(state.members):
                logprobs[index] = lp[row]
        return logprobs


def decode(handle, states: list[MicroState], next_tokens: dict[int, int], tokens_after: int = 0
           ) -> dict[int, torch.Tensor]:
    """One decode pass: each micro-batch feeds its sequences' last tokens. Returns index -> log-probs [V].
    `tokens_after`: at most how many more decode passes follow, the room the caches keep for them."""
    calls = decode_calls(handle, states, next_tokens, tokens_after)
    return collect_decoded(states, handle.run_pass(calls, light=True))


def decode_calls(handle, states: list[MicroState], next_tokens: dict[int, int], tokens_after: int = 0) -> list:
    """The forward calls of one decode step of every micro-batch (see decode)."""
    make_room(states, tokens_after)
    calls = []
    for state in states:
        ones = torch.ones((len(state.members), 1), dtype=state.mask.dtype, device=handle.device)
        state.mask = torch.cat([state.mask, ones], dim=1)
        state.positions = state.positions[:, -1:] + 1
        ids = torch.tensor([[next_tokens[i]] for i in state.members], dtype=torch.long, device=handle.device)
        calls.append(_call(handle.model, ids, state.mask, state.positions, 1, state.cache, True))
    return calls


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


def stacked_picks(picks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[b, keep, T] from each sequence's [keep, T_i], padded with token 0 (read by nobody) to the widest."""
    width = max(p.shape[-1] for p in picks)
    return torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in picks])


def _call(model, ids, mask, positions, keep, cache, use_cache, picks=None):
    return lambda: forward(model, ids, mask, positions, keep=keep, cache=cache, use_cache=use_cache, picks=picks)
