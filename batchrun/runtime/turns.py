"""One pass, several micro-batches: every micro-batch takes its turn at a layer before the next layer.

FlexGen's order (token -> layer -> micro-batch) without per-family code: each micro-batch is an
ordinary transformers forward call, suspended at each decoder layer's hook until its turn (a greenlet
each, all on one thread), so the calls take turns: (layer 0, mb 0), (layer 0, mb 1), ..., (layer 1, mb 0),
... A layer loaded once serves every sequence of the pass, while only one micro-batch's activations are
live at a time; the others' hidden states and KV caches wait in host memory.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import greenlet


# A pass's progress, as each forward call finishes its turn at a decoder layer: on_turn(turns done, turns in the pass).
TurnCallback = Callable[[int, int], None]


@dataclass
class PassProgress:
    """The layer turns of the pass in flight (every forward call's turn at every decoder layer), told to `report` as
    each ends: how a caller sees a long pass move (a pass commits nothing until it ends)."""

    total: int
    report: TurnCallback
    done: int = 0

    @classmethod
    def of(cls, report: TurnCallback | None, calls: int, layers: int) -> PassProgress | None:
        return cls(calls * layers, report) if report is not None else None

    def turn_done(self) -> None:
        self.done += 1
        self.report(min(self.done, self.total), self.total)


class PassAborted(RuntimeError):
    """Another micro-batch of the pass failed; this one stops too."""


class LayerTurns:
    """Whose turn it is: (layer, micro-batch), in the order (0, 0), (0, 1), ..., (1, 0), ... A micro-batch that
    reaches a layer before its turn hands control back to the pass's scheduler (run_interleaved), which resumes the
    others in order until the turn comes round."""

    def __init__(self, micro_batches: int):
        self.micro_batches = micro_batches
        self._turn = (0, 0)
        self._failed: BaseException | None = None
        self._scheduler: greenlet.greenlet | None = None

    def wait(self, layer: int, micro: int) -> None:
        while self._turn != (layer, micro) and self._failed is None:
            self._scheduler.switch()
        if self._failed is not None:
            raise PassAborted("another micro-batch of this pass failed") from self._failed

    def advance(self, layer: int, micro: int) -> None:
        self._turn = (layer, micro + 1) if micro + 1 < self.micro_batches else (layer + 1, 0)

    def fail(self, exc: BaseException) -> None:
        if self._failed is None:
            self._failed = exc


@dataclass
class PassGroup:
    """The micro-batches of the pass in flight, and a hook run before each (layer, micro-batch)."""

    turns: LayerTurns
    before_layer: Callable[[int, int], None] | None = None
    micro: int = 0  # the micro-batch running now: the scheduler sets it before resuming one

    @property
    def last_micro(self) -> bool:
        return self.micro == self.turns.micro_batches - 1


def run_interleaved(group: PassGroup, calls: list[Callable[[], object]], wrap) -> list[object]:
    """Run each call as micro-batch m, all on this thread, each suspended at a layer until its turn; re-raise the
    first failure after every call has unwound.

    Why not a thread per call: torch's OpenMP keeps a team of worker threads per calling thread, and
    teams taking turns on the same cores run every op slower than one team does, where greenlets on one thread run
    as fast as a plain loop (docs/performance.md#mechanisms-and-what-they-are-worth). A greenlet holds a suspended
    forward call's stack; each has its own context variables (transformers' output capture uses one), while torch's
    thread-local modes are shared: `wrap` (inference mode) is held around the whole pass, so every call runs in it.
    A stop (Ctrl-C, SIGTERM) lands in whichever call is running; the others are resumed to unwind at their next
    layer, so none is left half-run."""
    results: list[object] = [None] * len(calls)
    errors: list[BaseException] = []

    def work(micro: int) -> None:
        try:
            with wrap():
                results[micro] = calls[micro]()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors.append(exc)
            group.turns.fail(exc)

    group.turns._scheduler = greenlet.getcurrent()
    runners = [greenlet.greenlet(functools.partial(work, micro)) for micro in range(len(calls))]
    with wrap():
        try:
            _resume_until_done(group, runners)
        except BaseException as stop:
            # A stop that landed here, between two calls' turns: the calls unwind at their next layer first.
            group.turns.fail(stop)
            _resume_until_done(group, runners)
            raise
    real = [e for e in errors if not isinstance(e, PassAborted)]
    if real or errors:
        raise (real or errors)[0]
    return results


def _resume_until_done(group: PassGroup, runners: list[greenlet.greenlet]) -> None:
    while any(not runner.dead for runner in runners):
        for micro, runner in enumerate(runners):
            if not runner.dead:
                group.micro = micro
                runner.switch()
