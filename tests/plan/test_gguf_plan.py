"""A GGUF model's plan: its quantized bytes are what a pass reads and what a streamed layer holds on the host;
dequantizing them is part of every forward call through the layers (on an accelerator, of the reads) at the
machine's measured rates; and a streamed head or gathered embedding reads its own quantized bytes."""
from __future__ import annotations

import pytest

from batchrun.checkpoint import checkpoint_sizes, read_gguf_index
from batchrun.plan import RowCost
from batchrun.plan.weights import streamed_weights
from tests.gguf_files import write_tiny_gguf_model
from tests.support import GiB, plan

ROWS = [RowCost(40, 0, (1, 1))] * 4


@pytest.fixture
def sizes(tmp_path):
    return checkpoint_sizes(write_tiny_gguf_model(tmp_path / "llama.gguf", "llama"))


def test_a_streamed_pass_reads_the_quantized_layers_and_each_call_dequantizes_them(sizes):
    rates = {ggml_type: 1e8 for ggml_type in (*sizes.layer_params_by_type, *sizes.non_decoder_params_by_type)}
    options = dict(rows=ROWS, streaming="always", compute_dtype="float32", compute_flops_per_s=1e30)
    without = plan(sizes, **options)
    decoding = sum(sizes.layer_params_by_type.values()) / 1e8
    assert without.time.io_seconds_per_pass == pytest.approx(sizes.decoder_bytes / 1e9)
    dequantizing = plan(sizes, **options, dequantize_weights_per_s=rates)
    # the reads are the blocks alone; the one choice pass's one call dequantizes every layer's matrices once
    assert dequantizing.time.io_seconds_per_pass == pytest.approx(sizes.decoder_bytes / 1e9)
    assert dequantizing.time.compute_seconds_per_pass == pytest.approx(without.time.compute_seconds_per_pass
                                                                        + decoding)
    assert any(f"dequantizes them into float32 as it multiplies ({decoding:.2g} s a call" in c
               for c in dequantizing.caveats)
    assert not any("dequantiz" in c for c in without.caveats)
    # on an accelerator the layers are dequantized as they load, by the reader
    on_gpu = plan(sizes, **options, device="cuda", dequantize_weights_per_s=rates)
    assert on_gpu.time.io_seconds_per_pass == pytest.approx(sizes.decoder_bytes / 1e9 + decoding)
    # resident: every weight is dequantized once, as it loads
    resident = plan(sizes, **{**options, "streaming": "never"}, dequantize_weights_per_s=rates)
    everything = (sum(sizes.layer_params_by_type.values()) + sum(sizes.non_decoder_params_by_type.values())) / 1e8
    assert resident.time.load_seconds == pytest.approx(sizes.checkpoint_bytes / 1e9 + everything)


def test_a_gguf_layer_slot_holds_its_matrices_blocks_and_its_norms_at_the_compute_dtype(sizes):
    weights = streamed_weights(sizes, "float32", prefetch=True)
    parts = dict(weights.parts)
    norms = 2 * 256  # two F32 norms a layer, held at float32 as stored
    assert sizes.layer_vector_params == [norms, norms] and sizes.layer_vector_bytes == [norms * 4, norms * 4]
    assert parts["2 layer slot(s)"] == 2 * sizes.largest_layer_bytes < 2 * sizes.largest_layer_params * 4 / 3
    assert parts["read buffers"] == norms * 4  # only the norms pass the read buffer
    assert parts["dequantized weight"] == 512 * 256 * 4 + 2 * (2 << 20)  # gate/up/down whole, and two tiles
    # on an accelerator a slot holds the layer at the compute dtype, its blocks read into a buffer first
    on_gpu = dict(streamed_weights(sizes, "float32", prefetch=True, device="cuda").parts)
    assert on_gpu["2 layer slot(s)"] == 2 * sizes.largest_layer_params * 4
    assert on_gpu["read buffers"] == sizes.largest_layer_bytes and "dequantized weight" not in on_gpu
    # two layers: q, k, v, o in Q4_0 (4 heads of 64, 2 key/value heads), gate, up, down in Q8_0, two F32 norms
    attention, mlp = 2 * (2 * 256 * 256 + 2 * 128 * 256), 2 * 3 * 256 * 512
    assert sizes.layer_params_by_type == {"Q4_0": attention, "Q8_0": mlp, "F32": 2 * norms}
    assert sizes.non_decoder_params_by_type == {"Q8_0": 320 * 256, "Q4_0": 320 * 256, "F32": 256}


def test_a_streamed_gguf_head_reads_its_own_quantized_bytes(sizes):
    index = read_gguf_index(sizes.path)
    assert sizes.embedding_bytes == index.tensors["token_embd.weight"].nbytes  # Q8_0
    assert sizes.head_bytes == index.tensors["output.weight"].nbytes < sizes.embedding_bytes  # Q4_0
    options = dict(rows=ROWS, streaming="always", compute_dtype="float32", compute_flops_per_s=1e30,
                   memory_budget_bytes=8 * GiB)
    streamed = plan(sizes, **options, token_matrices="streamed")
    assert streamed.to_json()["token_matrices"] == "streamed"
    assert streamed.time.io_seconds_per_pass == pytest.approx((sizes.decoder_bytes + sizes.head_bytes) / 1e9)
    gathered = plan(sizes, **options, token_matrices="gathered")
    assert gathered.time.load_seconds == pytest.approx((sizes.non_decoder_bytes - sizes.embedding_bytes) / 1e9)
