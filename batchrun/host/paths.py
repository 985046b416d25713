"""Where batchrun keeps its state: the database, the default model, cached measurements."""
from __future__ import annotations

import os
from pathlib import Path

from batchrun.errors import SettingRefused

HOME_ENV = "BATCHRUN_HOME"


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
