"""Where batchrun keeps its state: the database, the default model, cached measurements."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from batchrun.errors import SettingRefused
from batchrun.host.processes import HOST

HOME_ENV = "BATCHRUN_HOME"
SPECS_DIR = "specs"  # under the state directory: spec files batchrun writes (rows given in memory, side jobs)


def state_dir(create: bool = True) -> Path:
    """The state directory: $BATCHRUN_HOME, else the user's cache directory + /batchrun. Created on demand
    (`create=False`: where it is, for commands that only read)."""
    explicit = os.environ.get(HOME_ENV)
    if explicit:
        path = Path(explicit).expanduser()
    else:
        cache_root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(cache_root) / "batchrun"
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        where = f"{HOME_ENV}={explicit}" if explicit else str(path)
        reason = "a file, not a directory" if path.is_file() else error.strerror or error
        raise SettingRefused(f"{where}: cannot be used as batchrun's state directory ({reason})"
                             f"; set {HOME_ENV} to a writable directory") from None
    return path


def default_db_path(create: bool = True) -> Path:
    return state_dir(create) / "batchrun.db"


def stored_spec(data: bytes, prefix: str, suffix: str) -> Path:
    """The spec file holding `data` under the state directory, named by its hash; written once, atomically, so the
    name always stands for its bytes and a job that records the path can resume from it."""
    directory = state_dir() / SPECS_DIR
    path = directory / f"{prefix}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / f".{path.name}.tmp-{HOST}-{os.getpid()}"
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    return path
