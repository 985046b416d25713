"""Decoding against a shared prefix without copying it: attention over [prefix | own tokens] in two parts.

A decode step of a micro-batch whose sequences share a prompt prefix (caches.PrefixSharedLayer) would
otherwise concatenate the prefix's keys and values [1, H, P, D], expanded to every sequence, with each
sequence's own [b, H, S, D] at every layer of every pass: b copies of the prefix written and read again
per layer (docs/streaming.md#decoding-without-copying-the-cache). Here the scores against the prefix come
from one batched matmul that reads the prefix once, the scores against the own tokens from another; the
softmax runs over both together, as attention over the concatenation would. A prefill of such a
micro-batch attends to the concatenation; on a CPU this runs it through torch's SDPA in grouped-query mode,
where transformers' sdpa (given a mask) would first copy the keys and values once per query head.

transformers owns the attention: this wraps its registered "sdpa" function and takes over only a call the
cache layer has marked (on the calling thread) just before it; every other call goes to transformers' own
function untouched, so models outside a batchrun pass are unaffected.
"""
from __future__ import annotations

import functools
import threading

import torch

from batchrun.plan import ATTENTION_CHUNK_BYTES

_pending = threading.local()  # (prefix keys, prefix values, own keys) of the attention call about to run here


def reads_prefix_in_place(model) -> bool:
    """Only models attending through transformers' sdpa function: the wrapper is what reads the mark."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    return getattr(config, "_attn_implementation", None) == "sdpa"


def attends_through_sdpa(config) -> bool:
    """What `reads_prefix_in_place` will answer for the model this config builds, asked of its class before any model
    exists (the plan sizes decode steps by it): transformers gives a model sdpa unless the config asks for another
    attention or the class cannot run it (23 classes in transformers 5.24 cannot). Remote code and unknown classes
    answer False, the safe side for memory."""
    requested = getattr(getattr(config, "get_text_config", lambda: config)(), "_attn_implementation_internal", None)
    if requested is not None:
        return requested == "sdpa"
    if getattr(config, "auto_map", None):
        return False
    from transformers import AutoModelForCausalLM

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):
        return False
    return bool(getattr(model_class, "_supports_sdpa", False))


def sdpa_groups_one_token_queries() -> bool:
    """Whether transformers' sdpa attends a one-token query on the key heads (its pack_gqa, since 5.24) instead of
    copying every layer's keys and values once per query head under a padding mask, as 5.0-5.23 do."""
    from transformers.integrations import sdpa_attention

    return callable(getattr(sdpa_attention, "pack_gqa", None))


def mark_next_call(prefix_keys: torch.Tensor, prefix_values: torch.Tensor, own_keys: torch.Tensor) -> None:
    """The next attention call on this thread gets `own_keys`, the own tokens' keys only: attend to this prefix
    first. Attending without the prefix would be silently wrong, so a model whose attention does not come through
    here with those very keys fails the pass instead (PrefixAttentionError)."""
    install()
    if getattr(_pending, "prefix", None) is not None:
        _pending.prefix = None
        raise PrefixAttentionError("the previous decode step's attention never reached transformers' sdpa function")
    _pending.prefix = (prefix_keys, prefix_values, own_keys)


class PrefixAttentionError(RuntimeError):
    """A model's decode step did not attend the way prefix sharing needs (an architecture batchrun has not met)."""


