"""Which kernel runs the model's nn.Linear layers on the CPU: torch's own (`aten`: MKL's sgemm on x86) or oneDNN's
inner product (`onednn`), the library torch already ships for its mkldnn ops.

Why a choice: on an AMD EPYC (AVX-512, 2 cores) oneDNN ran float32 linears of the shapes a pass computes 20-50%
faster than aten (1 thread, 32 rows x 2048 -> 5632: 79 against 52 GFLOP/s; 2 threads, 512 rows: 215 against 175).
Elsewhere (other CPUs, other MKL builds) aten may win, so measure.py times both and the run uses the faster
(BATCHRUN_LINEAR_KERNEL overrides). The layers stay transformers' own modules: only their matmul changes, and only
for float32 CPU tensors outside autograd; anything else takes F.linear as before, a strided bfloat16 CPU input made
contiguous first (dense_if_strided_bfloat16).
"""
from __future__ import annotations

import os

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
    per sequence: 32 sequences x a 8192 x 2048 head measured 2.05 s and +1 GB of memory, against 5 ms contiguous.
    float32 takes the strided input as it is (3x slower for the head, but its rounding is the reference's)."""
    if inputs.dtype == torch.bfloat16 and inputs.device.type == "cpu" and not inputs.is_contiguous():
        return inputs.contiguous()
    return inputs


def _forward(module: torch.nn.Linear, kernel: str, inputs: torch.Tensor) -> torch.Tensor:
    inputs = dense_if_strided_bfloat16(inputs)
    if kernel == "onednn" and takes_onednn(inputs, module.weight, module.bias):
        return onednn_linear(inputs, module.weight, module.bias)
    return F.linear(inputs, module.weight, module.bias)


class _RoutedLinear(torch.nn.Linear):
    """nn.Linear with its matmul on `kernel`. A module is moved into this class (`__class__`), not given a forward
    attribute: a bound or partial forward stored on the module refers back to it, and that cycle kept every weight of
    a closed model alive until the cyclic garbage collector ran (+600 MB after one SmolLM2 job)."""

    kernel = "aten"

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return _forward(self, self.kernel, inputs)


class _AtenLinear(_RoutedLinear):
    kernel = "aten"


class _OneDnnLinear(_RoutedLinear):
    kernel = "onednn"


_ROUTED = {"aten": _AtenLinear, "onednn": _OneDnnLinear}


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
