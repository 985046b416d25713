"""Linear layers that hold a GGUF weight as its blocks and dequantize it as they multiply: whole, bit for bit as the
dequantized weight multiplies, or tile by tile in decode passes, within float32 rounding; and a streamed GGUF model
whose slots hold its matrices' blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchrun.checkpoint import GGUF_BLOCKS, checkpoint_sizes
from batchrun.plan import held_layer_bytes, streamed_weights
from batchrun.runtime import GGUFDecode, LayerReads, StreamedModel
from batchrun.runtime.gguf_weights import QuantizedWeight
from batchrun.runtime import linear_kernels
from tests.gguf_files import SCALE_OFFSETS, random_blocks, write_tiny_gguf_model

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 19, 77, 200, 31]])


def quantized_linear(ggml_type: str, rows: int, blocks_per_row: int, head_rows: int | None = None, seed: int = 0,
                     bias: bool = False) -> tuple[torch.nn.Linear, QuantizedWeight, torch.Tensor]:
    """A routed linear holding random `ggml_type` blocks with finite scales, and the weight they dequantize to."""
    rng = np.random.default_rng(seed)
    blocks = random_blocks(ggml_type, rows * blocks_per_row, 1, rng)  # [blocks, block bytes]
    for offset in SCALE_OFFSETS[ggml_type]:  # finite scales: a NaN would make any two products unequal
        scales = rng.uniform(-0.05, 0.05, size=len(blocks)).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    shape = (rows, blocks_per_row * GGUF_BLOCKS[ggml_type][0])
    quantized = QuantizedWeight(raw, GGUFDecode(ggml_type, shape, head_rows))
    weight = quantized.decode(raw)
    with torch.device("meta"):
        linear = torch.nn.Linear(shape[1], rows, bias=bias)
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(rows, generator=torch.Generator().manual_seed(seed)))
    linear_kernels.route_linears(linear, "aten")
    linear_kernels.attach_quantized(linear, quantized)
    return linear, quantized, weight


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "F16"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_a_linear_holding_blocks_multiplies_as_its_dequantized_weight_does_bit_for_bit(ggml_type, tokens):
    blocks_per_row = 2 if GGUF_BLOCKS[ggml_type][0] == 256 else 8
    linear, _, weight = quantized_linear(ggml_type, 48, blocks_per_row, bias=True)
    inputs = torch.randn(2, tokens, weight.shape[1], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = linear(inputs)
    assert linear.weight.is_meta and torch.equal(got, F.linear(inputs, weight, linear.bias))


@pytest.mark.parametrize("head_rows", [None, 8])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_decode_pass_multiplies_the_blocks_tile_by_tile(head_rows, workers, monkeypatch):
    """Tiles of 5 rows rounded down to whole heads of 8 (one head a tile) or 5 rows: 48 rows cross several tiles, the
    last one short; the q/k rows llama.cpp permutes are undone tile by tile."""
    monkeypatch.setattr(linear_kernels, "WIDEN_TILE_BYTES", 5 * 256 * 4)
    linear, quantized, weight = quantized_linear("Q8_0", 48, 8, head_rows=head_rows)
    filled = []
    real = quantized.fill_rows
    monkeypatch.setattr(QuantizedWeight, "fill_rows", lambda self, start, stop, out: filled.append((start, stop))
                        or real(start, stop, out))
    inputs = torch.randn(3, 1, 256, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), linear_kernels.multiplying_tile_by_tile(), linear_kernels.sharing_tiles(workers):
        got = linear(inputs)
    step = head_rows or 5
    assert sorted(filled) == [(start, min(48, start + step)) for start in range(0, 48, step)]
    assert torch.allclose(got, F.linear(inputs, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_streamed_gguf_layer_holds_its_matrices_as_blocks_as_the_plan_counts(tmp_path, arch):
    """The slot holds each matrix's blocks as stored and the norms at float32: the plan's held layer, to the byte,
    far below the layer at float32; the dequantized weight buffer holds the largest matrix once."""
    file = write_tiny_gguf_model(tmp_path / f"{arch}.gguf", arch)
    sizes = checkpoint_sizes(file)
    with StreamedModel(file, device="cpu", dtype="float32", reads=LayerReads(prefetch=False)) as streamed:
        streamed(PROMPT)
        slot_bytes = streamed.loader.buffer_bytes() - (streamed.loader._staging.numel()
                                                       if streamed.loader._staging is not None else 0)
        layer = streamed.layers[0]
        assert all(param.is_meta for name, param in layer.named_parameters() if name.endswith("proj.weight"))
        # released after the pass: no linear keeps a slot's blocks
        assert not any("_quantized" in module.__dict__ for module in layer.modules())
    assert slot_bytes == held_layer_bytes(sizes, "float32", "cpu")
    assert slot_bytes < sizes.largest_layer_params * 4 / 2
    parts = dict(streamed_weights(sizes, "float32", prefetch=False).parts)
    largest = max(rows * columns for rows, columns in sizes.layer_matrices)
    assert parts["dequantized weight"] >= largest * 4


def test_a_streamed_gguf_models_decode_pass_tiles_and_gives_the_resident_models_logits(tmp_path, monkeypatch):
    """The prompt's pass multiplies whole dequantized weights (bit for bit the resident model's logits); the decode
    pass after it tiles, within float32 rounding."""
    from batchrun.runtime import ResidentModel

    file = write_tiny_gguf_model(tmp_path / "llama.gguf", "llama")
    tiled = []
    real = linear_kernels.tiled_linear
    monkeypatch.setattr(linear_kernels, "tiled_linear", lambda *args: tiled.append(1) or real(*args))
    resident = ResidentModel(file, device="cpu", dtype="float32")
    with torch.inference_mode():
        first = resident.model(PROMPT, use_cache=True)
        following = first.logits[:, -1:].argmax(-1)
        expected = resident.model(following, cache=first.past_key_values).logits
    with StreamedModel(file, device="cpu", dtype="float32") as streamed:
        prompt = streamed.run_pass([lambda: streamed.model(PROMPT, use_cache=True)])[0]
        assert torch.equal(prompt.logits, first.logits) and not tiled
        step = streamed.run_pass([lambda: streamed.model(following, cache=prompt.past_key_values)],
                                 light=True)[0]
    assert tiled and torch.allclose(step.logits, expected, rtol=1e-5, atol=1e-5)
