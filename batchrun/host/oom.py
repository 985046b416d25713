"""Did the kernel's out-of-memory killer end the previous run? No torch.

A SIGKILL leaves no trace in the process itself, so at the start of each run we note the memory
cgroup we run in and its OOM-kill counter; the next run compares the counter of that same cgroup.
"""
from __future__ import annotations

from pathlib import Path

from batchrun.host.memory import CGROUP_ROOT, PROC_CGROUP, memory_cgroups


def memory_cgroup_dir(proc_cgroup: Path = PROC_CGROUP) -> Path | None:
    """The directory of this process's memory cgroup (v1 `memory` controller, else the v2 unified one)."""
    cgroups = dict(memory_cgroups(proc_cgroup))
    if "v1" in cgroups:
        return CGROUP_ROOT / "memory" / cgroups["v1"].lstrip("/")
    if "v2" in cgroups:
        return CGROUP_ROOT / cgroups["v2"].lstrip("/")
    return None


def oom_kill_count(cgroup: Path | None) -> int | None:
    """The cgroup's count of processes killed for lack of memory, None when the kernel does not say."""
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def killed_by_oom(previous_run: dict | None, next_run: dict | None = None) -> bool:
    """True when `previous_run` died without a word (not a Ctrl-C or SIGTERM, which it reports) and its cgroup
    counted an OOM kill after it started: by the start of `next_run` (the run after it, in the same cgroup), or by
    now when it was the last run."""
    if not previous_run or previous_run.get("end_state") != "died":
        return False
    cgroup, before = previous_run.get("memory_cgroup"), previous_run.get("oom_kills_at_start")
    if not cgroup or before is None:
        return False
    if next_run is None:
        after = oom_kill_count(Path(cgroup))
    elif next_run.get("memory_cgroup") == cgroup:
        after = next_run.get("oom_kills_at_start")
    else:
        return False  # counted in another cgroup: nothing to compare
    return after is not None and after > before


def batch_cap_after_oom(runs: list[dict]) -> tuple[int, dict] | None:
    """(at most this many sequences per pass, the run that set it) after any OOM kill among `runs` (oldest
    first): half the batch the killed run had, so a resume that is itself stopped (Ctrl-C, a reboot) does not go
    back to the batch that was killed. None when no run of the job was killed for lack of memory."""
    cap = None
    for run, after in zip(runs, [*runs[1:], None]):
        if killed_by_oom(run, after):
            halved = max(1, (run.get("batch_size") or 2) // 2)
            if cap is None or halved <= cap[0]:
                cap = (halved, run)
    return cap
