"""Running `batchrun` as a real process for the fault tests: killed, out of memory, out of disk, run twice at once.

In-process calls cannot show these: a SIGKILL, the kernel's OOM killer or a file-size limit act on the process.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from batchrun.output import read_parquet_results

BATCHRUN = [sys.executable, "-m", "batchrun"]
FAULT_ENV = ("BATCHRUN_KILL_AT", "BATCHRUN_STOP_AT", "BATCHRUN_FAULT_TRACE")
RUN_TIMEOUT_S = 180  # one tiny-model run takes seconds; this only stops a hung test
_started: list[subprocess.Popen] = []  # every process start() began, for reap_started()


@dataclass
class Finished:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def summary(self) -> dict:
        """The --json summary printed by a successful `batchrun submit`."""
        return json.loads(self.stdout)

    def describe(self) -> str:
        return f"`batchrun {' '.join(self.args)}` -> {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


def batchrun_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a test run: its own state dir, offline, no fault point unless asked for."""
    env = {k: v for k, v in os.environ.items() if k not in FAULT_ENV and k != "HF_TOKEN"}
    env.update(BATCHRUN_HOME=str(home), HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               PYTHONFAULTHANDLER="0")
    env.update(extra)
    return env


def start(args: list[str], env: dict[str, str], *, wrapper: list[str] | None = None,
          preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
    """`batchrun ARGS` in the background; `wrapper` (e.g. ["sh", "-c", "...; exec \"$@\"", "sh"]) goes in front.
    It leads a process group of its own, so reap_started() ends it with whatever it started."""
    process = subprocess.Popen([*(wrapper or []), *BATCHRUN, *args], env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn,
                               start_new_session=True)
    _started.append(process)
    return process


def reap_started() -> None:
    """SIGKILL the process group of every process start() began and reap its leader. Run after each test, so no run
    outlives the test that started it: one left frozen (SIGSTOP; SIGKILL ends a stopped process too) or running by a
    test that failed before its own cleanup, nor anything such a run started. A group already gone is no error."""
    while _started:
        process = _started.pop()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # its pid is its group's id while any member lives
        except ProcessLookupError:
            pass
        process.communicate(timeout=RUN_TIMEOUT_S)  # reaps it and closes its pipes; a no-op where finish() did


def ctrl_c_raises() -> None:
    """In the child: SIGINT at its default, so Python turns it into KeyboardInterrupt even where the test runner
    ignores it (a shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def process_state(pid: int) -> str:
    """The one-letter state of a process in /proc: R running, S sleeping, T stopped, Z zombie."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_until_frozen(process: subprocess.Popen, timeout: float = RUN_TIMEOUT_S) -> None:
    """Until the process froze itself at its BATCHRUN_STOP_AT point (SIGSTOP, state T). The run's own pace decides
    when; the timeout only stops a hung test."""
    if not Path("/proc/self/stat").exists():
        process.kill()
        process.communicate()
        pytest.skip("needs /proc to see that the run froze")
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:  # before reading /proc: an exited child stays there until reaped here
            pytest.fail(f"the run exited ({process.returncode}) before reaching its stop point: "
                        f"{process.stderr.read()}")
        if process_state(process.pid) == "T":
            return
        if time.monotonic() > deadline:
            process.kill()
            process.communicate()
            pytest.fail(f"the run never reached its stop point in {timeout} s")
        time.sleep(0.05)


def finish(process: subprocess.Popen, args: list[str], timeout: float = RUN_TIMEOUT_S) -> Finished:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"`batchrun {' '.join(args)}` still ran after {timeout} s\nstderr:\n{stderr}")
    return Finished(args, process.returncode, stdout, stderr)


def run(args: list[str], env: dict[str, str], **kwargs) -> Finished:
    return finish(start(args, env, **kwargs), args)


def submit_args(spec: Path, model: Path, db: Path, output: Path, *extra: str) -> list[str]:
    return ["submit", str(spec), "--model", str(model), "--db", str(db), "--output", str(output), "--json", *extra]


