"""What the plan must learn from this machine: cold read bandwidth of the checkpoint's disk, compute rate and the
runtime's own memory (the memory and disk available now are read in available.py). Measurements are cached in
state_dir()/measurements.json, each with the identity of what it measured (machine.py). Importing this module
imports no torch; only measuring compute does.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from batchrun import machine
from batchrun.native_env import NATIVE_DEFAULTS
from batchrun.paths import state_dir
from batchrun.plan import Bandwidth
from batchrun.plan_format import format_bytes

MEASUREMENTS_FILE = "measurements.json"
READ_CHUNK_BYTES = 16 << 20  # large sequential reads, like a streamer reading a layer
# Reads smaller than this measure latency and caches more than bandwidth: reported, but not cached as the
# figure for the whole filesystem.
MIN_CACHED_SAMPLE_BYTES = 64 << 20
# A matmul shaped like a batch of a few hundred tokens through a 2k-wide layer (median of COMPUTE_REPEATS).
COMPUTE_SHAPE = (256, 2048, 2048)
COMPUTE_REPEATS = 9
PACKED = "packed"  # the packed-weight kernel's name among those timed (linear_kernels.packed_weight_linear)
# A decode step: a few sequences through weights much larger than the CPU caches, so the matmul runs at the speed
# the weights stream from RAM, not at COMPUTE_SHAPE's rate. Several matrices in turn, so none is cached on a repeat.
DECODE_SHAPE = (8, 2048, 8192)
DECODE_MATRICES = 4
# Row counts at which a checkpoint's own layer matrices are timed (decode_rates); a pass's rows interpolate.
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
SHAPES_SEPARATOR = "|"  # decode keys: "<compute key>|<digest of the layer's shapes>"
# Used only when the probe below cannot run: resident set of a CPU process that imported torch and
# transformers' model code, rounded up.
RUNTIME_OVERHEAD_FALLBACK_BYTES = 700 << 20
# What a run holds before its first weight: everything the executor imports, torch's kernels and thread pools
# warmed by a forward pass (with KV cache) of a model too small to count, and oneDNN's and ideep's kernel caches
# filled to their caps (native_env) as a long run fills them, one matmul shape at a time.
_RUNTIME_PROBE = (
    "import resource, sys, torch\n"
    "import batchrun.execute\n"
    "from batchrun.linear_kernels import onednn_available\n"
    "from batchrun.native_env import KERNEL_CACHE_CAPACITY\n"
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
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
    "    print(int(hwm.split()[1]) * 1024)\n"
    "except (OSError, IndexError):\n"
    "    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "    print(peak if sys.platform == 'darwin' else peak * 1024)\n"  # macOS reports bytes, Linux KiB
)


# ---------------------------------------------------------------------------------------------------------------
# Read bandwidth


def measure_read_bandwidth(path: Path, max_bytes: int = 1 << 30) -> Bandwidth:
    """Cold sequential read rate of the storage holding `path` (a checkpoint directory: its weight files in order),
    read the way the streamer reads a layer (loader.py): large positional reads through the page cache, each file's
    pages dropped before it is read and each chunk's after. The kernel's readahead keeps several requests in flight;
    O_DIRECT at one request at a time measured a third slower than those reads on the same disk (1.02 vs 1.58 GB/s,
    medians of 4), so it would understate what a pass can read. Cached per filesystem."""
    files = _weight_files(Path(path))
    seconds, read, files_read = _timed_reads_after_dropping_cache(files, max_bytes)
    if read == 0:
        raise ValueError(f"{path}: empty file(s), nothing to measure")
    where = str(files[0]) if files_read == 1 else f"{files_read} files from {files[0].parent}"
    how = f"sequential reads after posix_fadvise(DONTNEED) of {format_bytes(read)} ({where})"
    if not hasattr(os, "posix_fadvise"):
        how += " (this platform cannot drop cached pages: the rate may include them)"
    bytes_per_s = read / max(seconds, 1e-9)
    if read >= MIN_CACHED_SAMPLE_BYTES:
        _store("bandwidth", str(os.stat(files[0]).st_dev), {"bytes_per_s": bytes_per_s, "how": how,
                                                             "bytes_read": read})
    else:
        how += " (sample too small to cache for this filesystem)"
    return Bandwidth(bytes_per_s, "measured", how)


def cached_bandwidth(path: Path) -> Bandwidth | None:
    """The bandwidth measured earlier on the filesystem holding `path`, if any."""
    entry = _cached("bandwidth", str(os.stat(path).st_dev))
    if entry is None:
        return None
    return Bandwidth(entry["bytes_per_s"], "measured", f"{entry['how']}, on {entry['measured_at'][:10]}")


def _weight_files(path: Path) -> list[Path]:
    """A checkpoint's safetensors shards in name order (the order a pass reads them), or the one file given."""
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.safetensors")) or sorted(p for p in path.iterdir() if p.is_file())
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise ValueError(f"{path}: no files to measure")
    return files


