"""Importing batchrun bounds the memory torch's native libraries keep per matmul shape and per thread (native_env)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from batchrun.host import NATIVE_DEFAULTS


def _run(script: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in NATIVE_DEFAULTS}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env={**environ, **env}).stdout


def test_importing_batchrun_sets_the_bounds_and_keeps_what_the_user_set():
    script = ("import os, batchrun\n"
              "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['MKL_DISABLE_FAST_MM'])")
    assert _run(script).split() == [NATIVE_DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], "1"]
    assert _run(script, ONEDNN_PRIMITIVE_CACHE_CAPACITY="512", MKL_DISABLE_FAST_MM="0").split() == ["512", "0"]


# A long run meets a new matmul shape with every micro-batch and decode group. Uncapped, oneDNN's and ideep's caches
# kept ~0.57 MB a shape here (200 shapes: +113 MiB); capped, the growth stops at the caps (+27 MiB).
GROWTH_SCRIPT = """
import torch
import batchrun
from batchrun.host import glibc, keep_heap_flat, resident_bytes
from batchrun.runtime.linear_kernels import onednn_available
if not onednn_available() or glibc() is None:
    print("skip"); raise SystemExit
keep_heap_flat()
weight, inputs = torch.randn(2816, 1024), torch.randn(1000, 1024)
linear = lambda rows: torch.ops.mkldnn._linear_pointwise(inputs[:rows], weight, None, "none", [], "")
linear(8)
glibc().malloc_trim(0)
start = resident_bytes()
for rows in range(100, 900, 4):
    linear(rows)
glibc().malloc_trim(0)
print((resident_bytes() - start) >> 20)
"""


def test_matmuls_of_ever_new_shapes_do_not_grow_the_process_without_bound():
    grown = _run(GROWTH_SCRIPT).strip()
    if grown == "skip":
        pytest.skip("no oneDNN linear or no glibc here")
    assert int(grown) < 60, f"200 matmul shapes grew the process by {grown} MiB"
