"""GGUF dequantization in torch: bit for bit gguf-py's numbers for every supported type (random blocks, special fp16
scales, several shapes), tile by tile as whole, llama.cpp's q/k row order undone as transformers undoes it, and the
default model's GGUF layer equal to its converted float32 checkpoint, every tensor of Gemma 3's GGUF gguf-py's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from batchrun.checkpoint import GGUF_BLOCKS, read_gguf_index
from batchrun.runtime import dequantize, read_gguf_rows, undo_qk_permutation
from batchrun.runtime.gguf_blocks import dequantize_into
from tests.gguf_files import random_blocks, write_gguf

# (rows, blocks per row); a leading extra dim makes a 3-D tensor (experts).
SHAPES = [(1, 1), (3, 2), (7, 5), (2, 3, 2)]
# Types gguf-py can also write, each with the largest error of a round trip relative to the largest |weight|.
ROUND_TRIPS = {"F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 100, "Q4_0": 1 / 8, "Q4_1": 1 / 8}


def gguf_reference(raw: np.ndarray, ggml_type: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    with np.errstate(invalid="ignore", over="ignore"):  # NaN and Inf scales are part of the test
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, GGMLQuantizationType[ggml_type])))


def assert_same_floats(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Bit for bit (so -0.0 is not 0.0) wherever the reference is a number, NaN exactly where it is NaN. Which NaN
    results when two NaNs meet (a NaN scale plus a NaN offset) is left to the CPU's vector unit, in numpy as in
    torch, so NaN payloads are not compared."""
    assert ours.dtype == reference.dtype == torch.float32 and ours.shape == reference.shape
    nan = reference.isnan()
    assert torch.equal(ours.isnan(), nan)
    assert torch.equal(ours.view(torch.int32)[~nan], reference.view(torch.int32)[~nan])


