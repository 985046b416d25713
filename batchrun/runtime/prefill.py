"""Forward calls over micro-batches, the prefill pass, and a shared prompt prefix computed once per pass.

A pass carries B sequences split into micro-batches (one forward call each, taking turns at every
layer: see runtime/turns.py). When the sequences of a pass start with the same tokens (a system prompt,
instructions, a template head), the prefix is computed once, as an extra micro-batch of one
sequence that goes first at every layer; before each other micro-batch enters layer i, its cache
receives the prefix's keys and values for layer i by reference. The suffixes then attend to the prefix
as if they had computed it themselves: same positions, same keys, one computation and one copy of
the prefix's KV instead of B. The caches they fill are caches.py's; the passes after the prefill, decode.py's.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache

from batchrun.plan import prefill_groups, shared_prefix_tokens
from batchrun.runtime import prefix_attention
from batchrun.runtime.caches import PrefixSharedLayer, roomy_cache
from batchrun.runtime.handle import ModelHandle
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


def prefill(handle: ModelHandle, seqs: Sequence[Sequence[int]], pad_id: int, *, keep: int, micro_batch: int | None,
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
    def build(cls, handle: ModelHandle, seqs: Sequence[Sequence[int]], pad_id: int, *, keep: int,
              micro_batch: int | None, use_cache: bool, prefix: SharedPrefix | None = None,
              windows_as_full: bool = False, picks: Sequence[torch.Tensor] | None = None) -> PrefillCalls:
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
            caching = use_cache or prefix is not None
            calls.append(forward_call(model, ids, mask, positions, keep, cache, caching, picked))
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


def stacked_picks(picks: Sequence[torch.Tensor]) -> torch.Tensor:
    """[b, keep, T] from each sequence's [keep, T_i], padded with token 0 (read by nobody) to the widest."""
    width = max(p.shape[-1] for p in picks)
    return torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in picks])


def forward_call(model, ids, mask, positions, keep, cache, use_cache, picks=None):
    """`forward` with these arguments, as a call a pass runs."""
    return lambda: forward(model, ids, mask, positions, keep=keep, cache=cache, use_cache=use_cache, picks=picks)
