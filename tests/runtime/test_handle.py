"""A resident and a streamed model offer the executor the same handle (ModelHandle): the same passes, told turn by
turn, and the decode read-ahead set through a method, never by setting an attribute."""
from __future__ import annotations

import pytest
import torch

from batchrun.runtime import LayerReads, ModelHandle, open_model
from tests.support import sample_ids


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_either_mode_is_a_model_handle_that_reports_each_turn_while_asked(tiny_checkpoint, mode):
    with open_model(tiny_checkpoint("llama"), mode=mode, device="cpu", dtype=torch.float32) as model:
        assert isinstance(model, ModelHandle)
        ids = sample_ids(model.config.vocab_size)
        calls = [lambda: model.model(ids[:1]).logits, lambda: model.model(ids[1:]).logits]
        turns = []
        model.report_turns(lambda done, total: turns.append((done, total)))
        first = model.run_pass(calls)
        total = len(calls) * len(model.layers)
        assert turns == [(done, total) for done in range(1, total + 1)]
        model.report_turns(None)
        assert all(torch.equal(a, b) for a, b in zip(model.run_pass(calls), first)) and len(turns) == total
        assert model.passes == 2


def test_decode_passes_read_ahead_as_far_as_a_prefill_once_asked(tiny_checkpoint):
    reads = LayerReads(depth=1, decode_depth=2)
    with open_model(tiny_checkpoint("llama"), mode="streamed", device="cpu", dtype=torch.float32,
                    reads=reads) as model:
        ids = sample_ids(model.config.vocab_size)
        model.run_pass([lambda: model.model(ids).logits], light=True)
        assert (model.prefetch_depth, model.decode_prefetch_depth, model.slots.count) == (1, 2, 3)
        model.use_prefill_read_ahead_in_decode()
        model.run_pass([lambda: model.model(ids).logits])
        model.run_pass([lambda: model.model(ids).logits], light=True)
        assert (model.decode_prefetch_depth, model.slots.count) == (1, 2)


def test_resident_models_have_no_read_ahead_to_change(tiny_checkpoint):
    with open_model(tiny_checkpoint("llama"), mode="resident", device="cpu", dtype=torch.float32) as model:
        model.use_prefill_read_ahead_in_decode()  # the executor asks either mode
        assert model.run_pass([lambda: 1], light=True) == [1]
