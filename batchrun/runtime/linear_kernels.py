"""Which kernel runs the model's nn.Linear layers on the CPU: torch's own (`aten`: MKL's sgemm on x86) or oneDNN's
inner product (`onednn`), the library torch already ships for its mkldnn ops.

Why a choice: on some CPUs oneDNN runs float32 linears of the shapes a pass computes markedly faster than aten; on
others (other CPUs, other MKL builds) aten wins, so batchrun.measure times both and the run uses the faster
(BATCHRUN_LINEAR_KERNEL overrides; docs/performance.md#linear-layers). The layers stay transformers' own modules:
only their matmul changes, and only for float32 CPU tensors outside autograd; anything else takes F.linear, a strided
bfloat16 CPU input made contiguous first (dense_if_strided_bfloat16). A weight left at its checkpoint's half
precision under float32 inputs (a streamed decode pass, stream.py) is widened a tile of rows at a time as it is
multiplied (widening_linear). A long bfloat16 prefill multiplies packed copies of a streamed layer's weights
(pack_weights).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from batchrun.errors import SettingRefused

KERNELS = ("aten", "onednn")
KERNEL_ENV = "BATCHRUN_LINEAR_KERNEL"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def kernel_override() -> str | None:
    """The kernel BATCHRUN_LINEAR_KERNEL names, if set; a name it does not know is an error, not a silent default."""
    name = os.environ.get(KERNEL_ENV, "").strip().lower()
    if not name:
        return None
    if name not in KERNELS:
        raise SettingRefused(f"{KERNEL_ENV}={name!r}: expected one of {', '.join(KERNELS)}")
    if name == "onednn" and not onednn_available():
        raise SettingRefused(f"{KERNEL_ENV}=onednn, but this torch has no oneDNN (mkldnn) linear")
    return name


def takes_onednn(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Dense float32 CPU tensors with no gradient to record: what the oneDNN op computes the same as F.linear."""
    tensors = (inputs, weight) if bias is None else (inputs, weight, bias)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.layout == torch.strided for t in tensors)
            and weight.dim() == 2 and inputs.dim() >= 1
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def onednn_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through oneDNN: inputs [..., in] @ weight[out, in].T + bias -> [..., out]. The weight stays in
    torch's plain layout (no reorder: a layer streamed in is used once per micro-batch)."""
    return torch.ops.mkldnn._linear_pointwise(inputs, weight, bias, "none", [], "")


def kernel_linear(kernel: str):
    """The function `kernel` multiplies with, for inputs it takes (takes_onednn): what the measurements time."""
    return onednn_linear if kernel == "onednn" else F.linear


def dense_if_strided_bfloat16(inputs: torch.Tensor) -> torch.Tensor:
    """A strided bfloat16 CPU input made contiguous. transformers hands the head the last position of each sequence
    as a strided view ([b, S, d][:, -1:]), and torch's CPU bfloat16 linear of such an input expands the weight once
    per sequence, far slower and larger than the same rows made contiguous. float32 takes the strided input as it is
    (slower for the head, but its rounding is the reference's). See docs/performance.md#linear-layers."""
    if inputs.dtype == torch.bfloat16 and inputs.device.type == "cpu" and not inputs.is_contiguous():
        return inputs.contiguous()
    return inputs


# The float32 tile a half-precision weight is widened into: small enough to stay in the CPU's caches while its rows
# are multiplied, so the float32 weights never go through RAM; smaller or larger tiles run slower
# (docs/performance.md#widening-tiles).
WIDEN_TILE_BYTES = 2 << 20
# one tile per thread: a forward call never yields inside a linear (runtime/turns.py's greenlets)
_tiles = threading.local()


