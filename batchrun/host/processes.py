"""Processes as the kernel sees them: this host's name, whether a pid still runs, and an identity that survives pid
reuse. Linux /proc where it exists; elsewhere only the pid is checked.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

HOST = socket.gethostname()


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (field 3 on), None where /proc is unavailable or the pid is gone.
    Field 2 (the name) may hold spaces and parentheses: the fields are counted after the last ')'."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_identity(pid: int) -> str | None:
    """'<boot id>:<start time in ticks>' on Linux, unique to one process across pid reuse and reboots.

    None where /proc is unavailable (macOS, Windows): there only the pid is checked.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    fields = _stat_fields(pid)
    # starttime is field 22 overall, the 20th after the name
    return None if fields is None else f"{boot_id}:{fields[19]}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    # A killed process its parent has not reaped yet (a supervisor restarting the job before wait()) still takes
    # signals, but runs nothing: a zombie holds no lock.
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    fields = _stat_fields(pid)  # None (no /proc, or gone): the caller's signal check decides
    return fields is not None and fields[0] in ("Z", "X")
