"""Shared benchmark utilities: one machine lock, a real memory cap, cold caches, a cached large checkpoint,
peak RSS of a subprocess, and result tables.

Benchmarks are scripts run by hand on a quiet machine, not tests. Typical use:

    from benchmarks import harness

    checkpoint = harness.large_checkpoint()                    # built once, cached
    bandwidth = harness.cold_read_bandwidth(checkpoint)        # bytes/s, cold
    with harness.exclusive_machine():                          # no other benchmark runs meanwhile
        harness.drop_page_cache()
        run = harness.run_measured([sys.executable, "-m", "batchrun", ...], memory_cap_bytes=800 << 20)
    print(run.peak_rss_bytes, run.wall_seconds, run.oom_killed)
    harness.print_table(rows, columns)
    harness.save_results("my_benchmark", {"rows": rows})

Linux only (cgroup v1 memory controller, /proc); the memory cap and drop_page_cache need root.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
# One lock for every benchmark on the machine: two measured runs at once would share 2 cores and the disk.
LOCK_FILE = Path(os.environ.get("BATCHRUN_BENCH_LOCK", "/work/notes/bench.lock"))
CACHE_ENV = "BATCHRUN_BENCH_CACHE"
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
# The large checkpoint: a random-weight model of at least 1 GB, streamed under a cap of ~60% of its
# size. Streaming it in float32 keeps the non-decoder tensors, two layer slots and their bf16 read buffers resident
# (~0.7 GB at TinyLlama's layer shape) beside the ~0.35 GB runtime: with a 32k vocabulary (0.5 GB of fp32 embedding
# and head) that is more than a 1.3 GB checkpoint itself, so the vocabulary is small and the model 2 GB, leaving
# room for a 1.2 GB cap.
LARGE_TARGET_BYTES = 2_000_000_000
LARGE_VOCAB_SIZE = 8192


def bench_cache_dir() -> Path:
    """$BATCHRUN_BENCH_CACHE, default ~/.cache/batchrun-bench (created)."""
    directory = Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "batchrun-bench"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


# ---------------------------------------------------------------------------------------------------------------
# The machine


@contextlib.contextmanager
def exclusive_machine(lock_file: Path = LOCK_FILE) -> Iterator[None]:
    """Hold an exclusive flock on the shared benchmark lock for the block: waits (printing once) while another
    benchmark holds it. Wrap every heavy measured run in it."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {lock_file} (another benchmark is running)", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def busy_cores(seconds: float = 2.0) -> float:
    """Cores kept busy by everything on the machine over the next `seconds` (0 = idle, os.cpu_count() = full)."""
    busy_before, total_before = _cpu_ticks()
    time.sleep(seconds)
    busy_after, total_after = _cpu_ticks()
    return (busy_after - busy_before) / max(total_after - total_before, 1) * (os.cpu_count() or 1)


def wait_for_quiet(max_busy_cores: float = 0.3, timeout_s: float = 600.0, window_s: float = 3.0) -> float:
    """Wait until other work keeps at most max_busy_cores busy (timings on 2 shared cores mean nothing otherwise);
    returns the busy cores last seen, which may still be above the limit when timeout_s ran out."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        busy = busy_cores(window_s)
        if busy <= max_busy_cores or time.monotonic() > deadline:
            return busy
        if not announced:
            print(f"waiting for a quiet machine ({busy:.1f} cores busy)", file=sys.stderr, flush=True)
            announced = True


def drop_page_cache() -> None:
    """Write dirty pages back and drop the clean page cache (root only), so the next read comes from disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def cold_read_bandwidth(checkpoint: Path, max_bytes: int = 1 << 30, repeats: int = 3) -> float:
    """Cold sequential read rate (bytes/s) of the checkpoint's shards, median of `repeats` (a disk's cold
    rate can swing by +-30% from one read to the next); the figure `batchrun disk` measures and caches. Pass it to
    `batchrun plan --bandwidth` (in GB/s) so predictions use it."""
    from batchrun.measure import measure_read_bandwidth

    return statistics.median(measure_read_bandwidth(Path(checkpoint), max_bytes=max_bytes).bytes_per_s
                             for _ in range(repeats))


def compute_rate(dtype: str = "float32") -> float:
    """The FLOP/s batchrun's plan uses for `dtype` on the CPU (cached measurement)."""
    from batchrun.measure import compute_rate as cached_rate

    return cached_rate(dtype, "cpu")