@functools.cache  # once per process
def install() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    @functools.wraps(original)
    def sdpa_with_shared_prefix(module, query, key, value, attention_mask, *args, **kwargs):
        prefix = getattr(_pending, "prefix", None)
        _pending.prefix = None
        if prefix is None:
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if prefix[2] is not key:
            raise PrefixAttentionError("a marked attention call (decode step or prefill) got other keys than its cache "
                                       "returned")
        prefix_keys, prefix_values, _ = prefix
        attended = key.shape[-2] + (prefix_keys.shape[-2] if query.shape[2] == 1 else 0)
        plain = _plain_call(args, kwargs, attended)
        if query.shape[2] > 1:  # a prefill: its cache handed over [prefix | own] already
            if plain and attention_mask is not None and query.device.type == "cpu":
                return attend_grouped(query, key, value, attention_mask, kwargs.get("scaling")), None
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        if not plain:
            # Anything beyond plain scaled attention (biases, soft caps, sinks): concatenate and let sdpa do it.
            key, value = concatenate(prefix_keys, prefix_values, key, value)
            return original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        return attend_with_prefix(query, key, value, prefix_keys, prefix_values, attention_mask,
                                  scaling if scaling is not None else query.shape[-1] ** -0.5), None

    ALL_ATTENTION_FUNCTIONS.register("sdpa", sdpa_with_shared_prefix)


def concatenate(prefix_keys, prefix_values, own_keys, own_values) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, P, D] prefix and [b, H, S, D] own -> [b, H, P + S, D] keys and values, the prefix copied per sequence."""
    batch = own_keys.shape[0]
    return (torch.cat([prefix_keys.expand(batch, -1, -1, -1), own_keys], dim=-2),
            torch.cat([prefix_values.expand(batch, -1, -1, -1), own_values], dim=-2))


def _plain_call(args: tuple, kwargs: dict, attended: int) -> bool:
    """Plain scaled attention over `attended` key positions: no extra term changes the scores. A sliding window
    (Gemma passes its layer's) changes nothing where every key lies inside it: prefixes are shared only then."""
    extras = {k for k, v in kwargs.items() if v is not None and k not in _PLAIN_KWARGS}
    if "sliding_window" in extras and kwargs["sliding_window"] >= attended:
        extras.discard("sliding_window")
    return not args and not extras and not kwargs.get("dropout")


# Keyword arguments of a plain attention call; any other non-None one (position_bias, softcap, s_aux, sinks...)
# changes the scores, and the call takes the concatenating path.
_PLAIN_KWARGS = frozenset({"dropout", "scaling", "is_causal", "position_ids", "output_attentions",
                           "cache_position", "use_cache", "past_key_values", "cache", "layer_idx"})


def attend_grouped(query, keys, values, mask, scaling: float | None):
    """A prefill's attention over [prefix | own tokens] on a CPU, each key head paired with its group of query heads
    without copying it per query head (transformers, given a mask, would first copy the keys and values once per
    query head; docs/streaming.md#shared-prefix). float32 runs torch's SDPA in grouped-query mode; half
    precision attend_in_chunks, faster there. Shapes: query [b, Hq, S, D]; keys, values [b, H, P + S, D];
    mask [b, 1, S, P + S]. Returns [b, S, Hq, D]."""
    if query.dtype in (torch.bfloat16, torch.float16) and (mask is None or mask.shape[1] == 1):  # every head one mask
        return attend_in_chunks(query, keys, values, mask, query.shape[-1] ** -0.5 if scaling is None else scaling)
    output = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                              enable_gqa=query.shape[1] != keys.shape[1])
    return output.transpose(1, 2).contiguous()


