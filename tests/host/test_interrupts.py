"""SIGTERM and SIGHUP as a command runs: unwound like Ctrl-C, except where a stop must wait."""
import contextlib
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
    from batchrun.job.execute import _release
    from batchrun.store.database import Store

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
            _release(store, job_id, "done")
        assert store.status(job_id)["state"] == "done" and store.status(job_id)["running_pid"] is None


def test_a_stop_unwinds_every_micro_batch_of_the_pass_before_it_goes_on():
    """SIGTERM lands in whichever micro-batch is computing: it stops there, the others unwind at their next layer
    (none is left suspended half-way), and the stop reaches the caller. The signal is sent from inside micro-batch 1's
    layer 3, so where it lands does not depend on timing."""
    from batchrun.runtime.turns import LayerTurns, PassGroup, run_interleaved

    group = PassGroup(turns=LayerTurns(2))
    layers_done, unwound = [], []

    def micro_batch(micro):
        def walk():
            try:
                for layer in range(10):
                    group.turns.wait(layer, micro)
                    if (layer, micro) == (3, 1):
                        os.kill(os.getpid(), signal.SIGTERM)
                        for _ in range(1000):  # the handler runs between bytecodes
                            pass
                    layers_done.append((layer, micro))
                    group.turns.advance(layer, micro)
            finally:
                unwound.append(micro)
        return walk

    with pytest.raises(Stopped) as stopped, stop_signals_unwind():
        run_interleaved(group, [micro_batch(0), micro_batch(1)], lambda: contextlib.nullcontext())
    assert stopped.value.signum == signal.SIGTERM
    # In turn order up to the stop: micro-batch 0 had run layer 3, micro-batch 1 stopped in it; no layer after.
    assert layers_done == [(layer, micro) for layer in range(3) for micro in (0, 1)] + [(3, 0)]
    assert sorted(unwound) == [0, 1]