def takes_widening(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 CPU inputs against a 2-D bfloat16 or float16 CPU weight, with no gradient to record."""
    return (inputs.dtype == torch.float32 and weight.dtype in (torch.bfloat16, torch.float16)
            and inputs.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and weight.layout == torch.strided and not (torch.is_grad_enabled() and inputs.requires_grad))


def thread_buffer(store: threading.local, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """The buffer `store` keeps for this thread: at least `elements` of `dtype`, grown to the largest asked for and
    kept (the old one freed before the larger is allocated)."""
    buffer = getattr(store, "buffer", None)
    if buffer is None or buffer.numel() < elements or buffer.dtype != dtype:
        store.buffer = None
        with torch.inference_mode(False):  # an inference tensor could not be written outside inference mode later
            buffer = store.buffer = torch.empty(elements, dtype=dtype)
    return buffer


def _tile(elements: int, dtype: torch.dtype) -> torch.Tensor:
    return thread_buffer(_tiles, elements, dtype)


# Tile workers: threads that share a widening linear's tiles (sharing_tiles). Set for the forward thread of a pass.
_sharing = threading.local()
_helpers: ThreadPoolExecutor | None = None
_helper_count = 0
_helpers_lock = threading.Lock()


@contextlib.contextmanager
def sharing_tiles(workers: int):
    """Within: widening_linear spreads its tiles over `workers` single-threaded workers (the calling thread and
    helpers), each taking the next tile when done with its last. Why not torch's own threads: a decode pass's tile
    is a small matmul, and OpenMP splits each one across fixed threads that meet at its end; a core taken by the
    layer reader (its page-cache copy) stalls the other thread at every tile, where a worker the reader delays holds
    up no other (docs/performance.md#decode-threads)."""
    previous = getattr(_sharing, "workers", 1)
    _sharing.workers = max(1, workers)
    try:
        yield
    finally:
        _sharing.workers = previous


def _helper_pool(count: int) -> ThreadPoolExecutor:
    """A pool of at least `count` helper threads, kept for the process: a decode pass runs hundreds of linears."""
    global _helpers, _helper_count
    with _helpers_lock:
        if _helpers is None or _helper_count < count:
            if _helpers is not None:
                _helpers.shutdown(wait=False)  # its idle threads exit; work already handed to it still finishes
            _helpers, _helper_count = ThreadPoolExecutor(max_workers=count, thread_name_prefix="batchrun-tiles"), count
        return _helpers


def widening_linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of float32 inputs [..., in] and a half-precision weight [out, in] -> [..., out], computed as if the
    weight were float32: each tile of weight rows is widened (exactly) into a cache-sized float32 buffer and
    multiplied into its columns of the output at once. The weight crosses RAM once, at half the bytes."""
    return tiled_linear(inputs, tuple(weight.shape), lambda start, end, tile: tile.copy_(weight[start:end]), bias)


def tiled_linear(inputs: torch.Tensor, shape: tuple[int, int], fill_rows, bias: torch.Tensor | None = None,
                 row_step: int = 1) -> torch.Tensor:
    """inputs [..., in] times a weight [out, in] that is never whole in memory -> [..., out]: `fill_rows(start, end,
    tile)` writes weight rows start..end-1 into `tile` ([end - start, in] at the inputs' dtype), a cache-sized tile
    at a time, and each tile is multiplied into its columns of the output at once. Tiles are whole `row_step`s of
    rows (a GGUF's q/k heads). The tiles go to the workers sharing_tiles names, each taking the next when done."""
    out_features, in_features = shape
    flat = inputs.reshape(-1, in_features)  # [M, in]
    out = torch.empty(flat.shape[0], out_features, dtype=inputs.dtype)  # [M, out]
    rows = max(1, WIDEN_TILE_BYTES // (in_features * inputs.element_size()))
    rows = max(row_step, rows // row_step * row_step)
    starts = range(0, out_features, rows)
    tiles = iter(starts)  # shared by the workers; next() on a range iterator is atomic under the GIL
    workers = min(getattr(_sharing, "workers", 1), len(starts))

    def multiply_tiles(inference: bool) -> None:
        with torch.inference_mode(inference):
            tile = _tile(min(rows, out_features) * in_features, inputs.dtype)
            for start in tiles:
                end = min(out_features, start + rows)
                filled = tile[:(end - start) * in_features].view(end - start, in_features)
                fill_rows(start, end, filled)
                columns = out[:, start:end]  # a strided view BLAS writes in place (leading dimension out_features)
                if bias is None:
                    torch.mm(flat, filled.t(), out=columns)
                else:
                    torch.addmm(bias[start:end].to(inputs.dtype), flat, filled.t(), out=columns)

    _run_on_workers(multiply_tiles, workers)
    return out.view(*inputs.shape[:-1], out_features)


def _run_on_workers(multiply_tiles, workers: int) -> None:
    """multiply_tiles(inference) on the calling thread and workers - 1 helpers, each single-threaded."""
    inference = torch.is_inference_mode_enabled()
    if workers <= 1:
        multiply_tiles(inference)
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each worker multiplies its tile alone; the helpers start with this count too
    try:
        helped = [_helper_pool(workers - 1).submit(multiply_tiles, inference) for _ in range(workers - 1)]
        try:
            multiply_tiles(inference)
        finally:
            for future in helped:  # all of them, even after a failure: none may still write into `out`
                future.exception()
        for future in helped:
            future.result()
    finally:
        torch.set_num_threads(threads)


# Packing: oneDNN multiplies a bfloat16 weight it has reordered into its own blocked layout faster than torch's plain
# [out, in] one, which its matmul re-blocks on every call, and with the same bits. The reorder itself costs about what
# packing gains over this many rows, so a streamed pass packs a layer once, for all its micro-batches, when it
# multiplies each layer by at least this many rows (stream.run_pass; docs/performance.md#packing).
PACK_MIN_ROWS = 2048


@functools.cache  # asks the CPU once per process
def packing_available() -> bool:
    """Whether this torch's oneDNN packs and multiplies bfloat16 weights on this CPU (AVX512-BF16, AMX...)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and all(hasattr(mkldnn, op) for op in (
        "_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported"))
            and bool(mkldnn._is_mkldnn_bf16_supported()))


def packed_weight_linear(weight: torch.Tensor):
    """inputs -> F.linear(inputs, weight) on a packed copy of `weight`, or None where this CPU packs none: what
    batchrun.measure times against the plain kernel."""
    if not packing_available() or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda inputs: torch.ops.mkldnn._linear_pointwise(inputs, packed, None, "none", [], "")


def _packable(module: torch.nn.Module) -> bool:
    if not isinstance(module, _RoutedLinear):
        return False
    weight, bias = module.weight, module.bias
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.layout == torch.strided
            and (bias is None or bias.dtype == torch.bfloat16))


def pack_weights(module: torch.nn.Module) -> int:
    """Give every routed bfloat16 CPU linear in `module` a packed copy of its weight, used by its forward until
    drop_packed_weights; returns the bytes packed. The plain weight stays: transformers reads its dtype and shape."""
    packed_bytes = 0
    for child in module.modules():
        if _packable(child):
            packed = torch.ops.mkldnn._reorder_linear_weight(child.weight)
            child.__dict__["_packed"] = (child.weight, packed)  # a plain attribute: no parameter, no state dict
            packed_bytes += child.weight.nbytes
    return packed_bytes


def drop_packed_weights(module: torch.nn.Module) -> None:
    for child in module.modules():
        child.__dict__.pop("_packed", None)


def _packed_weight(module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
    """The module's packed weight where it may serve these inputs: packed from the weight the module holds now, and
    bfloat16 CPU inputs outside autograd (oneDNN's op records no gradient)."""
    packed = module.__dict__.get("_packed")
    if (packed is None or packed[0] is not module.weight or inputs.dtype != torch.bfloat16
            or inputs.device.type != "cpu" or (torch.is_grad_enabled() and inputs.requires_grad)):
        return None
    return packed[1]


def _forward(module: torch.nn.Linear, kernel: str, inputs: torch.Tensor) -> torch.Tensor:
    inputs = dense_if_strided_bfloat16(inputs)
    quantized = module.__dict__.get("_quantized")
    if quantized is not None:
        return _quantized_forward(quantized, module, kernel, inputs)
    packed = _packed_weight(module, inputs)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(inputs, packed, module.bias, "none", [], "")
    return _dense_forward(kernel, inputs, module.weight, module.bias)


def _dense_forward(kernel: str, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    if weight.dtype != inputs.dtype and takes_widening(inputs, weight):
        return widening_linear(inputs, weight, bias)
    if kernel == "onednn" and takes_onednn(inputs, weight, bias):
        return onednn_linear(inputs, weight, bias)
    return F.linear(inputs, weight, bias)


# Quantized weights: a linear may hold its weight as a GGUF tensor's blocks (attach_quantized), dequantized as it
# multiplies. A decode pass (multiplying_tile_by_tile) dequantizes a cache-sized tile of rows at a time, so the
# dequantized weight never crosses RAM; every other call dequantizes the whole weight into one buffer kept per
# thread and multiplies it as the resident model multiplies its dequantized weight, with the same bits.
_decoding = threading.local()
_whole = threading.local()


@contextlib.contextmanager
def multiplying_tile_by_tile(enabled: bool = True):
    """Within: linears holding quantized weights dequantize and multiply a tile of rows at a time (decode passes:
    few rows per call; float32 sums in another order than the whole weight's, within 1e-5)."""
    previous = getattr(_decoding, "tiles", False)
    _decoding.tiles = enabled
    try:
        yield
    finally:
        _decoding.tiles = previous


def attach_quantized(module: torch.nn.Module, quantized) -> None:
    """`module` (a routed linear whose weight stays on the meta device) multiplies by `quantized` until
    detach_quantized: an object with .shape ([out, in]), .row_step, .fill(out) and .fill_rows(start, end, out)."""
    module.__dict__["_quantized"] = quantized  # a plain attribute: no parameter, no state dict


def detach_quantized(module: torch.nn.Module) -> None:
    module.__dict__.pop("_quantized", None)


def _quantized_forward(quantized, module: torch.nn.Linear, kernel: str, inputs: torch.Tensor) -> torch.Tensor:
    dtype = module.weight.dtype  # the model's compute dtype: the meta weight's
    if getattr(_decoding, "tiles", False) and inputs.dtype == dtype and inputs.device.type == "cpu":
        return tiled_linear(inputs, quantized.shape, quantized.fill_rows, module.bias, quantized.row_step)
    out_features, in_features = quantized.shape
    weight = thread_buffer(_whole, out_features * in_features, dtype)[:out_features * in_features]
    weight = weight.view(out_features, in_features)
    quantized.fill(weight)
    return _dense_forward(kernel, inputs, weight, module.bias)


class _RoutedLinear(torch.nn.Linear):
    """nn.Linear with its matmul on `kernel`. A module is moved into this class (`__class__`), not given a forward
    attribute: a bound or partial forward stored on the module refers back to it, and that cycle would keep every
    weight of a closed model alive until the cyclic garbage collector runs (docs/performance.md#linear-layers)."""

    kernel = "aten"

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return _forward(self, self.kernel, inputs)


class _AtenLinear(_RoutedLinear):
    kernel = "aten"


class _OneDnnLinear(_RoutedLinear):
    kernel = "onednn"


_ROUTED = {"aten": _AtenLinear, "onednn": _OneDnnLinear}


def routed_weight_names(module: torch.nn.Module) -> frozenset[str]:
    """Names (relative to `module`) of the weights of its routed linears: those that take a narrower weight."""
    return frozenset(f"{name}.weight" if name else "weight" for name, child in module.named_modules()
                     if isinstance(child, _RoutedLinear))


def route_linears(model: torch.nn.Module, kernel: str) -> int:
    """Run every plain nn.Linear of `model` on `kernel` (aten: F.linear); returns how many were routed. Subclasses
    (quantised or otherwise special linears) keep their own forward."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    routed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear or isinstance(module, _RoutedLinear):
            module.__class__ = _ROUTED[kernel]
            routed += 1
    return routed
