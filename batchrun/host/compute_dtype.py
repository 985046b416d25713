"""The dtype a run computes in when --dtype is auto (the default), one rule for the plan and the runtime: on a CUDA
card bfloat16 where it has bfloat16 units, else float16; on Apple's MPS float16; on a CPU a bfloat16 checkpoint's own
bfloat16 where the CPU multiplies bfloat16 natively, else float32. Torch-free on the CPU, so the plan decides what
the run will do.

Why: transformers loads a checkpoint in its own dtype unless told otherwise (dtype="auto", its default since v5), so
bfloat16 is what the plain in-memory model computes for most open checkpoints. Where the CPU has bfloat16 units
(x86 AVX512-BF16 or AMX), its matmuls run nearly twice as fast as float32's (docs/streaming.md#compute-dtype), a
streamed layer needs no widening, and weights, KV cache and activations take half the memory. Without them torch
emulates bfloat16, far slower than float32, so the CPU stays in float32 there, and for float32 and float16
checkpoints (float16 on a CPU is emulated too).
"""
from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BFLOAT16_FLAGS = ("amx_bf16", "avx512_bf16")  # Linux's names for the x86 features with bfloat16 dot products


@functools.cache
def cpu_bfloat16_feature(cpuinfo: Path = CPUINFO) -> str | None:
    """The feature that gives this CPU bfloat16 matmuls, or None (none of them, or not a Linux x86 machine)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return next((flag for flag in BFLOAT16_FLAGS if flag in flags), None)
    return None


def cpu_auto_dtype(storage_dtype: str | None) -> str:
    """'bfloat16' for a checkpoint stored in bfloat16 (safetensors code BF16) on a CPU with bfloat16 units, else
    'float32'."""
    return "bfloat16" if storage_dtype == "BF16" and cpu_bfloat16_feature() else "float32"


def cpu_auto_reason(storage_dtype: str | None) -> str | None:
    """Why auto chose what it did on this CPU for a bfloat16 checkpoint, for the plan (None: nothing to choose)."""
    feature = cpu_bfloat16_feature()
    if storage_dtype != "BF16":
        return None
    if feature:
        return f"auto: the checkpoint's bfloat16, which this CPU multiplies natively ({feature}); --dtype float32 " \
               "for float32"
    return "auto: float32, as this CPU has no bfloat16 units (AVX512-BF16 or AMX) for the checkpoint's bfloat16"


def auto_compute_dtype(device: str, storage_dtype: str | None) -> str:
    """The dtype `--dtype auto` computes in on `device` ("cpu", "cuda:1", "mps") for a checkpoint stored in
    `storage_dtype` (its safetensors code, "BF16")."""
    kind = device.split(":")[0]  # "cpu:0" is the CPU too
    if kind == "cuda":
        return "bfloat16" if _cuda_has_bfloat16(device) else "float16"
    if kind == "mps":
        return "float16"
    return cpu_auto_dtype(storage_dtype)


def _cuda_has_bfloat16(device: str) -> bool:
    import torch  # a CUDA device was found through torch, so it is loaded already

    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()
