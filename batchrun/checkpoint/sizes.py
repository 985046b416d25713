"""Everything the plan needs to know about a model's size, read from config.json and the safetensors headers
(no weight data), or estimated from the config alone as a labelled fallback. No torch."""
from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from batchrun.checkpoint.files import (CONFIG_NAME, DTYPE_BITS, CheckpointError, TensorInfo, decoder_layer_prefix,
                                       is_gguf_file, load_config, read_tensor_infos, storage_dtype)
from batchrun.checkpoint.gguf_index import read_gguf_index
from batchrun.checkpoint.gguf_model import gguf_config, sizing_config

# Alternative spellings of the same config field across architectures (generic names, not a per-family table).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "model_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
VOCAB_KEYS = ("vocab_size", "padded_vocab_size")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k")
# When a (sparse, hub-style) config omits the head count: the most common head width; with kv heads = heads this
# sizes the KV cache as full multi-head attention, which over- rather than under-states memory.
ASSUMED_HEAD_DIM = 128
DTYPE_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


@dataclass
class CheckpointSizes:
    path: Path | None
    model_type: str
    storage_dtype: str  # most common dtype by bytes (safetensors code; a GGUF's ggml type, "Q4_K")
    num_layers: int
    layer_bytes: list[int]  # per decoder layer, as stored (a GGUF's quantized bytes, scales included)
    non_decoder_bytes: int
    layer_params: list[int]
    non_decoder_params: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    sliding_windows: list[int | None]  # per layer; None = full attention (or unknown: see unplaced_window)
    max_position_embeddings: int | None
    moe: dict | None  # {"num_experts": n, "experts_per_token": k}
    estimated: bool  # True only for the parameter-count fallback
    source: str  # "headers" | "estimate"
    decoder_prefix: str | None = None  # e.g. "model.layers"; None for an estimate
    assumptions: list[str] = field(default_factory=list)  # config fields the sizes had to assume
    quantization: str | None = None  # the config's quantization_config quant_method (packed weights plus scales)
    # A window and no word on which layers use it: KV is sized as full attention, and a prefix is shared only by
    # rows that fit the window (transformers' config classes fill in layer types that config.json leaves out).
    unplaced_window: int | None = None
    # [out, in] of decoder layer 0's 2-D weights, as stored: the matrices a decode step multiplies in every layer,
    # whose own speed at a few rows prices decode passes (measure.decode_rates). Empty for an estimate.
    layer_matrices: tuple[tuple[int, int], ...] = ()
    file_format: str = "safetensors"  # or "gguf": one file whose tensors are dequantized as they are read
    # A GGUF's weights by ggml type, in the decoder stack and outside it: what dequantizing them costs (plan.passes)
    layer_params_by_type: dict[str, int] = field(default_factory=dict)
    non_decoder_params_by_type: dict[str, int] = field(default_factory=dict)
    # A GGUF's token matrices as stored (quantized, each in its own type): what gathering or streaming them reads.
    # None where every matrix is stored at storage_dtype.
    embedding_bytes: int | None = None
    head_bytes: int | None = None
    # A GGUF's tensors of fewer than two dimensions (norms, biases) per decoder layer: a streamed layer on the host
    # holds its matrices as their blocks and these at the compute dtype (plan.weights.layer_slot_bytes).
    layer_vector_params: list[int] = field(default_factory=list)
    layer_vector_bytes: list[int] = field(default_factory=list)

    @property
    def checkpoint_bytes(self) -> int:
        return sum(self.layer_bytes) + self.non_decoder_bytes

    @property
    def decoder_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def largest_layer_bytes(self) -> int:
        return max(self.layer_bytes)

    @property
    def typical_layer_bytes(self) -> int:
        return statistics.median_low(self.layer_bytes)

    @property
    def decoder_params(self) -> int:
        return sum(self.layer_params)

    @property
    def largest_layer_params(self) -> int:
        return max(self.layer_params)

    @property
    def total_params(self) -> int:
        return self.decoder_params + self.non_decoder_params

    def to_json(self) -> dict:
        report = asdict(self)
        report["path"] = str(self.path) if self.path else None
        for name in ("checkpoint_bytes", "largest_layer_bytes", "typical_layer_bytes", "total_params"):
            report[name] = getattr(self, name)
        return report


