"""The runtime's own cost: what a run holds before its first weight, and how long importing it takes, measured once
per interpreter in a fresh process.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import subprocess
import sys

from batchrun.measure import cache
from batchrun.measure.cache import cached, dispute, store

log = logging.getLogger(__name__)

# A run whose first pass peaks this many times over its plan disputes the cached runtime figure: the plan counted
# too little somewhere, and the runtime, measured once and cached for good, is the part a changed machine (a
# library upgraded in place, other native settings) can leave wrong without anything noticing.
PEAK_DISPUTED_BEYOND = 1.25
# Used only when the probe below cannot run: resident set of a CPU process that imported torch and
# transformers' model code, rounded up.
RUNTIME_OVERHEAD_FALLBACK_BYTES = 700 << 20
# The import time an ETA counts is the median of this many recent `submit` starts (the probe's own among them),
# so neither a cold first start after a boot nor one quick start moves it alone.
IMPORT_OBSERVATIONS_KEPT = 5


# What a run holds before its first weight: everything the executor imports, torch's kernels and thread pools
# warmed by a forward pass (with KV cache) of a model too small to count, and the kernel caches of its dtype's
# linears filled to their caps (native_env) as a long run fills them, one matmul shape at a time: oneDNN's for
# float32 linears, ideep's for half-precision ones. Each cache's growth is printed apart: a run fills only its own
# (docs/planning.md#the-memory-floor).
_RUNTIME_PROBE = (
    "def peak():\n"
    # VmHWM belongs to this process's own address space; ru_maxrss would carry over the parent's peak across
    # fork + exec (Linux keeps it), e.g. a parent that has just converted the default model.
    "    try:\n"
    "        hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
    "        return int(hwm.split()[1]) * 1024\n"
    "    except (OSError, IndexError):\n"
    "        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "        return maxrss if sys.platform == 'darwin' else maxrss * 1024\n"  # macOS reports bytes, Linux KiB
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
    "    warmed = peak()\n"
    "    for rows in range(1, 2 * KERNEL_CACHE_CAPACITY + 1):\n"
    "        if onednn:\n"
    "            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 512), weight, None, 'none', [], '')\n"
    "    full_width = peak()\n"
    "    for rows in range(1, 2 * KERNEL_CACHE_CAPACITY + 1):\n"
    "        torch.nn.functional.linear(torch.randn(rows, 512, dtype=torch.bfloat16), weight.bfloat16())\n"
    "print(peak(), imported, full_width - warmed, peak() - full_width)\n"
)


def runtime_overhead_bytes(compute_dtype: str | None = None) -> int:
    """Peak resident memory of a fresh Python that imported torch and transformers' model code: what a run costs
    before any weight. Measured once per interpreter in a subprocess; RUNTIME_OVERHEAD_FALLBACK_BYTES if the
    probe fails. `compute_dtype`: a run computing in it fills only its own linears' kernel cache, so the other's
    is left out (None: both counted)."""
    entry = _runtime_probe()
    if not entry:
        return RUNTIME_OVERHEAD_FALLBACK_BYTES
    other_cache = {"float32": "half_kernel_bytes", "bfloat16": "float32_kernel_bytes",
                   "float16": "float32_kernel_bytes"}.get(compute_dtype or "")
    return entry["bytes"] - entry.get(other_cache, 0) if other_cache else entry["bytes"]


def runtime_import_seconds() -> float | None:
    """Seconds a fresh Python takes to import what a run imports (torch, transformers' model code, the executor):
    the start of every `batchrun submit`, which a small job's ETA must count. None if the probe fails."""
    entry = _runtime_probe()
    return entry.get("import_seconds") if entry else None


def judge_runtime_overhead(peak_bytes: int, planned_bytes: int, *, job: str) -> bool:
    """A run's first pass peaked at `peak_bytes` where the plan said `planned_bytes`: beyond PEAK_DISPUTED_BEYOND the
    cached runtime figure is disputed and the next plan probes it again (a probe that agrees changes nothing).
    Returns whether it was disputed."""
    if peak_bytes <= planned_bytes * PEAK_DISPUTED_BEYOND:
        return False
    evidence = {"job": job, "peak_bytes": peak_bytes, "planned_peak_bytes": planned_bytes}
    disputed = dispute("runtime_overhead", sys.executable, evidence)
    if disputed:
        log.info("the first pass peaked at %d MB where the plan said %d MB: the runtime's memory is measured again "
                 "at the next plan", peak_bytes // 10**6, planned_bytes // 10**6)
    return disputed


def record_runtime_import(seconds: float) -> float | None:
    """This command took `seconds` to import what a run imports: it joins the cached figure's recent observations,
    and the figure becomes their median (the next ETA counts it). The measured memory is left alone: timing a start
    needs no probe, and a probe re-run inside a run's memory cap could cost the run its memory. Returns the new
    figure, or None where nothing is cached yet (the first plan probes)."""
    measurements = cache.load()
    entry = measurements.get("runtime_overhead", {}).get(sys.executable)
    if entry is None or cached("runtime_overhead", sys.executable) is None or entry.get("probe") != _probe_digest():
        return None
    probed = [entry["import_seconds"]] if entry.get("import_seconds") is not None else []
    observed = [*entry.get("import_observed", probed), round(seconds, 3)]
    entry["import_observed"] = observed[-IMPORT_OBSERVATIONS_KEPT:]
    entry["import_seconds"] = statistics.median(entry["import_observed"])
    cache.write(measurements)
    return entry["import_seconds"]


def runtime_import_seconds_cached() -> float | None:
    """The cached import time, without probing where there is none."""
    entry = cached("runtime_overhead", sys.executable)
    return entry.get("import_seconds") if entry and entry.get("probe") == _probe_digest() else None


def _runtime_probe() -> dict | None:
    entry = cached("runtime_overhead", sys.executable)
    if entry and entry.get("probe") == _probe_digest():  # a changed probe measures again
        return entry
    try:
        probe = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True,
                               timeout=300, check=True)
        peak, imported, *caches = probe.stdout.split()
        entry = {"bytes": int(peak), "import_seconds": float(imported), "probe": _probe_digest()}
        if len(caches) == 2:
            entry.update(float32_kernel_bytes=max(int(caches[0]), 0), half_kernel_bytes=max(int(caches[1]), 0))
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    store("runtime_overhead", sys.executable, entry)
    return entry


def _probe_digest() -> str:
    return hashlib.sha256(_RUNTIME_PROBE.encode()).hexdigest()[:16]
