"""What a run may use now: memory (free accelerator memory; on the host MemAvailable, lowered to the headroom of
the process's memory cgroup) and disk. Read from the OS at each call, never cached: unlike the rates in
batchrun.measure, they change from run to run.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def available_memory_bytes(device: str = "cpu") -> int:
    """Memory a run may use: free device memory on an accelerator; on the host, MemAvailable, lowered to the
    headroom of this process's memory cgroup when that is smaller."""
    kind = device.split(":")[0]
    if kind == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    if kind == "mps":  # unified memory: the OS-recommended working set, less what torch already holds
        import torch

        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    host = host_available_bytes()
    headroom = cgroup_headroom_bytes()
    candidates = [value for value in (host, headroom) if value is not None]
    if not candidates:
        raise OSError("cannot tell the available memory (no /proc/meminfo); pass a memory budget")
    return min(candidates)


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_cgroups(proc_cgroup: Path = PROC_CGROUP) -> list[tuple[str, str]]:
    """This process's memory cgroups from /proc/self/cgroup, as ("v1" or "v2", path inside the hierarchy): the v1
    `memory` controller's line and the v2 unified one (both on a hybrid system); empty where the file is missing."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _hierarchy, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append(("v2", path))
        elif "memory" in controllers.split(","):
            found.append(("v1", path))
    return found


def cgroup_headroom_bytes(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int | None:
    """Limit minus working set (usage less inactive page cache, which the kernel reclaims first) of this
    process's memory cgroup and its ancestors, v1 or v2; None when no limit applies."""
    headrooms = []
    for version, path in memory_cgroups(proc_cgroup):
        if version == "v2":  # mounted at root, or root/unified on hybrid systems
            for mount in (root, root / "unified"):
                headrooms += _headrooms(mount, path, "memory.max", "memory.current", "inactive_file")
        else:
            headrooms += _headrooms(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                    "total_inactive_file")
    return min(headrooms) if headrooms else None


def _headrooms(mount: Path, path: str, limit_name: str, usage_name: str, inactive_key: str) -> list[int]:
    found = []
    directory = mount / path.lstrip("/")
    while True:
        limit = _read_int(directory / limit_name)
        usage = _read_int(directory / usage_name)
        if limit is not None and usage is not None and limit < _UNLIMITED:
            inactive = _stat_value(directory / "memory.stat", inactive_key)
            found.append(max(limit - (usage - inactive), 0))
        if directory == mount or mount not in directory.parents:
            return found
        directory = directory.parent


def _read_int(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" = no limit


def _stat_value(file: Path, key: str) -> int:
    try:
        for line in file.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def disk_free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds (or will hold) `path`."""
    existing = Path(path).expanduser().absolute()
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory (VmHWM: its own, not a parent's carried across exec as ru_maxrss is);
    None where the system does not say."""
    return _own_status_bytes("VmHWM:")


def reset_peak_resident() -> bool:
    """Count this process's peak resident memory (VmHWM) again from what it holds now (Linux 4.0 and later), so a
    one-off that peaked before (converting a model) is not taken for the run's peak; False where the system does not
    allow it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def anonymous_resident_bytes() -> int | None:
    """This process's resident anonymous memory (RssAnon: its heap and the like, not the files it maps), None where
    the system does not say. What it holds of a memory cgroup's working set for certain: mapped files are page
    cache, which the cgroup may count as reclaimable."""
    return _own_status_bytes("RssAnon:")


def _own_status_bytes(field: str) -> int | None:
    """A figure of /proc/self/status given in kB, in bytes; None where the system does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            line = next(line for line in status if line.startswith(field))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), None where the system does not say."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