def _drop_cached(descriptor: int, offset: int = 0, length: int = 0) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)


def _timed_reads_after_dropping_cache(files: list[Path], max_bytes: int) -> tuple[float, int, int]:
    """(seconds, bytes read, files read from)."""
    buffer = memoryview(bytearray(READ_CHUNK_BYTES))
    descriptors = [os.open(file, os.O_RDONLY) for file in files]
    try:
        for descriptor in descriptors:  # before the clock starts: nothing read is already in memory
            _drop_cached(descriptor)
        done = files_read = 0
        start = time.perf_counter()
        for descriptor in descriptors:
            if done >= max_bytes:
                break
            offset = 0
            files_read += 1
            while done < max_bytes:
                count = os.preadv(descriptor, [buffer[:min(READ_CHUNK_BYTES, max_bytes - done)]], offset)
                if count == 0:  # end of this file
                    break
                _drop_cached(descriptor, offset, count)
                offset += count
                done += count
        return time.perf_counter() - start, done, files_read
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


# ---------------------------------------------------------------------------------------------------------------
# Compute rate and runtime overhead


def measure_compute_rate(dtype: str, device: str = "cpu") -> float:
    """FLOP/s of a prefill-shaped matmul in `dtype` on `device` (median of a few), cached per device, dtype and
    torch thread count. Where the CPU has a choice of linear kernel (linear_kernels.py), each is timed and the
    faster is cached with it: the one runs use, so the rate the plan assumes is the rate they get."""
    import torch

    rows, inner, cols = COMPUTE_SHAPE
    torch_dtype = getattr(torch, dtype)
    tokens = torch.randn(rows, inner, dtype=torch_dtype, device=device)
    weight = torch.randn(cols, inner, dtype=torch_dtype, device=device)  # nn.Linear's [out, in]
    flops = 2 * rows * inner * cols
    works = {name: functools.partial(linear, tokens, weight)
             for name, linear in _linear_kernels(torch, tokens, weight).items()}
    times_packing = device.split(":")[0] == "cpu" and dtype == "bfloat16"  # where runs may pack (packs_weights)
    if times_packing:
        from batchrun import linear_kernels

        packed = linear_kernels.packed_weight_linear(weight)
        if packed is not None:
            works[PACKED] = functools.partial(packed, tokens)
    rounds = _interleaved_seconds(works, _synchronizer(torch, device))
    seconds = {name: _median(times) for name, times in rounds.items()}
    rates = {name: flops / seconds[name] for name in works if name != PACKED}
    kernel = max(rates, key=rates.get)
    entry = {"flops_per_s": rates[kernel], "linear_kernel": kernel, "kernel_flops_per_s": rates}
    if times_packing:
        entry["packed_flops_per_s"] = flops / seconds[PACKED] if PACKED in seconds else None
        entry["packs_weights"] = PACKED in rounds and faster_at_best(rounds[PACKED], rounds[kernel])
    _store("compute", _compute_key(dtype, device, torch.get_num_threads()), entry)
    return rates[kernel]