def checkpoint_sizes(checkpoint: str | os.PathLike, trust_remote_code: bool = False) -> CheckpointSizes:
    """Sizes from config.json and the safetensors headers (a GGUF file's metadata and tensor infos); a tensor whose
    shape contradicts the config is an error."""
    directory = Path(checkpoint)
    if is_gguf_file(directory):
        index = read_gguf_index(directory)
        return _sizes(directory, sizing_config(gguf_config(index)), index.tensors, str(directory), gguf=True)
    return _sizes(directory, load_config(directory, trust_remote_code), read_tensor_infos(directory),
                  str(directory / CONFIG_NAME), gguf=False)


def _sizes(directory: Path, config: dict, infos: dict[str, TensorInfo], where: str, gguf: bool) -> CheckpointSizes:
    """A GGUF's tensors carry llama.cpp's names, which the per-name shape checks do not know, and no packing the
    config declares."""
    text = _text_config(config)
    num_layers = _num_layers(text, where)
    try:
        prefix = decoder_layer_prefix(infos, num_layers)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: {error}") from None

    layer_bytes, layer_params = [0] * num_layers, [0] * num_layers
    vector_bytes, vector_params = [0] * num_layers, [0] * num_layers
    outside: list[TensorInfo] = []
    by_type: tuple[Counter[str], Counter[str]] = (Counter(), Counter())  # decoder stack, outside it
    for name, info in infos.items():
        if name.startswith(prefix + "."):
            layer = int(name[len(prefix) + 1:].split(".", 1)[0])
            layer_bytes[layer] += info.nbytes
            layer_params[layer] += info.numel
            if len(info.shape) < 2:
                vector_bytes[layer] += info.nbytes
                vector_params[layer] += info.numel
            by_type[0][info.dtype] += info.numel
        else:
            outside.append(info)
            by_type[1][info.dtype] += info.numel
    # The token embedding is the largest matrix outside the decoder stack in every decoder-only LM.
    matrices = [info for info in outside if len(info.shape) == 2]
    embedding = max(matrices, key=lambda info: info.numel, default=None)
    arch = _Architecture.read(text, where, num_layers, embedding.shape if embedding else None)
    if embedding is not None and embedding.shape != (arch.vocab_size, arch.hidden_size):
        raise CheckpointError(
            f"{embedding.file}: tensor {embedding.name!r} has shape {list(embedding.shape)} but "
            f"{'its metadata' if gguf else CONFIG_NAME} says vocab_size={arch.vocab_size}, "
            f"hidden_size={arch.hidden_size} (config and weights disagree)"
        )
    if not gguf and not config.get("auto_map") and not config.get("quantization_config"):
        _check_layer_shapes(infos, prefix, num_layers, arch, text)
    # Tied weights are saved once; an untied head is a second matrix of the embedding's shape.
    tied = arch.tied if embedding is None else sum(m.shape == embedding.shape for m in matrices) == 1

    return CheckpointSizes(
        path=directory, storage_dtype=storage_dtype(infos),
        num_layers=num_layers, layer_bytes=layer_bytes, non_decoder_bytes=sum(i.nbytes for i in outside),
        layer_params=layer_params, non_decoder_params=sum(i.numel for i in outside),
        tied_embeddings=bool(tied), estimated=False, source="headers", decoder_prefix=prefix, **arch.size_fields(),
        quantization=_quant_method(config), layer_matrices=_layer_matrices(infos, prefix),
        file_format="gguf" if gguf else "safetensors",
        layer_params_by_type=dict(by_type[0]) if gguf else {},
        non_decoder_params_by_type=dict(by_type[1]) if gguf else {},
        **(_token_matrices_stored(embedding, matrices) if gguf else {}),
        layer_vector_params=vector_params if gguf else [], layer_vector_bytes=vector_bytes if gguf else [],
    )


