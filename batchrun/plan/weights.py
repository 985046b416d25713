"""Weight memory as named steps: what the weights of a resident or a streamed run hold at the compute dtype. No
torch."""
from __future__ import annotations

from dataclasses import dataclass

from batchrun.checkpoint import DTYPE_BITS, CheckpointSizes
from batchrun.plan.formatting import format_bytes

COMPUTE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A streamed head is read and multiplied this many bytes of rows at a time (at the compute dtype): large reads, small
# next to a decoder layer (runtime/token_matrices.py).
HEAD_CHUNK_BYTES = 32 << 20


def on_host(device: str) -> bool:
    return device.split(":")[0] == "cpu"


def layer_slot_bytes(sizes: CheckpointSizes, compute_dtype: str) -> int:
    """One streamed layer materialised at the compute dtype."""
    return sizes.largest_layer_params * COMPUTE_BYTES[compute_dtype]


def holds_blocks(sizes: CheckpointSizes, device: str) -> bool:
    """Whether a streamed layer holds its matrices as their GGUF blocks (on the host), dequantized as they multiply
    (runtime.linear_kernels), rather than at the compute dtype."""
    return sizes.file_format == "gguf" and on_host(device) and bool(sizes.layer_vector_params)


def held_layer_bytes(sizes: CheckpointSizes, compute_dtype: str, device: str = "cpu") -> int:
    """What one streamed layer's slot holds: the layer at the compute dtype, or a GGUF layer's matrices as stored
    and its norms and biases at the compute dtype."""
    if not holds_blocks(sizes, device):
        return layer_slot_bytes(sizes, compute_dtype)
    compute_bytes = COMPUTE_BYTES[compute_dtype]
    return max(stored - vector_bytes + vector_params * compute_bytes for stored, vector_bytes, vector_params
               in zip(sizes.layer_bytes, sizes.layer_vector_bytes, sizes.layer_vector_params))


# A decode pass's linears dequantize tiles of this size, one per worker (runtime.linear_kernels.WIDEN_TILE_BYTES).
DEQUANTIZE_TILE_BYTES = 2 << 20
TILE_WORKERS = 2


def dequantized_weight_bytes(sizes: CheckpointSizes, compute_dtype: str) -> int:
    """What dequantizing a held GGUF layer's matrices takes beside it: the largest matrix whole at the compute dtype
    (a prefill's or a scoring pass's linear) and the decode passes' tiles."""
    largest = max((rows * columns for rows, columns in sizes.layer_matrices), default=0)
    return largest * COMPUTE_BYTES[compute_dtype] + DEQUANTIZE_TILE_BYTES * TILE_WORKERS


@dataclass(frozen=True)
class Weights:
    bytes: int
    what: str  # the sum spelled out, for reasons and blockers
    parts: tuple[tuple[str, int], ...] = ()  # (part, bytes) of the sum, for the plan's memory floor


@dataclass(frozen=True)
class TokenMatrices:
    """Where a streamed run keeps the embedding and the LM head: held, or read as passes need them (a pass's embedding
    rows gathered by token id; the head read once a pass, a chunk at a time). A tied checkpoint's one matrix is held,
    or streamed for both uses."""
    gather_embeddings: bool = False
    stream_head: bool = False

    @property
    def word(self) -> str:
        return "streamed" if self.stream_head else "gathered" if self.gather_embeddings else "held"


HELD = TokenMatrices()
# Ordered by what each reads a pass beyond the layers: nothing, a pass's embedding rows, the head besides.
TOKEN_MATRIX_PLACEMENTS = {"held": HELD, "gathered": TokenMatrices(gather_embeddings=True),
                           "streamed": TokenMatrices(gather_embeddings=True, stream_head=True)}


TOKEN_MATRIX_CHOICES = ("auto", *TOKEN_MATRIX_PLACEMENTS)


def token_matrix_placements(sizes: CheckpointSizes, asked: str = "auto") -> list[TokenMatrices]:
    """The placements a plan weighs, cheapest reads first: `asked` alone, or every one (auto). A tied matrix is held
    for both uses or streamed for both: gathering embedding rows from a matrix the head holds saves nothing."""
    if asked != "auto":
        placement = TOKEN_MATRIX_PLACEMENTS[asked]
        return [HELD if sizes.tied_embeddings and placement.word == "gathered" else placement]
    return [p for word, p in TOKEN_MATRIX_PLACEMENTS.items() if not (sizes.tied_embeddings and word == "gathered")]


def token_matrix_bytes(sizes: CheckpointSizes, head: bool = False) -> int:
    """One [vocab, hidden] matrix as stored: the embedding, or the head (a GGUF stores each in its own type)."""
    stored = sizes.head_bytes if head else sizes.embedding_bytes
    if stored is not None:
        return stored
    return sizes.vocab_size * sizes.hidden_size * DTYPE_BITS.get(sizes.storage_dtype, 16) // 8


