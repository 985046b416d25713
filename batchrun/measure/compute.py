"""How fast this machine multiplies: a prefill-shaped matmul's FLOP/s, the rate a decode-shaped matmul streams its
weights from memory, the checkpoint's own layer matrices by row count, and which linear kernel is the faster here.
Each is cached per device, dtype and thread count (measure.cache); importing this module imports no torch, only
measuring does.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import statistics
import time
from typing import Sequence

from batchrun.measure import layer_rates
from batchrun.measure.cache import SHAPES_SEPARATOR, cached, compute_key, dispute, load, store

# A matmul shaped like a batch of a few hundred tokens through a 2k-wide layer (median of COMPUTE_REPEATS or more).
COMPUTE_SHAPE = (256, 2048, 2048)
COMPUTE_REPEATS = 9
# Rounds go on until they span this long: COMPUTE_REPEATS rounds of COMPUTE_SHAPE can take a fraction of a second, and
# a burst of other work that long on a shared machine can halve the cached rate every later plan prices its passes
# at (docs/planning.md#time).
MEASURE_MIN_SECONDS = 1.0
MEASURE_MAX_ROUNDS = 500
PACKED = "packed"  # the packed-weight kernel's name among those timed (linear_kernels.packed_weight_linear)
# A decode step: a few sequences through weights much larger than the CPU caches, so the matmul runs at the speed
# the weights stream from RAM, not at COMPUTE_SHAPE's rate. Several matrices in turn, so none is cached on a repeat.
DECODE_SHAPE = (8, 2048, 8192)
DECODE_MATRICES = 4
# Row counts at which a checkpoint's own layer matrices are timed (decode_rates); a pass's rows interpolate.
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# A run's prefill pass judges the cached compute rate (judge_compute_rate) when it is at least this long, and
# disputes it when it took under 1/RATE_DISPUTED_BEYOND or over RATE_DISPUTED_BEYOND times its planned seconds.
JUDGED_PASS_MIN_SECONDS = 2.0
RATE_DISPUTED_BEYOND = 1.5

log = logging.getLogger("batchrun")


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
        from batchrun.runtime import linear_kernels  # torch: only when measuring

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
    store("compute", compute_key(dtype, device, torch.get_num_threads()), entry)
    return rates[kernel]


def _linear_kernels(torch, tokens, weight) -> dict:
    """The kernels a run could use for these tensors: aten always, oneDNN where it would take them."""
    import torch.nn.functional as F

    kernels = {"aten": F.linear}
    if tokens.device.type == "cpu":
        from batchrun.runtime import linear_kernels  # torch: only when measuring

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
    """Wall times of each of `works` (name -> callable), timed in turn round by round (COMPUTE_REPEATS rounds or as
    many as MEASURE_MIN_SECONDS takes, after one untimed run of each), so a stretch of noise on a shared machine
    slows every kernel alike instead of whichever was being timed, and the median outlasts a short burst. Timed
    one after another, a burst can turn the faster kernel into the slower (docs/performance.md#packing)."""
    for work in works.values():
        work()
        wait()
    seconds: dict = {name: [] for name in works}
    began = time.perf_counter()
    rounds = 0
    while rounds < COMPUTE_REPEATS or (time.perf_counter() - began < MEASURE_MIN_SECONDS
                                       and rounds < MEASURE_MAX_ROUNDS):
        rounds += 1
        for name, work in works.items():
            start = time.perf_counter()
            work()
            wait()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def faster_at_best(candidate: list[float], incumbent: list[float]) -> bool:
    """Whether `candidate` is the faster kernel, judged by each one's fastest round. Noise on a shared machine only
    ever slows a round down, so the fastest of the interleaved rounds is a kernel's own speed with the least noise
    in it; medians keep some, enough to pick the slower of two kernels a few percent apart
    (docs/performance.md#packing)."""
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


def dispute_compute_rate(dtype: str, device: str, evidence: dict) -> bool:
    """A run's prefill passes disagreed with the cached compute rate (`evidence`: what it observed): the next plan
    measures the rate again (measure.cache.dispute). False where no cached rate was left to dispute."""
    import torch

    return dispute("compute", compute_key(dtype, device, torch.get_num_threads()), evidence)


def judge_compute_rate(dtype: str, device: str, seconds: float, planned: float, *, job: str) -> bool:
    """A pass of prefill compute that took `seconds` where its plan, priced at the cached rate, said `planned`:
    one at least JUDGED_PASS_MIN_SECONDS long (timed well past the machine's noise) outside RATE_DISPUTED_BEYOND
    either way says the rate was measured under other conditions (a busy moment), and disputes it. Returns whether
    the pass was long enough to judge by."""
    if planned < JUDGED_PASS_MIN_SECONDS:
        return False
    if not 1 / RATE_DISPUTED_BEYOND <= seconds / planned <= RATE_DISPUTED_BEYOND:
        evidence = {"job": job, "pass_seconds": round(seconds, 3), "planned_seconds": round(planned, 3)}
        if dispute_compute_rate(dtype, device, evidence):
            log.info("a pass took %.1f s where the plan priced it at %.1f s: this machine's compute rate is measured "
                     "again at the next plan", seconds, planned)
    return True


def dispute_generation_rates(dtype: str, device: str, evidence: dict) -> bool:
    """A run's generation passes disagreed with their plan (`evidence`): every cached figure that prices such a
    pass is disputed, so the next plan measures them again. A decode pass is priced by the checkpoint's own layer
    matrices' rates (decode_rates), the memory rate, a layer call's fixed cost and, beside a prefill, the compute
    rate; a busy moment slows every one measured in it, and which of them it was the passes cannot tell apart.
    Returns whether any figure was left to dispute."""
    import torch

    key = compute_key(dtype, device, torch.get_num_threads())
    layer_call = compute_key("float32", device, torch.get_num_threads())  # measure.layer_call's key
    shapes = [name for name in load().get("decode", {}) if name.startswith(key + SHAPES_SEPARATOR)]
    disputed = [dispute("compute", key, evidence), dispute("memory", key, evidence),
                dispute("layer_call", layer_call, evidence)] + [dispute("decode", name, evidence) for name in shapes]
    return any(disputed)


def judge_generation_rates(dtype: str, device: str, seconds: float, planned: float, *, job: str) -> bool:
    """A run's generation passes so far took `seconds` where the plan priced them at `planned`: once either is at
    least JUDGED_PASS_MIN_SECONDS (a sum of short decode passes outlasts the machine's noise just as one long pass
    does), a ratio outside RATE_DISPUTED_BEYOND either way disputes the rates that priced them. Returns whether the
    passes were long enough to judge by."""
    if max(seconds, planned) < JUDGED_PASS_MIN_SECONDS:
        return False
    if not 1 / RATE_DISPUTED_BEYOND <= seconds / max(planned, 1e-9) <= RATE_DISPUTED_BEYOND:
        evidence = {"job": job, "generation_seconds": round(seconds, 3), "planned_seconds": round(planned, 3)}
        if dispute_generation_rates(dtype, device, evidence):
            log.info("generation passes took %.1f s where the plan priced them at %.1f s: the rates that price "
                     "them are measured again at the next plan", seconds, planned)
    return True


def linear_kernel(dtype: str, device: str = "cpu") -> str:
    """The kernel a run computes its linears with: BATCHRUN_LINEAR_KERNEL if set, else the faster one measured for
    dtype on device (measured now if it never was). `aten` wherever oneDNN's route does not apply: off the CPU and
    below float32 (linear_kernels.takes_onednn)."""
    from batchrun.runtime import linear_kernels  # torch: only when measuring

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
    Its 256 rows are a small prefill call: on some CPUs such calls run slower packed
    (docs/streaming.md#packed-bfloat16-weights-in-long-prefills)."""
    if device.split(":")[0] != "cpu" or dtype != "bfloat16":
        return False
    entry = _compute_entry(dtype, device)
    if entry is None or "packs_weights" not in entry:  # cached before packing was decided by the fastest rounds
        measure_compute_rate(dtype, device)
        entry = _compute_entry(dtype, device)
    return bool(entry and entry.get("packs_weights"))


def _compute_entry(dtype: str, device: str) -> dict | None:
    import torch

    return cached("compute", compute_key(dtype, device, torch.get_num_threads()))


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
    store("memory", compute_key(dtype, device, torch.get_num_threads()),
           {"bytes_per_s": rate, "linear_kernel": kernel})
    return rate


def memory_read_rate(dtype: str, device: str = "cpu") -> float:
    """The cached memory read rate for dtype on device, measured now if there is none for the kernel runs use."""
    import torch

    entry = cached("memory", compute_key(dtype, device, torch.get_num_threads()))
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
    key = f"{compute_key(dtype, device, torch.get_num_threads())}{SHAPES_SEPARATOR}{digest}"
    entry = cached("decode", key)
    if entry and entry.get("linear_kernel") == kernel:
        return {int(rows): rate for rows, rate in entry["bytes_per_s"].items()}
    from batchrun.runtime import linear_kernels  # torch: only when measuring

    linear = linear_kernels.kernel_linear(kernel)
    rates = layer_rates.weight_read_rates(shapes, num_layers, dtype, device, DECODE_ROWS, linear,
                                          _synchronizer(torch, device))
    store("decode", key, {"bytes_per_s": {str(rows): rate for rows, rate in rates.items()}, "linear_kernel": kernel,
                           "matrices": len(shapes)})
    return rates


def compute_threads() -> int:
    """The threads torch computes with in this process: what every rate here was measured with."""
    import torch

    return torch.get_num_threads()