def attend_in_chunks(query, keys, values, mask, scaling: float):
    """attend_grouped for half precision, as transformers' eager attention computes it (scores in the input dtype,
    softmax in float32), one sequence and a chunk of its query rows at a time, so the scores stay small: faster than
    torch's flash kernel for a CPU in half precision (docs/streaming.md#shared-prefix).
    A chunk skips the keys after its last row where the mask hides them all (a causal mask does). Masked scores get
    float32's lowest value, not -inf: a row with nothing to attend averages instead of dividing by zero (its output
    is never used, but NaN would reach every row through the next layer's values). Shapes as attend_grouped."""
    batch, query_heads, length, dim = query.shape
    heads, attended = keys.shape[1], keys.shape[2]
    group, before_own = query_heads // heads, attended - length  # own query row r sits at key position before_own + r
    # Scores of at most ATTENTION_CHUNK_BYTES a chunk: float32 scores and softmax, half-precision weights.
    rows = max(1, ATTENTION_CHUNK_BYTES // (query_heads * attended * (2 * 4 + query.element_size())))
    output = torch.empty(batch, length, query_heads, dim, dtype=query.dtype, device=query.device)
    lowest = torch.finfo(torch.float32).min
    for sequence in range(batch):
        grouped = query[sequence].view(heads, group, length, dim)  # query heads h*group.. share key head h
        sequence_mask = None if mask is None else mask[sequence if mask.shape[0] > 1 else 0, 0]  # [S, T]
        for start in range(0, length, rows):
            end = min(length, start + rows)
            rows_mask = None if sequence_mask is None else sequence_mask[start:end]
            visible = attended
            if rows_mask is not None and before_own + end < attended and _hides_all(rows_mask[:, before_own + end:]):
                visible = before_own + end
                rows_mask = rows_mask[:, :visible]
            chunk = grouped[:, :, start:end].reshape(heads, group * (end - start), dim)  # [H, g*s, D]
            scores = torch.matmul(chunk, keys[sequence, :, :visible].transpose(-1, -2))  # [H, g*s, t]
            scores = scores.view(heads, group, end - start, visible).float().mul_(scaling)
            if rows_mask is not None:  # [s, t], every head's
                if rows_mask.dtype == torch.bool:
                    scores.masked_fill_(~rows_mask, lowest)
                else:
                    scores.add_(rows_mask).clamp_(min=lowest)
            weights = torch.softmax(scores, dim=-1).to(query.dtype).view(heads, group * (end - start), visible)
            attended_values = torch.matmul(weights, values[sequence, :, :visible])  # [H, g*s, D]
            output[sequence, start:end] = (attended_values.view(heads, group, end - start, dim)
                                           .permute(2, 0, 1, 3).reshape(end - start, query_heads, dim))
    return output


def _hides_all(mask: torch.Tensor) -> bool:
    """Whether a bool (attend) or additive mask lets no score through."""
    return not bool(mask.any()) if mask.dtype == torch.bool else bool((mask == float("-inf")).all())


def attend_with_prefix(query, own_keys, own_values, prefix_keys, prefix_values, mask, scaling: float):
    """One query token per sequence. Shapes: query [b, Hq, 1, D]; own keys/values [b, H, S, D]; prefix keys/values
    [1, H, P, D]; mask [b, 1, 1, P + S] (bool: attend, or additive float) or None. Returns [b, 1, Hq, D], the layout
    transformers' attention functions return."""
    batch, query_heads, _, dim = query.shape
    heads, prefix_length = prefix_keys.shape[1], prefix_keys.shape[-2]
    group = query_heads // heads
    grouped = query.reshape(batch, heads, group, dim)  # query heads h*group..h*group+group-1 share key head h
    # Against the prefix: one matmul per key head over every sequence's queries, reading the prefix once.
    by_head = grouped.transpose(0, 1).reshape(heads, batch * group, dim)  # [H, b*g, D]
    prefix_scores = torch.bmm(by_head, prefix_keys[0].transpose(1, 2))  # [H, b*g, P]
    prefix_scores = prefix_scores.reshape(heads, batch, group, prefix_length).transpose(0, 1)  # [b, H, g, P]
    own_scores = torch.matmul(grouped, own_keys.transpose(-1, -2))  # [b, H, g, S]
    scores = torch.cat([prefix_scores, own_scores], dim=-1) * scaling  # [b, H, g, P + S]
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])  # one row per sequence, shared by all heads
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    prefix_weights = weights[..., :prefix_length].transpose(0, 1).reshape(heads, batch * group, prefix_length)
    from_prefix = torch.bmm(prefix_weights, prefix_values[0])  # [H, b*g, D]
    from_prefix = from_prefix.reshape(heads, batch, group, dim).transpose(0, 1)  # [b, H, g, D]
    output = from_prefix + torch.matmul(weights[..., prefix_length:], own_values)  # [b, H, g, D]
    return output.reshape(batch, query_heads, 1, dim).transpose(1, 2).contiguous()  # [b, 1, Hq, D]