def _token_matrices_stored(embedding: TensorInfo | None, matrices: list[TensorInfo]) -> dict:
    """embedding_bytes and head_bytes: the head is the other matrix of the embedding's shape, or the embedding."""
    if embedding is None:
        return {}
    head = next((m for m in matrices if m.shape == embedding.shape and m is not embedding), embedding)
    return {"embedding_bytes": embedding.nbytes, "head_bytes": head.nbytes}


def _layer_matrices(infos: dict[str, TensorInfo], prefix: str) -> tuple[tuple[int, int], ...]:
    first = f"{prefix}.0."
    return tuple((info.shape[0], info.shape[1]) for name, info in sorted(infos.items())
                 if name.startswith(first) and len(info.shape) == 2)


def _quant_method(config: dict) -> str | None:
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    return str(quantization.get("quant_method", "unknown method")) if isinstance(quantization, dict) else "unknown"


# Layer tensors whose shape the config fixes in every architecture transformers ships under these exact names (the
# Llama layout most families share). Names differing from these (fused qkv, experts, other families) are not checked
# here; transformers checks them when it loads. Dims are (config field, ...) per axis, None = not checked.
LAYER_SHAPES = {
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "input_layernorm.weight": ("hidden_size",),
    "post_attention_layernorm.weight": ("hidden_size",),
    "self_attn.q_proj.weight": (None, "hidden_size"),
    "self_attn.k_proj.weight": (None, "hidden_size"),
    "self_attn.v_proj.weight": (None, "hidden_size"),
    "self_attn.o_proj.weight": ("hidden_size", None),
}


def _check_layer_shapes(infos: dict[str, TensorInfo], prefix: str, num_layers: int, arch: _Architecture,
                        text: dict) -> None:
    """Refuse at plan time a decoder tensor whose shape contradicts config.json (a wrong config beside the weights,
    a mixed-up download), instead of failing inside the first pass. Skipped for quantized (packed) and remote-code
    checkpoints, whose tensors need not have these shapes."""
    intermediate = text.get("intermediate_size")
    for layer in range(num_layers):
        # Some families give each layer its own MLP width (a list in the config).
        width = intermediate[layer] if isinstance(intermediate, list) and len(intermediate) == num_layers \
            else intermediate
        fields = {"hidden_size": arch.hidden_size, "intermediate_size": width if isinstance(width, int) else None}
        for relative, dims in LAYER_SHAPES.items():
            info = infos.get(f"{prefix}.{layer}.{relative}")
            if info is None:
                continue
            wanted = [fields[field] if field else None for field in dims]
            if len(info.shape) != len(dims) or any(w is not None and w != got for w, got in zip(wanted, info.shape)):
                said = ", ".join(f"{field}={fields[field]}" for field in dict.fromkeys(dims) if field)
                expected = " x ".join("*" if w is None else str(w) for w in wanted)
                raise CheckpointError(
                    f"{info.file}: tensor {info.name!r} has shape {list(info.shape)} but {CONFIG_NAME} says {said} "
                    f"(expected {expected}): config and weights disagree"
                )


