"""Small GGUF files and raw ggml blocks for the GGUF tests, written with gguf-py's own writer.

Any bytes are valid blocks of every supported type, so random bytes test the decoders on every bit pattern; the fp16
scales at the front of the first blocks are then set to the values an exact decoder must carry through (NaN, both
infinities, subnormals, signed zero, the largest half).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# fp16 bit patterns: quiet NaN, a NaN with payload, +Inf, -Inf, smallest and largest subnormal, -0, largest normal.
SPECIAL_HALVES = np.array([0x7E00, 0x7C01, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x8000, 0x7BFF], dtype=np.uint16)
# The same for bfloat16 (F32's high halves).
SPECIAL_BFLOATS = np.array([0x7FC0, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x007F, 0x8000, 0x7F7F], dtype=np.uint16)
# The same for F32: quiet NaN, NaN with payload, +Inf, -Inf, smallest and largest subnormal, -0, largest normal.
SPECIAL_SINGLES = np.array([0x7FC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x007FFFFF, 0x80000000,
                            0x7F7FFFFF], dtype=np.uint32)
# Byte offsets of each block's fp16 scales (d, and m or dmin) per type; the F16 and BF16 values are all "scales".
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,), "F16": (0,), "BF16": (0,)}


def random_blocks(ggml_type: str, rows: int, blocks_per_row: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, blocks_per_row * block bytes] random uint8 rows of `ggml_type` blocks, the first blocks' scales set
    to SPECIAL_HALVES (SPECIAL_BFLOATS for BF16), the first F32 values to SPECIAL_SINGLES."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, block_bytes), dtype=np.uint8)
    if ggml_type == "F32":
        count = min(len(SPECIAL_SINGLES), len(blocks))
        blocks[:count] = SPECIAL_SINGLES.view(np.uint8).reshape(-1, 4)[:count]
    specials = (SPECIAL_BFLOATS if ggml_type == "BF16" else SPECIAL_HALVES).view(np.uint8).reshape(-1, 2)
    for index, offset in enumerate(SCALE_OFFSETS.get(ggml_type, ())):
        count = min(len(specials), len(blocks))
        blocks[:count, offset:offset + 2] = np.roll(specials, index, axis=0)[:count]  # d and m differ per block
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]], *, arch: str = "llama",
               metadata: dict[str, int] | None = None, big_endian: bool = False,
               tensors_per_file: int = 0) -> list[Path]:
    """Write `tensors` (name -> (ggml type, uint8 rows of its blocks)) as a GGUF file, or as llama.cpp-style
    split files of `tensors_per_file` each; returns the files written."""
    from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter

    endianess = GGUFEndian.BIG if big_endian else GGUFEndian.LITTLE
    writer = GGUFWriter(path, arch, endianess=endianess, split_max_tensors=tensors_per_file)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    for name, (ggml_type, raw) in tensors.items():
        # uint8 bytes with a raw type: the writer stores them as they are, whatever its byte order
        writer.add_tensor(name, raw, raw_shape=None, raw_dtype=GGMLQuantizationType[ggml_type])
    files = writer.format_shard_names(path) if tensors_per_file else [path]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return files


# Tiny GGUF models: two layers, every matrix's rows whole K-quant super-blocks (256 weights), 4 query heads of 64 on
# 2 key/value heads. The metadata is what transformers maps into a config for each architecture.
TINY_SHAPE = {"context_length": 128, "block_count": 2, "embedding_length": 256, "feed_forward_length": 512,
              "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 320}
TINY_ARCH_METADATA = {
    "llama": {"rope.dimension_count": 64},
    "qwen2": {},
    "gemma3": {"attention.key_length": 64, "attention.value_length": 64, "attention.sliding_window": 8},
}
# The types each architecture's tiny model is written in: token embedding, attention, MLP and (untied) head.
# gguf-py quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1; the K-quants are packed here (pack_k_quant).
TINY_ARCH_TYPES = {
    "llama": {"token_embd": "Q8_0", "attn": "Q4_0", "ffn": "Q8_0", "output": "Q4_0"},
    "qwen2": {"token_embd": "Q8_0", "attn": "Q4_1", "ffn": "Q5_0", "output": None},
    "gemma3": {"token_embd": "Q6_K", "attn": "Q4_K", "ffn": "Q5_K", "output": None},
}


def pack_k_quant(ggml_type: str, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, width] weights of a K-quant as random blocks whose fp16 scales are small and finite (weights of a
    trained layer's size), as uint8 rows: gguf-py has no K-quant writer."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = rng.integers(0, 256, size=(rows * width // weights, block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scales = rng.uniform(1e-4, 1e-3, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _tiny_blocks(name: str, shape: tuple[int, ...], ggml_type: str, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    if ggml_type.endswith("_K"):
        return pack_k_quant(ggml_type, shape[0], shape[1], rng)
    values = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
    if ggml_type == "F32":
        values = values + (0.0 if name.endswith("bias") else 1.0)  # norms near one
        return values.view(np.uint8).reshape(*shape[:-1], -1)
    return quants.quantize(values, GGMLQuantizationType[ggml_type])


def tiny_gguf_tensors(arch: str, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (ggml type, uint8 rows) of every tensor transformers' model of `arch` (the tiny shape) has, its
    names as transformers maps them; matrices in the architecture's TINY_ARCH_TYPES, 1-D tensors F32."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
    config = CONFIG_MAPPING[model_type](
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=320, max_position_embeddings=128, tie_word_embeddings=TINY_ARCH_TYPES[arch]["output"]
        is None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {hf: gguf for gguf, hf in get_gguf_hf_weights_map(model, TensorProcessor()).items()}
    kinds = TINY_ARCH_TYPES[arch]
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        gguf_name = names.get(hf_name)
        if gguf_name is None or (gguf_name == "output.weight" and kinds["output"] is None):
            continue
        kind = "attn" if ".attn_" in gguf_name else "ffn" if ".ffn_" in gguf_name else gguf_name.split(".")[0]
        ggml_type = "F32" if tensor.dim() == 1 else kinds[kind]
        tensors[gguf_name] = (ggml_type, _tiny_blocks(gguf_name, tuple(tensor.shape), ggml_type, rng))
    return dict(sorted(tensors.items(), key=lambda item: _file_order(item[0])))


def _file_order(name: str) -> tuple:
    """llama.cpp's order: the token embedding, then the layers in turn, then the rest."""
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if parts[0] == "token_embd" else 2, 0, name)


def write_tiny_gguf_model(path: Path, arch: str, seed: int = 0) -> Path:
    """A two-layer GGUF model of `arch` (TINY_ARCH_METADATA) with random weights, written by gguf-py."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    for key, value in {**TINY_SHAPE, **TINY_ARCH_METADATA[arch]}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    for name, (ggml_type, raw) in tiny_gguf_tensors(arch, np.random.default_rng(seed)).items():
        writer.add_tensor(name, raw, raw_shape=None, raw_dtype=GGMLQuantizationType[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