def assert_clean_error(result: Finished, *fragments: str) -> str:
    """Failed with one `Error: ...` line naming every fragment, and no traceback."""
    assert result.returncode == 1, result.describe()
    assert "Traceback" not in result.stderr, result.describe()
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.describe()
    for fragment in fragments:
        assert fragment in errors[0], result.describe()
    return errors[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def mixed_job(path: Path, rows: int = 12, max_new_tokens: int = 8) -> Path:
    """Choice rows and generation rows alternating, so a run has several batches and many passes."""
    items = []
    for i in range(rows):
        if i % 2 == 0:
            items.append({"id": f"c{i}", "prompt": f"Review {i}: the parcel came late but intact. Happy?",
                          "choices": ["positive", "negative"]})
        else:
            items.append({"id": f"g{i}", "prompt": f"Write a short note number {i} about the meeting",
                          "max_new_tokens": max_new_tokens})
    return write_jsonl(path, items)


def fresh_home(parent: Path, source_home: Path) -> Path:
    """A state directory for one process chain, with the session's measurements (measuring costs seconds)."""
    home = parent / "home"
    home.mkdir(parents=True, exist_ok=True)
    for file in source_home.glob("*.json"):
        shutil.copy(file, home / file.name)
    return home


def done_answers(db: Path) -> dict[int, tuple]:
    """idx -> (answer, choice_probs_json, finish_reason) of every finished row, read without writing the database."""
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        columns = {row[1] for row in conn.execute("pragma table_info(rows)")}
        if not columns:
            return {}  # killed before the schema was committed
        rows = conn.execute("select idx, answer, choice_probs_json, finish_reason from rows where state = 'done'")
        return {idx: (answer, probs, reason) for idx, answer, probs, reason in rows}
    finally:
        conn.close()


def assert_same_answers(actual: list[dict], expected: list[dict]) -> None:
    """Same ids, each exactly once, in input order, with the same answers and (to float noise) probabilities."""
    assert [row["id"] for row in actual] == [row["id"] for row in expected]
    assert len({row["id"] for row in actual}) == len(actual)
    for got, want in zip(actual, expected):
        assert (got["answer"], got["finish_reason"], got["error"]) == (want["answer"], want["finish_reason"],
                                                                       want["error"]), got["id"]
        assert (got["prompt_tokens"], got["output_tokens"]) == (want["prompt_tokens"], want["output_tokens"])
        if want["choice_probs"] is None:
            assert got["choice_probs"] is None
        else:
            assert got["choice_probs"] == pytest.approx(want["choice_probs"], abs=1e-4), got["id"]
        for key in ("score", "logprob"):
            assert (got[key] is None) == (want[key] is None), (got["id"], key)
            if want[key] is not None:
                assert got[key] == pytest.approx(want[key], abs=1e-3), (got["id"], key)


@dataclass
class Reference:
    spec: Path
    model: Path
    answers: list[dict]
    work: Counter  # fault points reached: "layer" and "pass" counts are the work of one uninterrupted run


def reference_run(tmp: Path, model: Path, spec: Path, options: dict) -> Reference:
    """The job run once without interruption, in this process (no extra torch import), with the work it did."""
    from batchrun.host import faults
    from batchrun.job import JobOptions, submit

    trace = tmp / "reference-trace.txt"
    previous = os.environ.get(faults.TRACE_ENV)
    os.environ[faults.TRACE_ENV] = str(trace)
    try:
        summary = submit(spec, options=JobOptions(model=str(model), **options), output=tmp / "reference.parquet",
                         db=tmp / "reference.db")
    finally:
        if previous is None:
            del os.environ[faults.TRACE_ENV]
        else:
            os.environ[faults.TRACE_ENV] = previous
    return Reference(spec, model, read_parquet_results(Path(summary.output)), Counter(trace.read_text().split()))
