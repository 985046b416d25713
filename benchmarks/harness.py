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
# The large checkpoint of the issue: a random-weight model of at least 1 GB, streamed under a cap of ~60% of its
# size. Streaming it in float32 keeps the non-decoder tensors, two layer slots and their bf16 read buffers resident
# (~0.7 GB at TinyLlama's layer shape) beside the ~0.35 GB runtime: with a 32k vocabulary (0.5 GB of fp32 embedding
# and head) that is more than a 1.3 GB checkpoint itself, so the vocabulary is small and the model 2 GB, leaving
# room for a 1.2 GB cap.
LARGE_TARGET_BYTES = 2_000_000_000
LARGE_VOCAB_SIZE = 8192
RSS_POLL_SECONDS = 0.02


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
    """Cold sequential read rate (bytes/s) of the checkpoint's shards, median of `repeats` (this machine's disk
    swings by +-30% from one read to the next); the figure `batchrun disk` measures and caches. Pass it to
    `batchrun plan --bandwidth` (in GB/s) so predictions use it."""
    from batchrun.measure import measure_read_bandwidth

    return statistics.median(measure_read_bandwidth(Path(checkpoint), max_bytes=max_bytes).bytes_per_s
                             for _ in range(repeats))


def compute_rate(dtype: str = "float32") -> float:
    """The FLOP/s batchrun's plan uses for `dtype` on the CPU (cached measurement)."""
    from batchrun.measure import compute_rate as cached_rate

    return cached_rate(dtype, "cpu")


def large_checkpoint(target_bytes: int = LARGE_TARGET_BYTES, dtype: str = "bfloat16",
                     vocab_size: int = LARGE_VOCAB_SIZE) -> Path:
    """The random-weight Llama-style checkpoint (TinyLlama layer shape) of about target_bytes, built once under
    bench_cache_dir()/large (a minute or two the first time)."""
    sys.path.insert(0, str(REPO_ROOT))  # tests.tiny_models lives beside the package, not in it
    from tests.tiny_models import build_large_llama

    return build_large_llama(bench_cache_dir() / "large", target_bytes, dtype=dtype, vocab_size=vocab_size)


def checkpoint_bytes(checkpoint: Path) -> int:
    """Bytes of the checkpoint's safetensors files."""
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
    peak_rss_bytes: int  # process peak resident set (VmHWM polled, and wait4's ru_maxrss where it is the child's
    # own, see child_peak_rss): what the OOM killer sees
    polled_hwm_bytes: int
    ru_maxrss_bytes: int
    memory_cap_bytes: int | None = None
    cgroup_max_usage_bytes: int | None = None  # with a cap: peak charge including page cache
    oom_killed: bool = False
    cap_hits: int | None = None
    # Cores other processes kept busy on average during the run (machine busy time minus the child's CPU time):
    # above ~0.3 on this 2-core machine, timings are not trustworthy.
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


def _hwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def child_peak_rss(polled_hwm: int, ru_maxrss: int, parent_hwm: int) -> int:
    """The child's peak RSS. Linux keeps the high-water mark of the memory a process had before its exec, which for a
    spawned child is the parent's: wait4's ru_maxrss is max(the parent's RSS at the spawn, the child's own peak). It
    is the child's own only when above anything the parent ever held; otherwise the polled VmHWM (the new image's
    own mark, read every RSS_POLL_SECONDS) stands alone. Measured: the four default-model cases of plan_accuracy
    all read 1,576 MB, the parent's RSS after converting the default model, where their VmHWM read 660-1,495 MB."""
    return max(polled_hwm, ru_maxrss) if ru_maxrss > parent_hwm else polled_hwm


def run_measured(command: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 memory_cap_bytes: int | None = None, timeout: float | None = None) -> RunResult:
    """Run `command`, optionally inside a fresh memory cap (the child joins the cgroup before exec, so every byte it
    allocates is charged), and measure its wall time and peak RSS. env is added to os.environ."""
    full_env = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as stack:
        cap = stack.enter_context(memory_cap(memory_cap_bytes)) if memory_cap_bytes else None
        procs_file = str(cap.path / "cgroup.procs") if cap else None

        def join_cap() -> None:  # runs in the child between fork and exec
            if procs_file:
                with open(procs_file, "w") as handle:
                    handle.write(str(os.getpid()))

        out = stack.enter_context(tempfile.TemporaryFile("w+"))
        err = stack.enter_context(tempfile.TemporaryFile("w+"))
        machine_before = _cpu_ticks()
        start = time.perf_counter()
        process = subprocess.Popen(list(command), env=full_env, cwd=cwd, stdout=out, stderr=err,
                                   preexec_fn=join_cap if cap else None)
        polled = [0]
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                polled[0] = max(polled[0], _hwm_bytes(process.pid))
                time.sleep(RSS_POLL_SECONDS)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        deadline = None if timeout is None else start + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if deadline and time.perf_counter() > deadline:
                process.kill()
            time.sleep(0.01)
        wall = time.perf_counter() - start
        machine_after = _cpu_ticks()
        done.set()
        poller.join()
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        maxrss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB
        parent_hwm = _hwm_bytes(os.getpid())
        machine_busy_s = (machine_after[0] - machine_before[0]) / CLOCK_TICKS
        foreign = max(machine_busy_s - usage.ru_utime - usage.ru_stime, 0.0) / max(wall, 1e-9)
        result = RunResult(
            command=list(command), returncode=process.returncode, stdout=out.read(), stderr=err.read(),
            wall_seconds=wall, peak_rss_bytes=child_peak_rss(polled[0], maxrss, parent_hwm), polled_hwm_bytes=polled[0],
            ru_maxrss_bytes=maxrss, memory_cap_bytes=memory_cap_bytes, foreign_busy_cores=foreign,
        )
        if cap:
            result.cgroup_max_usage_bytes = cap.max_usage_bytes
            result.oom_killed = cap.oom_kills > 0
            result.cap_hits = cap.failcnt
        return result


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


def save_results(name: str, data: Mapping) -> Path:
    """Write data (plus the time and machine) to benchmarks/results/<name>.json; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
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
    "own_memory_cgroup", "print_table", "run_measured", "save_results", "busy_cores", "wait_for_quiet",
]
