"""SIGTERM and SIGHUP unwound like Ctrl-C, and short stretches a stop (or a Ctrl-C) must wait for. No torch."""
from __future__ import annotations

import contextlib
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_deferred = threading.local()  # .pending: the signal that arrived while stops were deferred (main thread only)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (docker stop, systemd, Slurm, a closed terminal): unwound like Ctrl-C, so the run is marked
    interrupted, its lock released and a half-written output removed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum, frame):
    if getattr(_deferred, "depth", 0):
        _deferred.pending = signum
        return
    raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_unwind():
    """SIGTERM and SIGHUP raise Stopped while a command runs; a signal the caller ignores (nohup), or handles in C
    (getsignal gives None), is left as it is."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            handler = signal.getsignal(signum)
            if handler is not signal.SIG_IGN and handler is not None:
                previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stops_deferred():
    """A stop that arrives inside waits for the end of it (closing a run's record: a stop there would leave a
    finished run looking dead). Ctrl-C is not deferred."""
    _deferred.depth = getattr(_deferred, "depth", 0) + 1
    try:
        yield
    finally:
        _deferred.depth -= 1
        pending = getattr(_deferred, "pending", None)
        if not _deferred.depth and pending is not None:
            _deferred.pending = None
            raise Stopped(pending)


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C inside waits for the end of it, then raises KeyboardInterrupt: what a stopped run still owes (its record
    closed, its report written) is done though an impatient second Ctrl-C follows the first. Main thread only; an
    ignored SIGINT (a background job) stays ignored."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or handler in (signal.SIG_IGN, None):
        yield
        return
    pressed = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if pressed:  # only where nothing is raised already: an interrupted run is unwinding as it was asked to
        raise KeyboardInterrupt
