"""The measured rates as a pass achieves them: what a host's own streaming and heap cost its compute, and the share
of its cores a decode pass computes on. No torch."""
from __future__ import annotations

from batchrun.checkpoint import CheckpointSizes
from batchrun.plan.timing import host_streaming_bytes
from batchrun.plan.weights import on_host

# host.heap.keep_heap_flat returns freed activation blocks to the kernel, so later ones are fresh pages to fault and
# zero: a host pass runs about a fifth slower than its rates alone say. Keeping freed pages under the plan's peak
# (host.heap.keep_freed_pages_below) makes fewer pages fresh, but the passes there still need the factor.
# See docs/performance.md#fresh-pages.
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
    than the compute dtype spread their tiles over every core again (linear_kernels.widening_linear).
    See docs/performance.md#decode-threads."""
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