def shaped_blocks(ggml_type: str, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """Random blocks for a tensor of `shape` (leading dims, then blocks per row) and its weights' shape."""
    *leading, blocks_per_row = shape
    rows = int(np.prod(leading))
    raw = random_blocks(ggml_type, rows, blocks_per_row, np.random.default_rng(seed))
    weights_shape = (*leading, blocks_per_row * GGUF_BLOCKS[ggml_type][0])
    return raw.reshape(*leading, -1), weights_shape


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("ggml_type", list(GGUF_BLOCKS))
def test_each_type_is_gguf_pys_numbers_bit_for_bit(ggml_type, shape):
    raw, weights_shape = shaped_blocks(ggml_type, shape, seed=len(shape) * 100 + shape[-1])
    reference = gguf_reference(raw, ggml_type)
    ours = dequantize(torch.from_numpy(raw.copy()), ggml_type, weights_shape)
    assert ours.shape == weights_shape == reference.shape
    assert_same_floats(ours, reference)


@pytest.mark.parametrize("ggml_type", list(GGUF_BLOCKS))
def test_random_blocks_meet_every_special_scale(ggml_type):
    # The comparison above covers NaN, infinite and subnormal scales only if the blocks carry them.
    raw, shape = shaped_blocks(ggml_type, (7, 5), seed=0)
    reference = gguf_reference(raw, ggml_type)
    assert reference.isnan().any() and reference.isinf().any()
    if ggml_type in ("F32", "F16", "BF16"):
        tiny = reference[(reference != 0) & reference.isfinite()].abs().min()
        assert tiny < (2.0 ** -14 if ggml_type == "F16" else 2.0 ** -126)  # a subnormal of the stored type


@pytest.mark.parametrize("ggml_type", list(ROUND_TRIPS))
def test_a_round_trip_through_gguf_py_quantize(ggml_type):
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(11).standard_normal((6, 96), dtype=np.float32)
    stored = np.ascontiguousarray(quants.quantize(weights, GGMLQuantizationType[ggml_type])).view(np.uint8)
    ours = dequantize(torch.from_numpy(stored.copy()), ggml_type, weights.shape)
    assert_same_floats(ours, gguf_reference(stored, ggml_type))
    error = (ours - torch.from_numpy(weights)).abs().max().item()
    assert 0 < error <= ROUND_TRIPS[ggml_type] * np.abs(weights).max()


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_0", "F32"])
def test_a_tile_of_rows_dequantizes_on_its_own_into_any_dtype(ggml_type):
    raw, shape = shaped_blocks(ggml_type, (9, 2), seed=5)
    whole = dequantize(torch.from_numpy(raw.copy()), ggml_type, shape)
    tile_bytes = torch.from_numpy(raw[3:7].copy()).view(-1)
    # Rows 3..6 placed at an odd byte of a larger buffer, as in a reused read buffer: no field is aligned there.
    shifted = torch.empty(tile_bytes.numel() + 1, dtype=torch.uint8)[1:]
    shifted.copy_(tile_bytes)
    assert shifted.storage_offset() == 1
    assert_same_floats(dequantize(shifted, ggml_type, (4, shape[1])), whole[3:7])
    halves = dequantize(shifted, ggml_type, (4, shape[1]), dtype=torch.bfloat16)
    assert halves.dtype == torch.bfloat16
    assert_same_floats(halves.float(), whole[3:7].to(torch.bfloat16).float())


def test_bytes_that_are_not_whole_blocks_of_the_shape_are_refused():
    raw = torch.zeros(2 * 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="68 bytes of torch.uint8 are not the whole Q8_0 blocks of a \\[2, 64\\]"):
        dequantize(raw, "Q8_0", (2, 64))
    with pytest.raises(ValueError, match="no dequantizer for ggml type 'Q2_K'"):
        dequantize(raw, "Q2_K", (1, 256))


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: each head's two rotary halves interleaved."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_the_qk_permutation_is_undone_as_transformers_undoes_it(heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    head_rows = 8
    checkpoint = np.random.default_rng(heads).standard_normal((heads * head_rows, 5), dtype=np.float32)
    stored = llama_cpp_permute(checkpoint, heads)
    assert not np.array_equal(stored, checkpoint)
    undone = undo_qk_permutation(torch.from_numpy(stored), head_rows)
    assert torch.equal(undone, torch.from_numpy(checkpoint))
    transformers_undone = LlamaTensorProcessor()._reverse_permute_weights(stored, heads, heads)
    assert torch.equal(undone, torch.from_numpy(np.ascontiguousarray(transformers_undone)))
    bias = np.arange(heads * head_rows, dtype=np.float32)  # a 1-D q/k bias is permuted the same way
    assert torch.equal(undo_qk_permutation(torch.from_numpy(llama_cpp_permute(bias, heads)), head_rows),
                       torch.from_numpy(bias))
    # A tile of whole heads undoes on its own.
    if heads > 1:
        tile = undo_qk_permutation(torch.from_numpy(stored[head_rows:2 * head_rows]), head_rows)
        assert torch.equal(tile, torch.from_numpy(checkpoint[head_rows:2 * head_rows]))
    with pytest.raises(ValueError, match="rows are not whole heads of 5 rows in two rotary halves"):
        undo_qk_permutation(torch.from_numpy(stored), 5)


def test_rows_are_read_from_the_file_whole_or_as_a_tile(tmp_path):
    rng = np.random.default_rng(12)
    tensors = {"blk.0.ffn_up.weight": ("Q6_K", random_blocks("Q6_K", 5, 2, rng)),
               "blk.0.ffn_norm.weight": ("F32", rng.standard_normal(512, dtype=np.float32).view(np.uint8))}
    (file,) = write_gguf(tmp_path / "model.gguf", tensors)
    index = read_gguf_index(file)
    up = index.tensors["blk.0.ffn_up.weight"]
    expected = gguf_reference(tensors["blk.0.ffn_up.weight"][1], "Q6_K")
    assert_same_floats(read_gguf_rows(up), expected)
    assert_same_floats(read_gguf_rows(up, 1, 4), expected[1:4])
    norm = read_gguf_rows(index.tensors["blk.0.ffn_norm.weight"])
    assert norm.shape == (512,) and torch.equal(norm, gguf_reference(tensors["blk.0.ffn_norm.weight"][1], "F32"))


# Layer 0's GGUF tensors and the names the converted checkpoint gives them.
LAYER_0 = {
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
    "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
    "blk.0.ffn_norm.weight": "model.layers.0.post_attention_layernorm.weight",
}


def test_the_default_models_gguf_layer_is_its_converted_checkpoint_bit_for_bit(default_gguf):
    from safetensors import safe_open

    gguf_file, checkpoint = default_gguf
    index = read_gguf_index(gguf_file)
    assert index.tensors["blk.0.attn_q.weight"].dtype == "Q4_1"
    permuted = {name for name in LAYER_0 if index.permuted_head_rows(name) is not None}
    assert permuted == {"blk.0.attn_q.weight", "blk.0.attn_k.weight"}
    with safe_open(checkpoint / "model.safetensors", framework="pt") as converted:
        for name, converted_name in LAYER_0.items():
            weights = read_gguf_rows(index.tensors[name])
            head_rows = index.permuted_head_rows(name)
            if head_rows is not None:
                assert not torch.equal(weights, converted.get_tensor(converted_name))  # the permutation matters
                weights = undo_qk_permutation(weights, head_rows)
            assert torch.equal(weights, converted.get_tensor(converted_name)), name


@pytest.mark.slow
def test_every_tensor_of_a_trained_k_quant_model_is_gguf_pys(gemma3_gguf):
    # Trained blocks of the types SmolLM2's file lacks (Q4_K, Q6_K, Q5_0), each tensor whole and as a tile of rows;
    # the 262,144-row embedding as tiles only. Slow: gguf-py parses the vocabulary in the file's metadata field by
    # field.
    index = read_gguf_index(gemma3_gguf)
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} <= {info.dtype for info in index.tensors.values()}
    for name, info in index.tensors.items():
        tiles = [(3, 8), (info.rows - 64, info.rows)] if info.rows > 64 else [(0, info.rows)]
        if info.numel < 1 << 24:
            tiles.append((0, info.rows))
        for start, stop in tiles:
            offset, length = info.row_span(start, stop)
            stored = np.fromfile(info.file, dtype=np.uint8, count=length, offset=offset)
            reference = gguf_reference(stored.reshape(stop - start, info.row_bytes), info.dtype)
            if (start, stop) == (0, info.rows):
                reference = reference.reshape(info.shape)
            assert torch.equal(read_gguf_rows(info, start, stop), reference), (name, start, stop)


