"""A GGUF model's plan: its quantized bytes are what a pass reads, dequantizing them is part of the reads at the
machine's measured rates, its read buffer holds a layer's blocks, and a streamed head or gathered embedding reads
its own quantized bytes."""
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


def test_a_streamed_pass_reads_the_quantized_layers_and_dequantizes_them(sizes):
    rates = {ggml_type: 1e8 for ggml_type in (*sizes.layer_params_by_type, *sizes.non_decoder_params_by_type)}
    options = dict(rows=ROWS, streaming="always", compute_dtype="float32", compute_flops_per_s=1e30)
    without = plan(sizes, **options)
    decoding = sum(sizes.layer_params_by_type.values()) / 1e8
    assert without.time.io_seconds_per_pass == pytest.approx(sizes.decoder_bytes / 1e9)
    dequantizing = plan(sizes, **options, dequantize_weights_per_s=rates)
    assert dequantizing.time.io_seconds_per_pass == pytest.approx(sizes.decoder_bytes / 1e9 + decoding)
    assert any(f"dequantizing the GGUF's layers into float32: {decoding:.2g} s" in c for c in dequantizing.caveats)
    assert not any("dequantizing" in c for c in without.caveats)
    # resident: every weight is dequantized once, as it loads
    resident = plan(sizes, **{**options, "streaming": "never"}, dequantize_weights_per_s=rates)
    everything = (sum(sizes.layer_params_by_type.values()) + sum(sizes.non_decoder_params_by_type.values())) / 1e8
    assert resident.time.load_seconds == pytest.approx(sizes.checkpoint_bytes / 1e9 + everything)


def test_a_gguf_layer_slot_is_at_the_compute_dtype_beside_a_buffer_of_its_blocks(sizes):
    weights = streamed_weights(sizes, "float32", prefetch=True)
    parts = dict(weights.parts)
    assert parts["2 layer slot(s)"] == 2 * sizes.largest_layer_params * 4
    assert parts["read buffers"] == sizes.largest_layer_bytes < sizes.largest_layer_params * 4 / 3
    # two layers: q, k, v, o in Q4_0 (4 heads of 64, 2 key/value heads), gate, up, down in Q8_0, two F32 norms
    attention, mlp, norms = 2 * (2 * 256 * 256 + 2 * 128 * 256), 2 * 3 * 256 * 512, 2 * 2 * 256
    assert sizes.layer_params_by_type == {"Q4_0": attention, "Q8_0": mlp, "F32": norms}
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