def large_checkpoint(target_bytes: int = LARGE_TARGET_BYTES, dtype: str = "bfloat16",
                     vocab_size: int = LARGE_VOCAB_SIZE, hidden_size: int | None = None) -> Path:
    """The random-weight Llama-style checkpoint of about target_bytes, built once under bench_cache_dir()/large (a
    minute or two the first time): TinyLlama's layer shape scaled to `hidden_size` (None: TinyLlama's own), as many
    layers as reach the size."""
    sys.path.insert(0, str(REPO_ROOT))  # tests.tiny_models lives beside the package, not in it
    from tests.tiny_models import LARGE_HIDDEN, build_large_llama

    return build_large_llama(bench_cache_dir() / "large", target_bytes, dtype=dtype, vocab_size=vocab_size,
                             hidden_size=hidden_size or LARGE_HIDDEN)


def checkpoint_bytes(checkpoint: Path) -> int:
    """Bytes of the checkpoint's safetensors files, or of the one file given (a GGUF file)."""
    if Path(checkpoint).is_file():
        return Path(checkpoint).stat().st_size
    return sum(file.stat().st_size for file in Path(checkpoint).glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# A memory cap: a child of this process's own cgroup v1 memory cgroup


def own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_V1_MEMORY / path.lstrip("/")
    raise OSError("no cgroup v1 memory controller for this process (see /proc/self/cgroup)")


@dataclass
class MemoryCap:
    """A cgroup v1 memory cgroup with a hard limit. Page cache counts against it, so a checkpoint larger than the
    cap is really re-read from disk each pass."""
    path: Path
    limit_bytes: int

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    @property
    def max_usage_bytes(self) -> int:
        """Peak charge of the cgroup: anonymous memory AND page cache (not what an OOM killer ranks by)."""
        return int(self._read("memory.max_usage_in_bytes"))

    @property
    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    @property
    def failcnt(self) -> int:
        """How often the cgroup hit its limit (and reclaimed page cache, or killed)."""
        return int(self._read("memory.failcnt"))


@contextlib.contextmanager
def memory_cap(limit_bytes: int) -> Iterator[MemoryCap]:
    """A fresh child memory cgroup capped at limit_bytes (no swap); removed after the block. Put a process in it
    with `run_measured(..., memory_cap_bytes=)` or by writing its pid to <path>/cgroup.procs."""
    path = own_memory_cgroup() / f"batchrun-bench-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        memsw = path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # no swap here anyway, but a capped run must not page out instead of being killed
            with contextlib.suppress(OSError):
                memsw.write_text(str(limit_bytes))
        yield MemoryCap(path, limit_bytes)
    finally:
        for _ in range(50):  # the cgroup can be removed only once its last task has exited
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------------------
# A measured subprocess


@dataclass
class RunResult:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_seconds: float
    peak_rss_bytes: int  # the command's peak resident set (its own wait4 ru_maxrss, launcher.py): what the OOM
    # killer sees
    memory_cap_bytes: int | None = None
    cgroup_max_usage_bytes: int | None = None  # with a cap: peak charge including page cache
    oom_killed: bool = False
    cap_hits: int | None = None
    # Cores other processes kept busy on average during the run (machine busy time minus the child's CPU time):
    # above ~0.3 on a 2-core machine, timings are not trustworthy.
    foreign_busy_cores: float | None = None

    def json_stdout(self) -> dict:
        """stdout parsed as JSON (the last JSON object if the command printed other lines first)."""
        text = self.stdout.strip()
        start = text.find("{")
        if start < 0:
            raise ValueError(f"no JSON in stdout of {self.command}: {text[-500:]!r}; stderr {self.stderr[-2000:]!r}")
        return json.loads(text[start:])

    def check(self) -> "RunResult":
        """Raise with the stderr tail when the command failed."""
        if self.returncode != 0:
            killed = " (OOM-killed)" if self.oom_killed else ""
            raise RuntimeError(f"{' '.join(self.command)} exited {self.returncode}{killed}:\n{self.stderr[-4000:]}")
        return self


def run_measured(command: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 memory_cap_bytes: int | None = None, timeout: float | None = None) -> RunResult:
    """Run `command`, optionally inside a fresh memory cap (it joins the cgroup before its exec, so every byte it
    allocates is charged), and measure its wall time and peak RSS. env is added to os.environ. The command runs
    under benchmarks/launcher.py, which waits for it without polling and reports its exact peak; this process only
    blocks until it ends (or kills it, and everything it started, at `timeout` seconds or on an exception). A
    command killed at the timeout reports no peak (0)."""
    full_env = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as stack:
        cap = stack.enter_context(memory_cap(memory_cap_bytes)) if memory_cap_bytes else None
        out = stack.enter_context(tempfile.TemporaryFile("w+"))
        err = stack.enter_context(tempfile.TemporaryFile("w+"))
        report_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="batchrun-measured-"))) / "report"
        launcher = [sys.executable, str(REPO_ROOT / "benchmarks" / "launcher.py"), str(report_path)]
        if cap:
            launcher += ["--cgroup-procs", str(cap.path / "cgroup.procs")]
        machine_before = _cpu_ticks()
        start = time.perf_counter()
        process = subprocess.Popen([*launcher, "--", *command], env=full_env,
                                   cwd=cwd, stdout=out, stderr=err, start_new_session=True)
        # A timer, not Popen.wait(timeout): that one wakes every 50 ms to look, on the cores the command measures.
        killer = threading.Timer(timeout, _kill_group, (process.pid,)) if timeout else None
        try:
            if killer:
                killer.start()
            process.wait()
        finally:
            if killer:
                killer.cancel()
            if process.poll() is None:  # interrupted: no orphan keeps the machine busy
                _kill_group(process.pid)
                process.wait()
        machine_after = _cpu_ticks()
        try:
            report = json.loads(report_path.read_text())
        except FileNotFoundError:  # the launcher was killed (timeout) before its command ended
            report = {"returncode": process.returncode, "ru_maxrss_bytes": 0, "user_seconds": 0.0,
                      "system_seconds": 0.0, "wall_seconds": time.perf_counter() - start}
        out.seek(0)
        err.seek(0)
        wall = report["wall_seconds"]
        machine_busy_s = (machine_after[0] - machine_before[0]) / CLOCK_TICKS
        own_cpu = report["user_seconds"] + report["system_seconds"]
        foreign = max(machine_busy_s - own_cpu, 0.0) / max(wall, 1e-9)
        result = RunResult(
            command=list(command), returncode=report["returncode"], stdout=out.read(), stderr=err.read(),
            wall_seconds=wall, peak_rss_bytes=report["ru_maxrss_bytes"], memory_cap_bytes=memory_cap_bytes,
            foreign_busy_cores=foreign,
        )
        if cap:
            result.cgroup_max_usage_bytes = cap.max_usage_bytes
            result.oom_killed = cap.oom_kills > 0
            result.cap_hits = cap.failcnt
        return result


