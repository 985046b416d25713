"""The runtime's own cost: what a run holds before its first weight, and how long importing it takes, measured once
per interpreter in a fresh process.
"""
from __future__ import annotations

import hashlib
import subprocess
import sys

from batchrun.measure.cache import cached, store

# Used only when the probe below cannot run: resident set of a CPU process that imported torch and
# transformers' model code, rounded up.
RUNTIME_OVERHEAD_FALLBACK_BYTES = 700 << 20


# What a run holds before its first weight: everything the executor imports, torch's kernels and thread pools
# warmed by a forward pass (with KV cache) of a model too small to count, and oneDNN's and ideep's kernel caches
# filled to their caps (native_env) as a long run fills them, one matmul shape at a time.
_RUNTIME_PROBE = (
    "import time\n"
    "began = time.perf_counter()\n"
    "import resource, sys, torch\n"
    "import batchrun.job.execute\n"
    "from batchrun.runtime.linear_kernels import onednn_available\n"
    "from batchrun.host.native_env import KERNEL_CACHE_CAPACITY\n"
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
    "imported = time.perf_counter() - began\n"
    "config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,\n"
    "                     num_key_value_heads=2, vocab_size=256)\n"
    "with torch.inference_mode():\n"
    "    LlamaForCausalLM(config).eval()(input_ids=torch.ones((2, 64), dtype=torch.long), use_cache=True)\n"
    "    weight, onednn = torch.randn(512, 512), onednn_available()\n"
    "    for rows in range(1, 2 * KERNEL_CACHE_CAPACITY + 1):\n"
    "        if onednn:\n"
    "            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 512), weight, None, 'none', [], '')\n"
    "        torch.nn.functional.linear(torch.randn(rows, 512, dtype=torch.bfloat16), weight.bfloat16())\n"
    # VmHWM belongs to this process's own address space; ru_maxrss would carry over the parent's peak across
    # fork + exec (Linux keeps it), e.g. a parent that has just converted the default model.
    "try:\n"
    "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
    "    peak = int(hwm.split()[1]) * 1024\n"
    "except (OSError, IndexError):\n"
    "    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "    peak = peak if sys.platform == 'darwin' else peak * 1024\n"  # macOS reports bytes, Linux KiB
    "print(peak, imported)\n"
)


def runtime_overhead_bytes() -> int:
    """Peak resident memory of a fresh Python that imported torch and transformers' model code: what a run costs
    before any weight. Measured once per interpreter in a subprocess; RUNTIME_OVERHEAD_FALLBACK_BYTES if the
    probe fails."""
    entry = _runtime_probe()
    return entry["bytes"] if entry else RUNTIME_OVERHEAD_FALLBACK_BYTES


def runtime_import_seconds() -> float | None:
    """Seconds a fresh Python takes to import what a run imports (torch, transformers' model code, the executor):
    the start of every `batchrun submit`, which a small job's ETA must count. None if the probe fails."""
    entry = _runtime_probe()
    return entry.get("import_seconds") if entry else None


def _runtime_probe() -> dict | None:
    entry = cached("runtime_overhead", sys.executable)
    if entry and entry.get("probe") == _probe_digest():  # a changed probe measures again
        return entry
    try:
        probe = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True,
                               timeout=300, check=True)
        peak, imported = probe.stdout.split()[-2:]
        entry = {"bytes": int(peak), "import_seconds": float(imported), "probe": _probe_digest()}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    store("runtime_overhead", sys.executable, entry)
    return entry


def _probe_digest() -> str:
    return hashlib.sha256(_RUNTIME_PROBE.encode()).hexdigest()[:16]
