"""Which machine a cached measurement belongs to. No torch.

A state directory outlives the machine it was measured on: a home directory shared over NFS by cluster nodes of
different kinds, a cloud disk attached to another instance type, a CI cache restored elsewhere; and two machines'
rates, even their faster linear kernel, can differ several times over (docs/planning.md#time). So every cached
figure carries the identity of what it measured, and a figure whose identity differs from this machine's is
measured again.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
MOUNTINFO = Path("/proc/self/mountinfo")
# /proc/cpuinfo names the processor under one of these, depending on the architecture (x86 first, then ARM's).
CPU_NAME_FIELDS = ("model name", "Hardware", "CPU part")


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The processor's name as the kernel reports it; the platform's own description where /proc says nothing."""
    try:
        lines = cpuinfo.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for field in CPU_NAME_FIELDS:
        for line in lines:
            name, _, value = line.partition(":")
            if name.strip() == field and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def package_version(name: str) -> str | None:
    """An installed distribution's version, read from its metadata (no import)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_identity() -> dict:
    """The processor and the cores a measurement ran on."""
    return {"cpu": cpu_model(), "cores": usable_cores()}


def kernels_identity() -> dict:
    """The host plus the torch build whose kernels computed: a torch upgrade can change a matmul's speed and kernel."""
    return {**host_identity(), "torch": package_version("torch")}


def filesystem_source(device: int, mountinfo: Path = MOUNTINFO) -> str | None:
    """"<type> <source>" of the mount whose device number is `device` (e.g. "ext4 /dev/nvme0n1p1"), None where
    /proc does not say. Two machines can number different disks alike; their mounts' sources tell them apart more
    often."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        lines = mountinfo.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, tail = line.partition(" - ")
        numbers = fields.split()
        described = tail.split()
        if len(numbers) > 2 and numbers[2] == wanted and len(described) >= 2:
            return f"{described[0]} {described[1]}"
    return None


def disk_identity(device: int) -> dict:
    """The processor (which machine) and the mount a read bandwidth was measured on; not the cores, which a run
    under another affinity mask changes without changing the disk."""
    return {"cpu": cpu_model(), "filesystem": filesystem_source(device)}
