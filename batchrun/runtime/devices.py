"""Device and compute-dtype defaults."""
from __future__ import annotations

import torch

from batchrun.errors import SettingRefused
from batchrun.host import auto_compute_dtype

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    """'cuda' (also ROCm builds), 'mps' or 'cpu', whichever torch can use here."""
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def check_device(name: str) -> str:
    """`name` (--device) if torch can compute on it here, else SettingRefused saying why."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise SettingRefused(f"--device {name}: not a device torch knows (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise SettingRefused(f"--device {name}: this torch ({torch.__version__}) cannot use {device.type} here"
                             + (" (a CPU-only build)" if device.type == "cuda" and torch.version.cuda is None
                                else ""))
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise SettingRefused(f"--device {name}: only {count} {device.type} device(s) here")
    return name


def default_dtype(device: str | torch.device, storage_dtype: str | None = None) -> torch.dtype:
    """The dtype `--dtype auto` computes in on `device` (host.compute_dtype; `storage_dtype`: the checkpoint's
    safetensors code, "BF16")."""
    return DTYPE_NAMES[auto_compute_dtype(str(torch.device(device)), storage_dtype)]


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device,
                  storage_dtype: str | None = None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device, storage_dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)} or auto") from None