def head_read_bytes(sizes: CheckpointSizes, placement: TokenMatrices) -> int:
    """What a pass reads beyond its layers: the head, where it streams (embedding rows are a pass's tokens' alone)."""
    return token_matrix_bytes(sizes, head=True) if placement.stream_head else 0


def _token_matrix_parts(sizes: CheckpointSizes, compute_dtype: str, placement: TokenMatrices,
                        device: str) -> list[tuple[str, int]]:
    """What the token matrices hold in a streamed run, part by part: each matrix held at the compute dtype, or a
    streamed head's chunk and its read buffer (as stored); other tensors outside the layers (final norm, biases)."""
    compute_bytes = COMPUTE_BYTES[compute_dtype]
    matrix = sizes.vocab_size * sizes.hidden_size
    matrices = 1 if sizes.tied_embeddings else 2
    other = max(sizes.non_decoder_params - matrices * matrix, 0) * compute_bytes
    parts: list[tuple[str, int]] = []
    if sizes.tied_embeddings:
        if not placement.stream_head:
            parts.append(("embedding = head (tied)", matrix * compute_bytes))
    else:
        if not placement.gather_embeddings:
            parts.append(("embedding", matrix * compute_bytes))
        if not placement.stream_head:
            parts.append(("head", matrix * compute_bytes))
    if placement.stream_head:
        # a chunk no larger than a layer; stored at another dtype (or bound for an accelerator) it is read into a
        # buffer of its own first
        chunk_bytes = min(HEAD_CHUNK_BYTES, layer_slot_bytes(sizes, compute_dtype))
        chunk_rows = min(sizes.vocab_size, max(1, chunk_bytes // (sizes.hidden_size * compute_bytes)))
        stored_bytes = DTYPE_BITS.get(sizes.storage_dtype, 16) // 8
        read_buffer = stored_bytes if stored_bytes != compute_bytes or not on_host(device) else 0
        if sizes.file_format == "gguf":  # blocks read into a buffer (no more than 2 bytes a weight), decoded in float32
            read_buffer = 2 + 4
        parts.append(("head chunk", chunk_rows * sizes.hidden_size * (compute_bytes + read_buffer)))
    if other:
        parts.append(("other non-decoder", other))
    return parts


def resident_weights(sizes: CheckpointSizes, compute_dtype: str) -> Weights:
    total = sizes.total_params * COMPUTE_BYTES[compute_dtype]
    return Weights(total, f"all weights {format_bytes(total)} at {compute_dtype}", (("all weights", total),))


def streamed_weights(sizes: CheckpointSizes, compute_dtype: str, prefetch: bool, device: str = "cpu",
                     prefetch_depth: int = 1, packs_weights: bool = False,
                     placement: TokenMatrices = HELD) -> Weights:
    slots = prefetch_depth + 1 if prefetch else 1  # the layer computing + those being read ahead
    outside = _token_matrix_parts(sizes, compute_dtype, placement, device)
    layer_slots = held_layer_bytes(sizes, compute_dtype, device) * slots
    # On the host a tensor is read straight into its slot, a narrower one widened there (bf16 -> float32); a raw read
    # buffer (loads take turns, so one) serves a narrowing cast and experts fused at load time. An accelerator's read
    # buffer is pinned host memory, outside the device budget this plan sizes.
    # A GGUF layer's blocks are read into that buffer and dequantized from it into the slot, except on the host,
    # where its matrices' blocks are read into the slot as they lie and only its norms and biases pass the buffer.
    narrowing = COMPUTE_BYTES[compute_dtype] * 8 < DTYPE_BITS.get(sizes.storage_dtype, 0)
    needs_read_buffer = (on_host(device) and (narrowing or bool(sizes.moe))) or sizes.file_format == "gguf"
    read_buffers = sizes.largest_layer_bytes if needs_read_buffer else 0
    dequantizing = 0
    if holds_blocks(sizes, device):
        read_buffers = max(sizes.layer_vector_bytes)
        dequantizing = dequantized_weight_bytes(sizes, compute_dtype)
    # Where long prefills pack (measure.packs_weights), they multiply a packed copy of the computing layer's linear
    # weights (linear_kernels.pack_weights), made when the layer starts and freed when it ends: one layer more,
    # counted whatever the rows (they decide per pass whether it packs). Matrices held as blocks are never packed.
    packed = layer_slot_bytes(sizes, compute_dtype) if packs_weights and not holds_blocks(sizes, device) else 0
    parts = [*outside, (f"{slots} layer slot(s)", layer_slots), ("read buffers", read_buffers),
             ("dequantized weight", dequantizing), ("packed layer", packed)]
    parts = [(name, size) for name, size in parts if size]
    what = " + ".join(f"{name} {format_bytes(size)}" for name, size in parts)
    return Weights(sum(size for _, size in parts), what, tuple(parts))
