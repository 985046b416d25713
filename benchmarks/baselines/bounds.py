"""Lower bounds for the throughput benchmark: how few passes a job needs, and how fast a strategy could run
given the measured disk bandwidth and compute rate.

A strategy runs the rows in batches (in row order) of `batch_size` sequences; each batch's first pass prefills its
prompts (the shared prefix once when the strategy shares it), each later pass decodes one token for the sequences
still generating. A streamed pass reads every decoder layer once; a resident one reads nothing.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# batchrun shares a prefix only from this many tokens (batchrun/runtime/prefill.py MIN_SHARED_PREFIX).
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class ModelShape:
    decoder_params: int
    decoder_bytes: int
    checkpoint_bytes: int
    vocab_size: int
    hidden_size: int
    attention_width: int  # query heads x head dim
    num_layers: int  # decoder layers: each one attends

    @classmethod
    def of(cls, checkpoint: Path) -> "ModelShape":
        from batchrun.checkpoint.sizes import checkpoint_sizes

        sizes = checkpoint_sizes(checkpoint)
        return cls(sizes.decoder_params, sizes.decoder_bytes, sizes.checkpoint_bytes, sizes.vocab_size,
                   sizes.hidden_size, sizes.num_attention_heads * sizes.head_dim, sizes.num_layers)

    def attention_flops(self, first: int, last: int) -> int:
        """Scores and weighted sum for the tokens at positions first..last-1, each attending to itself and every
        earlier position: 4 x width x (p + 1) per token in every decoder layer."""
        per_layer = 4 * self.attention_width * (last * (last + 1) - first * (first + 1)) // 2
        return self.num_layers * per_layer

    def token_flops(self, tokens: int) -> int:
        return 2 * self.decoder_params * tokens  # a multiply and an add per weight per token

    def head_flops(self, positions: int) -> int:
        return 2 * self.vocab_size * self.hidden_size * positions


@dataclass(frozen=True)
class Strategy:
    batch_size: int
    share_prefix: bool
    streamed: bool
    extra_pass_bytes: int = 0  # read each pass beside the decoder layers (a streamed LM head)


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    length = min(len(s) for s in seqs)
    for position in range(length):
        if any(s[position] != seqs[0][position] for s in seqs):
            return position
    return length


def batch_pass_flops(shape: ModelShape, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int],
                     share_prefix: bool) -> list[int]:
    """FLOPs of every pass of one batch: the prefill, then one decode pass per further new token."""
    lengths = [len(p) for p in prompts]
    shared = 0
    if share_prefix and len(prompts) > 1:
        shared = min(common_prefix(prompts), min(lengths) - 1)
        shared = shared if shared >= MIN_SHARED_PREFIX else 0
    prefill = shape.token_flops(shared) + shape.attention_flops(0, shared)
    prefill += sum(shape.token_flops(n - shared) + shape.attention_flops(shared, n) for n in lengths)
    passes = [prefill + shape.head_flops(len(prompts))]
    for step in range(2, max(new_tokens) + 1):  # the token fed at step k sits at position n + k - 2
        live = [n for n, t in zip(lengths, new_tokens) if t >= step]
        passes.append(sum(shape.token_flops(1) + shape.attention_flops(n + step - 2, n + step - 1) for n in live)
                      + shape.head_flops(len(live)))
    return passes


@dataclass
class Bound:
    passes: int
    bytes: int  # weight bytes the strategy's passes must read
    flops: int
    io_seconds: float
    compute_seconds: float
    seconds: float  # max(io, compute): the bound the table reports
    pass_sum_seconds: float  # sum over passes of max(pass io, pass compute): tighter, passes do not overlap
    pass_seconds: list[float]  # per pass: max(pass io, pass compute), in run order

    @property
    def median_pass_seconds(self) -> float:
        return statistics.median(self.pass_seconds)


def strategy_bound(shape: ModelShape, prompts: Sequence[Sequence[int]], new_tokens: Sequence[int],
                   strategy: Strategy, bandwidth: float, compute_rate: float) -> Bound:
    """The bound of running these rows the strategy's way; new_tokens per row (1 for a choice row)."""
    flops: list[int] = []
    for start in range(0, len(prompts), strategy.batch_size):
        end = start + strategy.batch_size
        flops += batch_pass_flops(shape, prompts[start:end], new_tokens[start:end], strategy.share_prefix)
    pass_bytes = shape.decoder_bytes + strategy.extra_pass_bytes if strategy.streamed else 0
    pass_seconds = [max(pass_bytes / bandwidth, f / compute_rate) for f in flops]
    total_bytes = pass_bytes * len(flops)
    io, compute = total_bytes / bandwidth, sum(flops) / compute_rate
    return Bound(len(flops), total_bytes, sum(flops), io, compute, max(io, compute), sum(pass_seconds), pass_seconds)


def lower_bound_passes(new_tokens: Sequence[int], capacity: int) -> int:
    """max(max_i T_i, ceil(sum_i T_i / B)): no pass carries more than B sequences, and a row needing T tokens
    needs T passes."""
    return max(max(new_tokens), math.ceil(sum(new_tokens) / capacity))
