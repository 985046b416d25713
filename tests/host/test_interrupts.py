"""SIGTERM and SIGHUP as a command runs: unwound like Ctrl-C, except where a stop must wait."""
import os
import signal

import pytest

from batchrun.host.signals import Stopped, stop_signals_unwind, stops_deferred


def test_sigterm_raises_stopped_and_the_previous_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped) as stopped:
        with stop_signals_unwind():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_inside_a_deferred_stretch_waits_for_its_end():
    finished = []
    with pytest.raises(Stopped):
        with stop_signals_unwind():
            with stops_deferred():
                os.kill(os.getpid(), signal.SIGHUP)
                for _ in range(1000):
                    pass
                finished.append("release")  # the stretch ran to its end
    assert finished == ["release"]


def test_an_ignored_signal_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with stop_signals_unwind():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_sigterm_during_a_runs_release_lets_the_release_finish(tmp_path):
    """Cut short, the release would leave a finished run 'running': the next run would call it dead."""
    from batchrun.job import release_run
    from batchrun.store import Store

    with Store(tmp_path / "j.db") as store:
        job_id = store.ensure_job("f" * 16, spec_path="s.jsonl", model="m", settings={}, rows=[(0, "a")])
        store.acquire(job_id)
        release = store.release

        def release_with_a_stop_midway(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
            release(*args)

        store.release = release_with_a_stop_midway
        with pytest.raises(Stopped), stop_signals_unwind():
            release_run(store, job_id, "done")
        assert store.status(job_id)["state"] == "done" and store.status(job_id)["running_pid"] is None
