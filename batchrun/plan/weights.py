"""Weight memory as named steps: what the weights of a resident or a streamed run hold at the compute dtype. No
torch."""
from __future__ import annotations

from dataclasses import dataclass

from batchrun.checkpoint import DTYPE_BITS, CheckpointSizes
from batchrun.plan.formatting import format_bytes

COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def on_host(device: str) -> bool:
    return device.split(":")[0] == "cpu"


def layer_slot_bytes(sizes: CheckpointSizes, compute_dtype: str) -> int:
    """One streamed layer materialised at the compute dtype."""
    return sizes.largest_layer_params * COMPUTE_BYTES[compute_dtype]


@dataclass(frozen=True)
class Weights:
    bytes: int
    what: str  # the sum spelled out, for reasons and blockers


def resident_weights(sizes: CheckpointSizes, compute_dtype: str) -> Weights:
    total = sizes.total_params * COMPUTE_BYTES[compute_dtype]
    return Weights(total, f"all weights {format_bytes(total)} at {compute_dtype}")


def streamed_weights(sizes: CheckpointSizes, compute_dtype: str, prefetch: bool, device: str = "cpu",
                     prefetch_depth: int = 1, packs_weights: bool = False) -> Weights:
    compute_bytes = COMPUTE_BYTES[compute_dtype]
    slots = prefetch_depth + 1 if prefetch else 1  # the layer computing + those being read ahead
    non_decoder = sizes.non_decoder_params * compute_bytes
    layer_slots = layer_slot_bytes(sizes, compute_dtype) * slots
    # On the host a tensor is read straight into its slot, a narrower one widened there (bf16 -> float32); a raw read
    # buffer (loads take turns, so one) serves a narrowing cast and experts fused at load time. An accelerator's read
    # buffer is pinned host memory, outside the device budget this plan sizes.
    narrowing = COMPUTE_BYTES[compute_dtype] * 8 < DTYPE_BITS.get(sizes.storage_dtype, 0)
    needs_read_buffer = on_host(device) and (narrowing or bool(sizes.moe))
    read_buffers = sizes.largest_layer_bytes if needs_read_buffer else 0
    # Where long prefills pack (measure.packs_weights), they multiply a packed copy of the computing layer's linear
    # weights (linear_kernels.pack_weights), made when the layer starts and freed when it ends: one layer more,
    # counted whatever the rows (they decide per pass whether it packs).
    packed = layer_slot_bytes(sizes, compute_dtype) if packs_weights else 0
    what = (f"non-decoder tensors {format_bytes(non_decoder)} + {slots} layer slot(s) "
            f"{format_bytes(layer_slots)}" + (f" + read buffers {format_bytes(read_buffers)}" if read_buffers else "")
            + (f" + packed layer {format_bytes(packed)}" if packed else ""))
    return Weights(non_decoder + layer_slots + read_buffers + packed, what)
