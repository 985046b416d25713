"""The measured rates as a pass achieves them: what a host's own streaming and heap cost its compute, and the share
of its cores a decode pass computes on. No torch."""
from __future__ import annotations

from batchrun.checkpoint import CheckpointSizes
from batchrun.plan.timing import host_streaming_bytes
from batchrun.plan.weights import on_host

# host.heap.keep_heap_flat returns every freed activation block to the kernel, so the next one is fresh pages to fault
# and zero. Measured with and without it: a 2.2 GB Llama prefill (32 sequences, resident) 28.6 -> 35.5 s, SmolLM2
# streamed decode passes 0.44 -> 0.53 s, a resident choice pass 2.21 -> 2.56 s: about a fifth slower. Measured
# before keep_heap_flat served activations from a heap trimmed per layer turn, which faults fewer pages (3 GB Llama
# streamed prefill: 4% faster, median of 4 pairs); not re-measured against the unflattened heap, so kept. Since a job
# keeps freed pages while it has room under the plan's peak (host.heap.keep_freed_pages_below) fewer pages are fresh, yet
# the plan still underestimates the pass there (benchmark classification pass, bfloat16: 14.3 s planned, 16.4 s
# measured), so the factor stays.
HOST_FRESH_PAGE_SLOWDOWN = 1.2


def effective_rates(device: str, flops_per_s: float | None,
                    memory_bytes_per_s: float | None) -> tuple[float | None, float | None]:
    """The measured rates as a pass achieves them: on the host, the flat heap's fresh pages slow every pass."""
    if not on_host(device):
        return flops_per_s, memory_bytes_per_s
    slowed = [rate / HOST_FRESH_PAGE_SLOWDOWN if rate else rate for rate in (flops_per_s, memory_bytes_per_s)]
    return slowed[0], slowed[1]


def decode_cores_share(sizes: CheckpointSizes, compute_bytes: int, device: str, mode: str, prefetch: bool,
                       threads: int) -> float:
    """The share of its threads a decode pass computes on. A host streaming with a reader thread decodes on one
    thread fewer, leaving that core to the reader (stream.py); only the linears of a checkpoint stored narrower
    than the compute dtype spread their tiles over every core again (linear_kernels.widening_linear). Measured on 2
    cores, SmolLM2 stored and computed in float32, 16 sequences: 0.18 s a decode pass on one thread against 0.056 s
    resident on two."""
    widens = sizes.decoder_params * compute_bytes > sizes.decoder_bytes
    if mode != "streamed" or not on_host(device) or not prefetch or threads < 2 or widens:
        return 1.0
    return (threads - 1) / threads


def streaming_traffic(sizes: CheckpointSizes, compute_bytes: int, device: str, mode: str) -> tuple[int, int]:
    """The host's RAM traffic of streaming the layers once in a prefill and in a decode pass
    (plan.timing.host_streaming_bytes), which a host pass's compute shares; an accelerator computes beside it."""
    if mode != "streamed" or not on_host(device):
        return 0, 0
    return host_streaming_bytes(sizes, compute_bytes), host_streaming_bytes(sizes, compute_bytes, decode=True)
