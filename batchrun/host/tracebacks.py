"""Failures batchrun did not foresee: the full traceback kept in a log file under the state directory, so the user
sees one line naming that file and a bug report can carry the file.

A foreseen failure (a BatchrunError) says what to do in its message and needs no traceback; anything else is a
fault in batchrun, and its traceback is what finds the fault.
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from batchrun.errors import BatchrunError
from batchrun.host.machine import package_version
from batchrun.host.paths import state_dir

LOGS_DIR = "logs"  # under the state directory
_SAVED_AS = "_batchrun_traceback_log"  # set on an exception once its traceback is saved: saved once, named alike
# Values a traceback log must not carry: the hub token, however it was given.
_SECRET_OPTIONS = ("--hf-token",)
_SECRET_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def foreseen(error: BaseException) -> bool:
    """Whether batchrun foresaw the failure: its message alone tells the user what happened and what to do."""
    return isinstance(error, BatchrunError)


def failure_reason(error: BaseException, secrets: Sequence[str | None] = ()) -> str:
    """Why a run failed, as its record keeps it: the error's class and message, and for a failure batchrun did not
    foresee also the log file holding its traceback. `secrets` (a hub token) are written as ***."""
    if foreseen(error):
        return f"{type(error).__name__}: {error}"
    reason = redacted(f"{type(error).__name__}: {one_line(str(error))}", secrets)
    saved = save_traceback(error, secrets)
    return f"{reason} (unexpected; traceback in {saved})" if saved else f"{reason} (unexpected)"


def one_line(text: str, limit: int = 400) -> str:
    """A message fit for one terminal line: whitespace runs (newlines too) as one space, cut at `limit`."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def save_traceback(error: BaseException, secrets: Sequence[str | None] = ()) -> Path | None:
    """The file holding `error`'s traceback, written on the first call for that error (under the state directory's
    logs/, else the temporary directory where the state directory cannot be written); None where neither can.
    `secrets` (a hub token) are written as ***, as are those this process was given (secrets_in)."""
    saved = getattr(error, _SAVED_AS, None)
    if saved is not None:
        return saved
    text = redacted(_log_text(error), secrets)
    for directory in _log_directories():
        try:
            path = _new_log_file(directory, text)
        except OSError:
            continue
        try:
            setattr(error, _SAVED_AS, path)
        except AttributeError:  # an exception type that takes no attributes: a later call writes another file
            pass
        return path
    return None


def secrets_in(arguments: Sequence[str]) -> list[str]:
    """The hub token in a command's arguments (--hf-token T, --hf-token=T) and in the environment."""
    found = [os.environ.get(name) for name in _SECRET_VARIABLES]
    for before, argument in zip(["", *arguments], arguments):
        if before in _SECRET_OPTIONS:
            found.append(argument)
        elif argument.startswith(tuple(f"{option}=" for option in _SECRET_OPTIONS)):
            found.append(argument.split("=", 1)[1])
    return [secret for secret in found if secret]


def redacted(text: str, secrets: Sequence[str | None] = ()) -> str:
    """`text` with every secret written as ***: those given, and those of this process's command line and
    environment."""
    for secret in [*filter(None, secrets), *secrets_in(sys.argv)]:
        text = text.replace(secret, "***")
    return text


def _log_directories():
    try:
        yield state_dir() / LOGS_DIR
    except BatchrunError:  # the state directory is unusable: the temporary directory still keeps the traceback
        pass
    yield Path(tempfile.gettempdir()) / "batchrun-logs"


def _new_log_file(directory: Path, text: str) -> Path:
    """A file of its own in `directory`, named by the time (UTC) and this process, holding `text`."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(100):
        path = directory / f"error-{stamp}-{os.getpid()}{f'-{attempt}' if attempt else ''}.log"
        try:
            with open(path, "x", encoding="utf-8") as handle:
                handle.write(text)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{directory}: no free log file name for {stamp}")


def _log_text(error: BaseException) -> str:
    header = [f"batchrun {package_version('batchrun')}, Python {platform.python_version()} on {platform.platform()}",
              f"time     {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
              f"command  {' '.join(sys.argv)}", ""]
    return "\n".join(header) + "".join(traceback.format_exception(type(error), error, error.__traceback__))
