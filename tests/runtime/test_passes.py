"""The turns of a pass's micro-batches (passes.run_interleaved), and a stop signal unwinding them, without a model."""
import contextlib
import os
import signal
import threading

import pytest

from batchrun.host import Stopped, stop_signals_unwind
from batchrun.runtime.turns import LayerTurns, PassAborted, PassGroup, run_interleaved


def _walker(group, micro, layers, log, fail_at=None):
    def walk():
        for layer in range(layers):
            group.turns.wait(layer, micro)
            if (layer, micro) == fail_at:
                raise RuntimeError("out of memory in a layer")
            log.append((layer, micro, group.micro, threading.get_ident()))
            group.turns.advance(layer, micro)
        return f"answers of micro-batch {micro}"
    return walk


def test_micro_batches_take_each_layer_in_turn_on_the_calling_thread():
    group = PassGroup(turns=LayerTurns(3))
    log = []
    results = run_interleaved(group, [_walker(group, m, 4, log) for m in range(3)], contextlib.nullcontext)
    assert results == [f"answers of micro-batch {m}" for m in range(3)]
    assert [(layer, micro) for layer, micro, _, _ in log] == [(layer, m) for layer in range(4) for m in range(3)]
    assert all(seen == micro for _, micro, seen, _ in log)  # group.micro names the one running
    assert {thread for *_, thread in log} == {threading.get_ident()}  # one OpenMP team computes them all


def test_a_failing_micro_batch_fails_the_pass_with_its_own_error_after_the_others_unwind():
    group = PassGroup(turns=LayerTurns(3))
    log, unwound = [], []

    def guarded(walk, micro):
        def call():
            try:
                return walk()
            finally:
                unwound.append(micro)
        return call

    calls = [guarded(_walker(group, m, 4, log, fail_at=(2, 1)), m) for m in range(3)]
    with pytest.raises(RuntimeError, match="out of memory in a layer"):
        run_interleaved(group, calls, contextlib.nullcontext)
    assert sorted(unwound) == [0, 1, 2]
    assert (2, 0) in [(layer, micro) for layer, micro, _, _ in log]
    assert not [entry for entry in log if entry[0] >= 3 or entry[:2] == (2, 2)]  # nothing ran past the failure


def test_the_calls_run_inside_the_wrapping_context_from_first_to_last():
    group = PassGroup(turns=LayerTurns(2))
    depth = []

    @contextlib.contextmanager
    def wrap():
        depth.append(1)
        try:
            yield
        finally:
            depth.pop()

    seen = []

    def call(micro):
        def walk():
            for layer in range(3):
                group.turns.wait(layer, micro)
                seen.append(len(depth))
                group.turns.advance(layer, micro)
        return walk

    run_interleaved(group, [call(0), call(1)], wrap)
    # Each call's own context plus the one held around the pass: a call that finished first cannot take the mode
    # away from one still running.
    assert min(seen) >= 2 and depth == []


def test_an_aborted_micro_batch_raises_pass_aborted_at_its_next_turn():
    turns = LayerTurns(2)
    turns.fail(RuntimeError("disk gone"))
    with pytest.raises(PassAborted):
        turns.wait(0, 1)


def test_a_stop_unwinds_every_micro_batch_of_the_pass_before_it_goes_on():
    """SIGTERM lands in whichever micro-batch is computing: it stops there, the others unwind at their next layer
    (none is left suspended half-way), and the stop reaches the caller. The signal is sent from inside micro-batch 1's
    layer 3, so where it lands does not depend on timing."""
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
