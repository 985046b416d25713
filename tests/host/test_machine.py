"""The identity cached measurements carry: which processor, cores, torch build and disk they measured."""
from __future__ import annotations

import os
import sys

import pytest

from batchrun.host import machine

X86_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu avx512f amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Processor
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 50.00
CPU implementer\t: 0x41
CPU part\t: 0xd0c
"""


def test_the_processor_is_named_from_cpuinfo_on_x86_and_arm(tmp_path):
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text(X86_CPUINFO)
    arm.write_text(ARM_CPUINFO)
    assert machine.cpu_model(x86) == "Intel(R) Xeon(R) Processor"
    assert machine.cpu_model(arm) == "0xd0c"


def test_without_cpuinfo_the_platform_names_the_processor(tmp_path):
    name = machine.cpu_model(tmp_path / "absent")
    assert name and name != "Intel(R) Xeon(R) Processor"


def test_a_device_number_is_traced_to_its_mount_source(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
        "30 22 0:52 / /home rw,relatime shared:9 - nfs4 fileserver:/export/home rw,vers=4.2\n")
    assert machine.filesystem_source(os.makedev(254, 1), mountinfo) == "ext4 /dev/vda1"
    assert machine.filesystem_source(os.makedev(0, 52), mountinfo) == "nfs4 fileserver:/export/home"
    assert machine.filesystem_source(os.makedev(8, 3), mountinfo) is None
    assert machine.filesystem_source(os.makedev(254, 1), tmp_path / "absent") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mountinfo is Linux's")
def test_this_machines_disk_and_kernels_are_identified(tmp_path):
    assert machine.filesystem_source(os.stat(tmp_path).st_dev) is not None
    identity = machine.kernels_identity()
    assert identity["cores"] >= 1 and identity["cpu"]
    assert identity["torch"] == machine.package_version("torch") is not None
    assert machine.package_version("no-such-distribution-batchrun") is None