def sizes_from_config(config: dict, dtype: str = "BF16", *, path: Path | None = None) -> CheckpointSizes:
    """Estimated sizes from the architecture alone (labelled `estimated`): the fallback when no headers can be read,
    and the way to plan for a published config. Assumes a gated MLP (three matrices), the common modern layout."""
    code = DTYPE_CODES.get(dtype, dtype)
    if code not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; use a safetensors code (BF16, F32, ...) or {sorted(DTYPE_CODES)}")
    text = _text_config(config)
    where = str(path / CONFIG_NAME) if path else "config"
    num_layers = _num_layers(text, where)
    arch = _Architecture.read(text, where, num_layers, None)
    hidden = arch.hidden_size
    attention_width = arch.num_attention_heads * arch.head_dim  # q and o projections
    kv_width = arch.num_kv_heads * arch.head_dim  # k and v projections
    attention_params = 2 * hidden * attention_width + 2 * hidden * kv_width
    if text.get("attention_bias"):
        attention_params += attention_width + 2 * kv_width
    if arch.moe:
        experts = arch.moe["num_experts"]
        expert_width = text.get("moe_intermediate_size") or arch.intermediate_size
        mlp_params = experts * 3 * hidden * expert_width + hidden * experts  # experts + router
    else:
        mlp_params = 3 * hidden * arch.intermediate_size  # gate, up, down
    norm_params = 2 * hidden
    per_layer_params = attention_params + mlp_params + norm_params
    tied = bool(arch.tied)
    non_decoder_params = arch.vocab_size * hidden * (1 if tied else 2) + hidden  # embedding (+ head) + final norm
    bits = DTYPE_BITS[code]
    fields = arch.size_fields()
    fields["assumptions"].append("MLP assumed gated (three matrices), as in most current models")
    if "tie_word_embeddings" not in _text_config(config):
        fields["assumptions"].append("tie_word_embeddings not stated: the head is assumed untied (its own matrix)")
    return CheckpointSizes(
        path=path, storage_dtype=code, num_layers=num_layers,
        layer_bytes=[per_layer_params * bits // 8] * num_layers, non_decoder_bytes=non_decoder_params * bits // 8,
        layer_params=[per_layer_params] * num_layers, non_decoder_params=non_decoder_params,
        tied_embeddings=tied, estimated=True, source="estimate", **fields,
    )


@dataclass(frozen=True)
class _Architecture:
    """The config fields sizing needs, read through their alternative spellings."""
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    sliding_windows: list[int | None]
    max_position_embeddings: int | None
    moe: dict | None
    assumptions: list[str]
    unplaced_window: int | None

    @classmethod
    def read(cls, text: dict, where: str, num_layers: int, embedding_shape: tuple[int, ...] | None) -> _Architecture:
        assumptions: list[str] = []
        hidden = _first(text, HIDDEN_KEYS)
        vocab = _first(text, VOCAB_KEYS)
        if embedding_shape is not None:
            if hidden is None:
                hidden = embedding_shape[1]
                assumptions.append("hidden_size read from the embedding's shape")
            if vocab is None:
                vocab = embedding_shape[0]
                assumptions.append("vocab_size read from the embedding's shape")
        if hidden is None or vocab is None:
            raise CheckpointError(f"{where}: needs hidden_size and vocab_size")
        heads = _first(text, HEAD_KEYS)
        head_dim = text.get("head_dim")
        if heads is None:
            head_dim = head_dim or ASSUMED_HEAD_DIM
            heads = hidden // head_dim
            assumptions.append(f"num_attention_heads missing: assumed {heads} heads of {head_dim}, KV sized as "
                               "full multi-head attention")
        head_dim = head_dim or hidden // heads
        kv_heads = _first(text, KV_HEAD_KEYS) or (1 if text.get("multi_query") else heads)
        intermediate = _first(text, INTERMEDIATE_KEYS)
        if intermediate is None:
            intermediate = 4 * hidden
            assumptions.append("intermediate_size missing: assumed 4 x hidden_size")
        for name, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("head_dim", head_dim),
                            ("num_key_value_heads", kv_heads), ("vocab_size", vocab)):
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{where}: {name} must be a positive integer, got {value!r}")
        if heads % kv_heads:  # transformers builds such a model, then fails in its first attention call
            raise CheckpointError(f"{where}: num_attention_heads={heads} is not a multiple of the "
                                  f"{kv_heads} key/value heads, so no attention can group its query heads")
        windows, unplaced_window = _sliding_windows(text, num_layers)
        if unplaced_window:
            assumptions.append(f"sliding_window={unplaced_window} without layer types: KV sized as full attention on "
                               "every layer, a prompt prefix shared only by rows that fit the window")
        experts = _first(text, EXPERT_KEYS)
        moe = None
        if isinstance(experts, int) and experts > 1:
            moe = {"num_experts": experts, "experts_per_token": _first(text, EXPERTS_PER_TOKEN_KEYS)}
        # Untied is the conservative reading when the config is silent (one more vocab x hidden matrix).
        tied = bool(text.get("tie_word_embeddings", False))
        return cls(str(text.get("model_type", "unknown")), hidden, intermediate, heads, kv_heads, head_dim, vocab,
                   tied, windows, _first(text, CONTEXT_KEYS), moe, assumptions, unplaced_window)

    def size_fields(self) -> dict:
        return {
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "sliding_windows": self.sliding_windows,
            "max_position_embeddings": self.max_position_embeddings, "moe": self.moe,
            "assumptions": list(self.assumptions), "model_type": self.model_type,
            "unplaced_window": self.unplaced_window,
        }


