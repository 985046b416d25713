"""A small process between a benchmark and the command it measures: it runs the command, waits for it without
polling, and writes what the kernel reports of it to a JSON file.

Why a process of its own: wait4's ru_maxrss keeps the high-water mark the child had before its exec, and a child
forked by the benchmark (which holds a tokenizer, torch and its own measurements) starts at the benchmark's RSS.
Forked from this small process instead, the command's ru_maxrss is its own peak, exactly, however short-lived.
And nothing polls the command: reading /proc/<pid>/status every 20 ms for the peak and checking for the exit every
10 ms takes a core's time slices from the measured pass on 2 cores: the classification sweep's pass reads 20.0 s
polled against 19.5 s unpolled (4 alternating pairs, 2-core AVX512-BF16 EPYC).

    python benchmarks/launcher.py REPORT [--cgroup-procs FILE] -- COMMAND...

--cgroup-procs: the command joins that cgroup (its cgroup.procs file) before its exec, so its every byte is
charged to the cap and this process's are not. The report: returncode (negative: the signal that ended it),
ru_maxrss_bytes, user_seconds, system_seconds, wall_seconds (spawn to exit). SIGTERM and SIGINT are passed on.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def run(report_path: str, command: list[str], procs_file: str | None) -> int:
    def join_cgroup() -> None:  # runs in the child between fork and exec
        with open(procs_file, "w") as handle:
            handle.write(str(os.getpid()))

    start = time.perf_counter()
    child = subprocess.Popen(command, preexec_fn=join_cgroup if procs_file else None)
    for passed_on in (signal.SIGTERM, signal.SIGINT):
        signal.signal(passed_on, lambda number, _frame: child.send_signal(number))
    _, status, usage = os.wait4(child.pid, 0)  # retried after a signal's handler (PEP 475)
    wall = time.perf_counter() - start
    child.returncode = returncode = os.waitstatus_to_exitcode(status)
    maxrss_unit = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    report = {"returncode": returncode, "ru_maxrss_bytes": usage.ru_maxrss * maxrss_unit,
              "user_seconds": usage.ru_utime, "system_seconds": usage.ru_stime, "wall_seconds": wall}
    with open(report_path, "w") as handle:
        json.dump(report, handle)
    return returncode


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 1 or argv.index("--") == len(argv) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1:]
    procs_file = None
    if "--cgroup-procs" in options:
        at = options.index("--cgroup-procs")
        procs_file = options[at + 1]
        del options[at:at + 2]
    returncode = run(options[0], command, procs_file)
    return returncode if returncode >= 0 else 128 - returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