def _linear_kernels(torch, tokens, weight) -> dict:
    """The kernels a run could use for these tensors: aten always, oneDNN where it would take them."""
    import torch.nn.functional as F

    kernels = {"aten": F.linear}
    if tokens.device.type == "cpu":
        from batchrun import linear_kernels

        if linear_kernels.onednn_available() and linear_kernels.takes_onednn(tokens, weight, None):
            kernels["onednn"] = linear_kernels.onednn_linear
    return kernels


def _median_seconds(work, wait) -> float:
    """Median wall time of `work` over COMPUTE_REPEATS runs, after one untimed run (first touch, kernel selection,
    thread start-up); `wait` makes an accelerator finish before the clock stops."""
    return _median(_interleaved_seconds({"work": work}, wait)["work"])


def _median(times: list[float]) -> float:
    return max(statistics.median(times), 1e-9)


def _interleaved_seconds(works: dict, wait) -> dict[str, list[float]]:
    """Wall times of each of `works` (name -> callable), timed in turn round by round (COMPUTE_REPEATS rounds,
    after one untimed run of each), so a stretch of noise on this shared machine slows every kernel alike instead
    of whichever was being timed. Timed one after another, the packed kernel read 906 GFLOP/s against the plain
    one's 989 in 2 of 12 fresh processes (1,026-1,098 against 891-1,059 otherwise), and one such run left packing
    off: its classification pass took 23.3 s against 19.6-20.6 s packed."""
    for work in works.values():
        work()
        wait()
    seconds: dict = {name: [] for name in works}
    for _ in range(COMPUTE_REPEATS):
        for name, work in works.items():
            start = time.perf_counter()
            work()
            wait()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def faster_at_best(candidate: list[float], incumbent: list[float]) -> bool:
    """Whether `candidate` is the faster kernel, judged by each one's fastest round. Noise on a shared machine only
    ever slows a round down, so the fastest of the interleaved rounds is a kernel's own speed with the least noise
    in it; medians keep some. On the s33 machine (packed ~4% faster), 30 measurements in one process: by medians
    plain won once, by fastest rounds never; 1 of ~45 fresh processes one afternoon (s38, by medians, 927 against
    932 GFLOP/s) left packing off, and its classification pass spent 18.4 s in linears against 16.5-17.3 s packed."""
    return min(candidate) < min(incumbent)


