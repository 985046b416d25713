"""Runs and locks: whether the process named in a lock still lives (so a crashed run is taken over), run durations."""
from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

HOST = socket.gethostname()

# A process on another machine cannot be signalled; its lock counts as held while its heartbeat
# (refreshed on every pass and every committed batch) is younger than this.
FOREIGN_LOCK_STALE_AFTER_S = 2 * 3600


def process_identity(pid: int) -> str | None:
    """'<boot id>:<start time in ticks>' on Linux, unique to one process across pid reuse and reboots.

    None where /proc is unavailable (macOS, Windows): there only the pid is checked.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name) may hold spaces and parentheses: count fields after the last ')'.
    # starttime is field 22 overall, the 20th after the name.
    start_ticks = stat[stat.rindex(")") + 2 :].split()[19]
    return f"{boot_id}:{start_ticks}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def lock_holder_alive(lock: Mapping, *, held_by_this_process: bool, now: datetime | None = None) -> bool:
    """True when the process that wrote `lock` (a locks row) may still be running the job."""
    if lock["host"] != HOST:
        now = now or datetime.now(timezone.utc)
        heartbeat_age = (now - datetime.fromisoformat(lock["heartbeat_at"])).total_seconds()
        return heartbeat_age < FOREIGN_LOCK_STALE_AFTER_S
    pid = lock["pid"]
    if pid == os.getpid():
        # Our own pid: either this process holds the lock, or a previous process with the same pid
        # (a restarted container's pid 1, a reboot) left it behind.
        return held_by_this_process
    if not pid_alive(pid):
        return False
    recorded, current = lock["process_identity"], process_identity(pid)
    # The pid is alive, but a process started later under the same pid cannot be the holder.
    return recorded is None or current is None or recorded == current


def run_seconds(run: Mapping, *, live: bool, now: datetime) -> float:
    """How long a runs row lasted; a live run counts up to now, a dead unclosed one up to its last commit."""
    started = datetime.fromisoformat(run["started_at"])
    if run["ended_at"]:
        ended = datetime.fromisoformat(run["ended_at"])
    elif live:
        ended = now
    else:
        ended = datetime.fromisoformat(run["last_active_at"] or run["started_at"])
    return max(0.0, (ended - started).total_seconds())


def effective_job_state(stored: str, held_by_live_process: bool) -> str:
    # A job left 'running' by a process that died (kill -9, OOM, power cut) is resumable, not running.
    return "interrupted" if stored == "running" and not held_by_live_process else stored
