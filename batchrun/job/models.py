"""Models kept open between the jobs of one process. A Ray worker runs shard after shard of one job, each through the
executor; opening the model each time would read every resident weight again per shard. A worker that asks for it
(keep_models_open) keeps the last model a run opened, and the next run that would open the same checkpoint the same
way (mode, device, dtype, linear kernel, layer reads) takes it as it is. A plain `submit` keeps nothing: its model
is closed when the run ends. No torch here: the opener brings it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from batchrun.host import resident_bytes


@dataclass(frozen=True)
class ModelKey:
    """Everything open_model is asked for: a model opened with all of it equal serves any run that asks the same."""
    checkpoint: str
    mode: str
    device: str
    dtype: str
    trust_remote_code: bool
    linear_kernel: str
    reads: object  # runtime.LayerReads (frozen, so comparable) of a streamed model; None for a resident one


class KeptModels:
    """One model kept open (the last one asked for); another key closes it and opens the new one."""

    def __init__(self) -> None:
        self._key: ModelKey | None = None
        self._model = None
        self.opened = 0  # models this process has opened through it
        self.held_bytes = 0  # what opening the kept model added to this process's resident memory

    def open(self, key: ModelKey, opener: Callable[[], object]) -> tuple[object, bool]:
        """(the model for `key`, whether it was already open)."""
        if self._model is not None and key == self._key:
            return self._model, True
        self.close()
        before = resident_bytes() or 0
        self._model, self._key = opener(), key
        self.held_bytes = max((resident_bytes() or 0) - before, 0)
        self.opened += 1
        return self._model, False

    def close(self) -> None:
        if self._model is not None:
            model, self._model, self._key, self.held_bytes = self._model, None, None, 0
            model.close()


_kept: KeptModels | None = None


def keep_models_open() -> KeptModels:
    """From now on this process keeps the last model a run opened for the next run (a Ray worker calls this once)."""
    global _kept
    if _kept is None:
        _kept = KeptModels()
    return _kept


def kept_models() -> KeptModels | None:
    """The process's kept models, None where runs close their model (every process but a Ray worker)."""
    return _kept


def kept_model_bytes() -> int:
    """Resident memory the kept model holds: the next plan counts it among its weights, so the memory available
    now (which leaves it out) gets it back, or a kept resident model would make the next shard plan streamed."""
    return _kept.held_bytes if _kept is not None else 0
