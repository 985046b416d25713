"""Prompt heads that only a group of a choice pass's sequences share, each computed once for its group: a pair row's
two orders read the same prompt up to the first answer (a question, a document to compare against), which every
other row of the pass lacks.

The pass's calls are the prefill's (prefill.PrefillCalls), one part after another: the sequences in no group with
the prefix they all share (if any), then each group as its own micro-batches behind its own prefix call. A group's
prefix lives for one pass and one layer at a time: its last micro-batch takes each layer's keys and values from it
(GroupPrefix.inject) and drops them once its layer is done (caches.PrefixSharedLayer with keeps_own off), so the
pass holds one layer of a group's head, not its whole stack.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import torch

from batchrun.plan import GROUP_PREFIX_MIN, shared_prefix_tokens
from batchrun.runtime.handle import ModelHandle
from batchrun.runtime.prefill import PrefillCalls, SharedPrefix, prefill


class GroupPrefix(SharedPrefix):
    """A prefix one group of a pass's sequences shares, for that pass only."""

    last_micro = -1  # the group's last micro-batch: once it has a layer's keys and values, the prefix lets them go

    def inject(self, layer: int, micro: int) -> None:
        super().inject(layer, micro)
        if micro == self.last_micro:
            source = self.cache.layers[layer]
            source.keys = source.values = None


def grouped_heads(seqs: Sequence[Sequence[int]], groups: Sequence[Sequence[int]], keep: int
                  ) -> list[tuple[list[int], int]]:
    """(members, head length) of each group whose own head is worth computing apart: at least GROUP_PREFIX_MIN
    tokens beyond what every sequence of the pass shares. The last `keep` positions of a sequence stay its own."""
    everyone = shared_prefix_tokens(seqs, own_tokens=keep)
    found = []
    for members in groups:
        head = shared_prefix_tokens([seqs[i] for i in members], own_tokens=keep) if len(members) > 1 else 0
        if head - everyone >= GROUP_PREFIX_MIN:
            found.append((list(members), head))
    return found


def prefill_grouped(handle: ModelHandle, seqs: Sequence[Sequence[int]], groups: Sequence[Sequence[int]], pad_id: int,
                    *, keep: int, micro_batch: int | None, picks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A choice pass's log-probs (prefill's, with `picks`: per sequence [keep, T]) where `groups` (lists of sequence
    indices) may each share a head of their own; a pass with no such head, or whose model cannot share, is
    prefill's."""
    model = handle.model
    columns = max((len(seq) for seq in seqs), default=0)
    heads = grouped_heads(seqs, groups, keep) if SharedPrefix.usable(model, columns) else []
    if not heads:
        return prefill(handle, seqs, pad_id, keep=keep, micro_batch=micro_batch, use_cache=False, picks=picks)[0]
    grouped = {i for members, _ in heads for i in members}
    parts = [([i for i in range(len(seqs)) if i not in grouped], None)] + [(members, head) for members, head in heads]
    built = [(members, _part(handle, [seqs[i] for i in members], head, pad_id, keep, micro_batch,
                             [picks[i] for i in members])) for members, head in parts if members]
    starts = [0]  # where each part's calls start among the pass's
    for _, part in built:
        starts.append(starts[-1] + len(part.calls))

    def before_layer(layer: int, micro: int) -> None:  # each part's hook counts its own calls from 0
        part = bisect.bisect_right(starts, micro) - 1
        hook = built[part][1].before_layer
        if hook is not None:
            hook(layer, micro - starts[part])

    calls = [call for _, part in built for call in part.calls]
    outputs = handle.run_pass(calls, before_layer=before_layer, rows=sum(part.rows for _, part in built))
    logprobs: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    for (members, part), start in zip(built, starts):
        for index, found in zip(members, part.collect(outputs[start:start + len(part.calls)])):
            logprobs[index] = found
    return logprobs


def _part(handle: ModelHandle, seqs: list, head: int | None, pad_id: int, keep: int, micro_batch: int | None,
          picks: list) -> PrefillCalls:
    """One part of a grouped pass: a group behind its head (`head` tokens), or the others behind what they share."""
    model, device = handle.model, handle.device
    if head is None:
        shared = shared_prefix_tokens(seqs, own_tokens=keep)
        prefix = SharedPrefix(model, list(seqs[0][:shared]), device) if shared else None
    else:
        prefix = GroupPrefix(model, list(seqs[0][:head]), device)
    part = PrefillCalls.build(handle, seqs, pad_id, keep=keep, micro_batch=micro_batch, use_cache=False,
                              prefix=prefix, picks=picks)
    if isinstance(prefix, GroupPrefix):
        prefix.last_micro = len(part.calls) - 1
    return part