def _kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(group, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------------------------
# Results


def format_table(rows: Sequence[Mapping], columns: Sequence[str] | Mapping[str, str]) -> str:
    """A Markdown table of rows (dicts). columns: keys, or {key: header}. Floats get 3 significant digits."""
    headers = dict(columns) if isinstance(columns, Mapping) else {key: key for key in columns}

    def cell(value) -> str:
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(headers.values()) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(row.get(key)) for key in headers) + " |" for row in rows]
    return "\n".join(lines)


def print_table(rows: Sequence[Mapping], columns: Sequence[str] | Mapping[str, str]) -> None:
    print(format_table(rows, columns), flush=True)


def machine_description() -> dict:
    """What the numbers were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    memory = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory, "python": sys.version.split()[0]}


# CPU flags that set a machine's class, most capable first: the matmul units decide batchrun's rates.
CLASS_FLAGS = (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))


def machine_class(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """A short name for the class of machine results come from: the CPU family and its best matmul units, e.g.
    'epyc-avx512bf16', 'xeon-amx', 'epyc-avx2'."""
    text = cpuinfo.read_text(errors="replace") if cpuinfo.exists() else ""
    model = next((line.split(":", 1)[1] for line in text.splitlines() if line.startswith("model name")), "")
    family = next((word for word in ("epyc", "xeon", "ryzen", "core") if word in model.lower()), "cpu")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), ()))
    units = next((short for flag, short in CLASS_FLAGS if flag in flags), "")
    return f"{family}-{units}" if units else family


def result_stem(name: str) -> str:
    """`name` with the machine class appended, so results from different classes of machine never share a file."""
    suffix = machine_class()
    return name if name.endswith(suffix) else f"{name}-{suffix}"


def save_results(name: str, data: Mapping) -> Path:
    """Write data (plus the time and machine) to benchmarks/results/<name>-<machine class>.json; returns the
    path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{result_stem(name)}.json"
    record = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_description(), **data}
    path.write_text(json.dumps(record, indent=2, default=_jsonable))
    return path


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"cannot save {type(value).__name__} as JSON")


__all__ = [
    "MemoryCap", "RunResult", "bench_cache_dir", "checkpoint_bytes", "cold_read_bandwidth", "compute_rate",
    "drop_page_cache", "exclusive_machine", "format_table", "large_checkpoint", "machine_description", "memory_cap",
    "machine_class", "own_memory_cgroup", "print_table", "result_stem", "run_measured", "save_results", "busy_cores", "wait_for_quiet",
]
