"""Memory and disk a run may use now: /proc/meminfo, memory cgroups (v1 and v2) and the filesystem."""
from __future__ import annotations

import shutil

import pytest

from batchrun.host import memory as available


def test_host_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert available.host_available_bytes(meminfo) == 20_000_000 * 1024
    assert available.host_available_bytes(tmp_path / "absent") is None


def cgroup_v1(root, path: str, levels: dict[str, tuple[int, int, int]]):
    """levels: relative cgroup dir -> (limit, usage, inactive page cache)."""
    for directory, (limit, usage, inactive) in levels.items():
        folder = root / "memory" / directory
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (folder / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {inactive}\n")
    proc = root / "proc-cgroup"
    proc.write_text(f"9:name=systemd:/\n4:memory:{path}\n1:cpu:/\n0::/\n")
    return proc


def test_cgroup_v1_headroom_is_the_tightest_limit_minus_working_set(tmp_path):
    unlimited = 9223372036854771712
    proc = cgroup_v1(tmp_path, "/jobs/me", {
        "": (unlimited, 50 << 30, 0),
        "jobs": (8 << 30, 3 << 30, 0),
        "jobs/me": (4 << 30, 2 << 30, 1 << 30),  # 1 GiB of the usage is reclaimable page cache
    })
    assert available.cgroup_headroom_bytes(proc, tmp_path) == (4 << 30) - (1 << 30)


def test_unlimited_cgroup_means_no_cgroup_limit(tmp_path):
    proc = cgroup_v1(tmp_path, "/", {"": (9223372036854771712, 1 << 30, 0)})
    assert available.cgroup_headroom_bytes(proc, tmp_path) is None


def test_cgroup_v2_memory_max(tmp_path):
    folder = tmp_path / "user.slice" / "job"
    folder.mkdir(parents=True)
    (folder / "memory.max").write_text("2147483648\n")
    (folder / "memory.current").write_text("1073741824\n")
    (folder / "memory.stat").write_text("anon 1\ninactive_file 536870912\n")
    (tmp_path / "user.slice" / "memory.max").write_text("max\n")
    (tmp_path / "user.slice" / "memory.current").write_text("1073741824\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/user.slice/job\n")
    assert available.cgroup_headroom_bytes(proc, tmp_path) == 2147483648 - (1073741824 - 536870912)


def test_available_host_memory_is_positive_and_within_meminfo():
    memory = available.available_memory_bytes("cpu")
    assert 0 < memory <= available.host_available_bytes() + (64 << 20)  # meminfo moves between the two reads


def test_disk_free_for_a_path_not_yet_created_is_its_filesystem_free_space(tmp_path):
    free = available.disk_free_bytes(tmp_path / "hub" / "models--acme--big")
    assert free == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