@pytest.mark.parametrize("ggml_type", list(GGUF_BLOCKS))
def test_blocks_decoded_into_a_tensor_are_the_blocks_decoded(ggml_type):
    """Straight into a float32 tile (the types a quantized linear decodes most), or through a copy into bfloat16:
    the same numbers as dequantize, special scales included."""
    raw, shape = shaped_blocks(ggml_type, (6, 256 // GGUF_BLOCKS[ggml_type][0] or 1), seed=3)
    raw = torch.from_numpy(raw.reshape(-1).copy())
    expected = dequantize(raw, ggml_type, shape)
    into = torch.full(shape, 7.0)
    dequantize_into(raw, ggml_type, into)
    assert_same_floats(into, expected)
    narrow = torch.empty(shape, dtype=torch.bfloat16)
    dequantize_into(raw, ggml_type, narrow)
    assert torch.equal(narrow.isnan(), expected.isnan())
    assert torch.equal(narrow[~narrow.isnan()], expected.to(torch.bfloat16)[~narrow.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_half_precision_tile_is_the_float32_values_rounded_once(ggml_type, dtype):
    """Decoded in float32 through the thread's scratch, then rounded: as dequantize(..., dtype) rounds, and a larger
    tile after a smaller one grows the scratch."""
    for rows in (2, 6):
        raw, shape = shaped_blocks(ggml_type, (rows, 4), seed=rows)
        raw = torch.from_numpy(raw.reshape(-1).copy())
        out = torch.empty(shape, dtype=dtype)
        dequantize_into(raw, ggml_type, out)
        expected = dequantize(raw, ggml_type, shape, dtype)
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])