def _synchronizer(torch, device: str):
    """Accelerators run asynchronously: time only after the work is done."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return torch.cuda.synchronize
    if kind == "mps":
        return torch.mps.synchronize
    return lambda: None


def compute_rate(dtype: str, device: str = "cpu") -> float:
    """The cached compute rate for dtype on device, measured now if there is none."""
    entry = _compute_entry(dtype, device)
    return entry["flops_per_s"] if entry else measure_compute_rate(dtype, device)


def linear_kernel(dtype: str, device: str = "cpu") -> str:
    """The kernel a run computes its linears with: BATCHRUN_LINEAR_KERNEL if set, else the faster one measured for
    dtype on device (measured now if it never was). `aten` wherever oneDNN's route does not apply: off the CPU and
    below float32 (linear_kernels.takes_onednn)."""
    from batchrun import linear_kernels

    override = linear_kernels.kernel_override()  # checked everywhere: a bad value is refused on any device
    if device.split(":")[0] != "cpu" or dtype != "float32":
        return "aten"
    if override is not None:
        return override
    entry = _compute_entry(dtype, device)
    if entry is None or "linear_kernel" not in entry:  # an entry cached before kernels were compared
        measure_compute_rate(dtype, device)
        entry = _compute_entry(dtype, device)
    return entry.get("linear_kernel", "aten") if entry else "aten"


def packs_weights(dtype: str, device: str = "cpu") -> bool:
    """Whether long prefills multiply packed weights (linear_kernels.pack_weights): only on a CPU computing in
    bfloat16, where the packed kernel ran COMPUTE_SHAPE faster than the plain one in its fastest round
    (faster_at_best; measured now if it never was).
    Its 256 rows are a small prefill call: on a 2-core AMX Xeon (s24) such calls ran slower packed."""
    if device.split(":")[0] != "cpu" or dtype != "bfloat16":
        return False
    entry = _compute_entry(dtype, device)
    if entry is None or "packs_weights" not in entry:  # cached before packing was decided by the fastest rounds
        measure_compute_rate(dtype, device)
        entry = _compute_entry(dtype, device)
    return bool(entry and entry.get("packs_weights"))


def _compute_entry(dtype: str, device: str) -> dict | None:
    import torch

    return _cached("compute", _compute_key(dtype, device, torch.get_num_threads()))


def measure_memory_read_rate(dtype: str, device: str = "cpu") -> float:
    """Bytes/s at which a decode-shaped matmul streams its weights from memory (median of a few), cached per device,
    dtype and torch thread count: what bounds a decode pass of a few sequences. Timed on the linear kernel runs
    use."""
    import torch

    rows, inner, cols = DECODE_SHAPE
    torch_dtype = getattr(torch, dtype)
    tokens = torch.ones(rows, inner, dtype=torch_dtype, device=device)
    weights = [torch.full((cols, inner), 0.01, dtype=torch_dtype, device=device) for _ in range(DECODE_MATRICES)]
    kernel = linear_kernel(dtype, device)
    linear = _linear_kernels(torch, tokens, weights[0])[kernel]

    def decode_step():
        for weight in weights:
            linear(tokens, weight)

    streamed = sum(weight.numel() * weight.element_size() for weight in weights)
    rate = streamed / _median_seconds(decode_step, _synchronizer(torch, device))
    _store("memory", _compute_key(dtype, device, torch.get_num_threads()),
           {"bytes_per_s": rate, "linear_kernel": kernel})
    return rate


def memory_read_rate(dtype: str, device: str = "cpu") -> float:
    """The cached memory read rate for dtype on device, measured now if there is none for the kernel runs use."""
    import torch

    entry = _cached("memory", _compute_key(dtype, device, torch.get_num_threads()))
    if entry and entry.get("linear_kernel") == linear_kernel(dtype, device):
        return entry["bytes_per_s"]
    return measure_memory_read_rate(dtype, device)


def decode_rates(shapes: Sequence[tuple[int, int]], num_layers: int, dtype: str,
                 device: str = "cpu") -> dict[int, float] | None:
    """{rows: weight bytes/s} of the checkpoint's own layer matrices (`shapes`, layer 0's) at each of DECODE_ROWS
    rows, on the kernel runs use (layer_rates.py): what prices a decode pass. Cached per shape set, device, dtype and
    thread count; None without shapes (sizes estimated from the config)."""
    if not shapes:
        return None
    import torch

    kernel = linear_kernel(dtype, device)
    digest = hashlib.sha256(repr((sorted(shapes), num_layers)).encode()).hexdigest()[:16]
    key = f"{_compute_key(dtype, device, torch.get_num_threads())}{SHAPES_SEPARATOR}{digest}"
    entry = _cached("decode", key)
    if entry and entry.get("linear_kernel") == kernel:
        return {int(rows): rate for rows, rate in entry["bytes_per_s"].items()}
    from batchrun import layer_rates, linear_kernels

    linear = linear_kernels.kernel_linear(kernel)
    rates = layer_rates.weight_read_rates(shapes, num_layers, dtype, device, DECODE_ROWS, linear,
                                          _synchronizer(torch, device))
    _store("decode", key, {"bytes_per_s": {str(rows): rate for rows, rate in rates.items()}, "linear_kernel": kernel,
                           "matrices": len(shapes)})
    return rates


def compute_threads() -> int:
    """The threads torch computes with in this process: what every rate here was measured with."""
    import torch

    return torch.get_num_threads()


def layer_call_seconds(device: str = "cpu") -> float:
    """Seconds one forward call through a decoder layer costs besides its matmuls and memory traffic
    (layer_overhead.py): what a small model's decode step mostly is. Cached per device, thread count and
    transformers release (the cost is its modules' Python)."""
    import torch

    key = _compute_key("float32", device, torch.get_num_threads())
    entry = _cached("layer_call", key)
    if entry:
        return entry["seconds"]
    from batchrun import layer_overhead

    seconds = layer_overhead.seconds_per_layer_call(device)
    _store("layer_call", key, {"seconds": seconds})
    return seconds


def _compute_key(dtype: str, device: str, threads: int) -> str:
    return f"{device}:{dtype}:threads={threads}"


def runtime_overhead_bytes() -> int:
    """Peak resident memory of a fresh Python that imported torch and transformers' model code: what a run costs
    before any weight. Measured once per interpreter in a subprocess; RUNTIME_OVERHEAD_FALLBACK_BYTES if the
    probe fails."""
    entry = _cached("runtime_overhead", sys.executable)
    if entry and entry.get("probe") == _probe_digest():  # a changed probe measures again
        return entry["bytes"]
    try:
        probe = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True,
                               timeout=300, check=True)
        measured = int(probe.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return RUNTIME_OVERHEAD_FALLBACK_BYTES
    _store("runtime_overhead", sys.executable, {"bytes": measured, "probe": _probe_digest()})
    return measured


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), None where the system does not say."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _probe_digest() -> str:
    return hashlib.sha256(_RUNTIME_PROBE.encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# The cache


def _load() -> dict:
    try:
        return json.loads((state_dir() / MEASUREMENTS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # nothing measured yet, or a damaged file that the next measurement replaces


def _cached(section: str, key: str) -> dict | None:
    """A figure cached for `key`, if it was measured on what this process runs on (machine.py)."""
    entry = _load().get(section, {}).get(key)
    return entry if entry is not None and entry.get("machine") == _identity(section, key) else None


def _identity(section: str, key: str) -> dict:
    """What a figure of `section` depends on besides its key: the disk's mount for a bandwidth; the processor and
    torch build for a rate, and the accelerator's name off the CPU; for a layer call's cost also transformers; for
    the runtime's memory also transformers and the native libraries' cache settings (native_env: a user's
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024 measured 536 MiB against 467 MiB at batchrun's 64)."""
    if section == "bandwidth":
        return machine.disk_identity(int(key))
    identity = machine.kernels_identity()
    if section == "runtime_overhead":
        return {**identity, "transformers": machine.package_version("transformers"),
                "native": {name: os.environ.get(name) for name in NATIVE_DEFAULTS}}
    if section == "layer_call":
        identity = {**identity, "transformers": machine.package_version("transformers")}
    device = key.split(SHAPES_SEPARATOR)[0].rsplit(":", 2)[0]  # "<device>:<dtype>:threads=<n>[|<shapes>]"
    if device.split(":")[0] != "cpu":
        identity["accelerator"] = _accelerator_name(device)
    return identity


def _accelerator_name(device: str) -> str:
    import torch

    if device.split(":")[0] == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device


def _store(section: str, key: str, entry: dict) -> None:
    measurements = _load()
    entry = {**entry, "machine": _identity(section, key),
             "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    measurements.setdefault(section, {})[key] = entry
    file = state_dir() / MEASUREMENTS_FILE
    temporary = file.with_suffix(f".{os.getpid()}.tmp")
    try:
        temporary.write_text(json.dumps(measurements, indent=2))
        os.replace(temporary, file)  # atomic: a concurrent reader sees the old or the new file, never half
    except OSError:
        # A full disk must not stop a job over a cache: the figure is simply measured again next time.
        temporary.unlink(missing_ok=True)