def _sliding_windows(text: dict, num_layers: int) -> tuple[list[int | None], int | None]:
    """Per-layer attention window (None = full) where the config says which layers slide, and the window of a config
    that does not say which (None otherwise)."""
    window = text.get("sliding_window")
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return [window if kind == "sliding_attention" and window else None for kind in layer_types], None
    if not window or text.get("use_sliding_window") is False:
        return [None] * num_layers, None
    pattern = text.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:  # every pattern-th layer attends fully (Gemma 3)
        return [None if (layer + 1) % pattern == 0 else window for layer in range(num_layers)], None
    if text.get("use_sliding_window") is True:  # Qwen-style: layers from max_window_layers on slide
        first_sliding = text.get("max_window_layers") or 0
        return [window if layer >= first_sliding else None for layer in range(num_layers)], None
    # A window and nothing saying which layers use it: which do depends on the model's config class (Mistral-7B-v0.1
    # and Phi-3-mini-4k slide on every layer, Gemma 2 on every other one), so the plan takes the larger KV of full
    # attention, and shares a prefix only among rows that fit the window (where no layer's window cuts anything).
    return [None] * num_layers, window


def _text_config(config: dict) -> dict:
    """Multimodal configs nest the language model under text_config; its fields win over the outer ones."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def _num_layers(text: dict, where: str) -> int:
    layers = _first(text, LAYER_KEYS)
    if not isinstance(layers, int) or layers < 1:
        raise CheckpointError(f"{where}: needs num_hidden_layers (a positive integer), got {layers!r}")
    return layers


def _first(config: dict, keys: tuple[str, ...]):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


# Per-token KV sizes at a compute dtype, used by both the memory and the time arithmetic of the plan.


def kv_bytes_per_token_per_layer(sizes: CheckpointSizes, compute_bytes: int) -> int:
    """K and V of one token in one layer: 2 x kv_heads x head_dim x bytes (8 x 128 in bf16 = 4 KiB)."""
    return 2 * sizes.num_kv_heads * sizes.head_dim * compute_bytes


def attended_positions(sizes: CheckpointSizes, tokens: int) -> int:
    """Positions summed over layers that a token at position `tokens` sees: sliding-window layers stop at the
    window, so both their KV cache and their attention compute are capped there."""
    return sum(min(tokens, window) if window else tokens for window in sizes.sliding_windows)


def kv_bytes_for_sequence(sizes: CheckpointSizes, compute_bytes: int, tokens: int) -> int:
    return kv_bytes_per_token_per_layer(sizes, compute_bytes) * attended_positions(sizes, tokens)
