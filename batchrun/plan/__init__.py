"""The plan: pure arithmetic over the checkpoint's sizes and the rows' token counts (memory, batching, passes,
time, formatting). No torch.
"""
from batchrun.plan.batching import (GROUP_PREFIX_MIN, MIN_SHARED_PREFIX, RowCost, pack_batches, passes_for,
                                    prefill_groups, shared_prefix_tokens, windows_allow_sharing, with_group_heads,
                                    without_prefix)
from batchrun.plan.formatting import format_bytes, format_comparison, format_duration, format_plan_table
from batchrun.plan.memory import ATTENTION_CHUNK_BYTES
from batchrun.plan.candidate import Candidate
from batchrun.plan.mode import parse_streaming
from batchrun.plan.planner import make_plan
from batchrun.plan.records import Bandwidth, PlanRequest, Rates
from batchrun.plan.refill import admit, refill_schedule, shares_prefix
from batchrun.plan.weights import HEAD_CHUNK_BYTES, TOKEN_MATRIX_CHOICES, held_layer_bytes, streamed_weights

__all__ = ["ATTENTION_CHUNK_BYTES", "Bandwidth", "Candidate", "GROUP_PREFIX_MIN", "HEAD_CHUNK_BYTES",
           "MIN_SHARED_PREFIX", "PlanRequest", "Rates", "RowCost", "TOKEN_MATRIX_CHOICES", "admit", "format_bytes",
           "format_comparison", "format_duration", "format_plan_table", "held_layer_bytes", "make_plan", "pack_batches",
           "parse_streaming", "passes_for", "prefill_groups", "refill_schedule", "shared_prefix_tokens",
           "shares_prefix", "streamed_weights", "windows_allow_sharing", "with_group_heads", "without_prefix"]
