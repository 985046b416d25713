"""Where a streamed plan keeps the embedding and head (plan/weights.py, mode._placed_weights): held where they fit
beside the batch the job wants, streamed where that carries more sequences a pass for the reads; the floor shown part
by part."""
from __future__ import annotations

import pytest

from batchrun.checkpoint import sizes_from_config
from batchrun.plan import RowCost, format_plan_table
from batchrun.plan.weights import token_matrix_placements
from tests.support import GiB, plan

MiB = 1 << 20
# The 2.4 GB bfloat16 Llama-style checkpoint a user tried: 22 layers, hidden 2048, an untied 49,152-token vocabulary.
LLAMA_2B_CONFIG = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "num_hidden_layers": 22, "vocab_size": 49152,
                   "max_position_embeddings": 2048, "tie_word_embeddings": False}
LLAMA_2B = sizes_from_config(LLAMA_2B_CONFIG, "BF16")
LLAMA_2B_TIED = sizes_from_config({**LLAMA_2B_CONFIG, "tie_word_embeddings": True}, "BF16")
SHORT_ANSWERS = [RowCost(300, 8)] * 32  # the short-answer sweep: ~300 prompt tokens, 8 new tokens
RUNTIME = 400 * MiB


def test_a_budget_of_half_the_checkpoint_streams_the_embedding_and_head_to_carry_the_batch():
    held = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", token_matrices="held", memory_budget_bytes=int(1.17e9),
                runtime_overhead_bytes=RUNTIME)
    auto = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", memory_budget_bytes=int(1.17e9),
                runtime_overhead_bytes=RUNTIME)
    matrix = 49152 * 2048 * 2  # one matrix at bfloat16: 192 MiB
    assert dict(held.memory.memory_floor)["embedding"] == dict(held.memory.memory_floor)["head"] == matrix
    assert auto.memory.token_matrices == "streamed" and auto.fits
    floor = dict(auto.memory.memory_floor)
    assert "embedding" not in floor and "head" not in floor
    chunk_rows = (32 * MiB) // (2048 * 2)  # a 32 MiB chunk of head rows at the compute dtype
    assert floor["head chunk"] == chunk_rows * 2048 * 2  # stored at the compute dtype: read straight into the chunk
    assert floor["runtime"] == RUNTIME
    assert sum(floor.values()) == held.memory.runtime_overhead_bytes + auto.memory.weights_bytes
    # the 384 MiB the matrices held buy sequences: at least 16 a pass against a handful
    assert auto.batching.batch_size >= 16 > held.batching.batch_size
    # every pass reads the head once more
    layers_read = held.time.io_seconds_per_pass * held.time.read_bandwidth_bytes_per_s
    assert auto.time.io_seconds_per_pass * auto.time.read_bandwidth_bytes_per_s == pytest.approx(layers_read + matrix)
    assert "streamed: " in auto.memory.token_matrices_reason and "held: " in auto.memory.token_matrices_reason


def test_a_roomy_budget_keeps_the_matrices_held_and_reads_only_the_layers():
    candidate = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", memory_budget_bytes=8 * GiB,
                     runtime_overhead_bytes=RUNTIME)
    assert candidate.memory.token_matrices == "held"  # every row fits a pass either way: the fewest reads win
    assert candidate.batching.batch_size == 32


def test_a_tied_matrix_is_held_or_streamed_for_both_uses():
    assert [p.word for p in token_matrix_placements(LLAMA_2B_TIED)] == ["held", "streamed"]
    assert [p.word for p in token_matrix_placements(LLAMA_2B)] == ["held", "gathered", "streamed"]
    assert [p.word for p in token_matrix_placements(LLAMA_2B_TIED, "gathered")] == ["held"]
    candidate = plan(LLAMA_2B_TIED, SHORT_ANSWERS, streaming="always", token_matrices="streamed")
    assert "embedding = head (tied)" not in dict(candidate.memory.memory_floor)
    assert "embedding = head (tied)" in dict(plan(LLAMA_2B_TIED, SHORT_ANSWERS, streaming="always",
                                                  token_matrices="held").memory.memory_floor)


def test_the_plan_table_shows_the_floor_part_by_part():
    candidate = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", memory_budget_bytes=int(1.17e9),
                     runtime_overhead_bytes=RUNTIME)
    text = format_plan_table(candidate.to_json())
    floor_line = next(line for line in text.splitlines() if line.startswith("floor"))
    assert "runtime 400 MiB" in floor_line and "head chunk 32.0 MiB" in floor_line and "2 layer slot(s)" in floor_line
    assert "left for sequences" in floor_line
    assert any(line.startswith("token matrices") and "streamed" in line for line in text.splitlines())


def test_a_packed_layer_is_kept_only_where_it_costs_no_sequence():
    tight = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", memory_budget_bytes=int(1.17e9),
                 runtime_overhead_bytes=RUNTIME, packs_weights=True)
    roomy = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", memory_budget_bytes=8 * GiB,
                 runtime_overhead_bytes=RUNTIME, packs_weights=True)
    assert not tight.memory.packs_weights and "packed layer" not in dict(tight.memory.memory_floor)
    roomy_floor = dict(roomy.memory.memory_floor)
    assert roomy.memory.packs_weights and roomy_floor["packed layer"] == roomy_floor["2 layer slot(s)"] // 2


def test_a_head_stored_narrower_than_it_computes_needs_a_read_buffer_and_a_chunk_is_never_larger_than_a_layer():
    widened = plan(LLAMA_2B, SHORT_ANSWERS, streaming="always", token_matrices="streamed", compute_dtype="float32")
    chunk_rows = (32 * MiB) // (2048 * 4)
    assert dict(widened.memory.memory_floor)["head chunk"] == chunk_rows * 2048 * (4 + 2)  # float32 chunk + bf16 read
    small_layers = sizes_from_config({**LLAMA_2B_CONFIG, "intermediate_size": 256, "num_key_value_heads": 1,
                                      "num_attention_heads": 1, "hidden_size": 1024}, "BF16")
    layer = small_layers.largest_layer_params * 2
    assert layer < 32 * MiB
    small = plan(small_layers, SHORT_ANSWERS, streaming="always", token_matrices="streamed")
    assert dict(small.memory.memory_floor)["head chunk"] == layer // (1024 * 2) * 1024 * 2
