"""The plan's streaming policy and refusals: the words people type for --streaming, when auto streams, and
the blockers and caveats a candidate carries (over budget, over the context, unknown bandwidth, disk)."""
from __future__ import annotations

import json

import pytest

from batchrun.checkpoint import kv_bytes_for_sequence, sizes_from_config
from batchrun.plan import Bandwidth, RowCost, parse_streaming
from tests.support import CONFIGS, LLAMA_70B, TINY, GiB, plan


# --- policy words -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("word, policy", [
    ("auto", "auto"), ("always", "always"), ("never", "never"), ("YES", "always"), ("on", "always"),
    ("true", "always"), ("1", "always"), ("no", "never"), ("Off", "never"), ("false", "never"), ("0", "never"),
])
def test_streaming_words_people_type_map_to_a_policy(word, policy):
    assert parse_streaming(word, env={}) == policy


def test_flag_beats_environment_which_beats_default():
    assert parse_streaming(None, env={}) == "auto"
    assert parse_streaming(None, env={"BATCHRUN_STREAMING": "off"}) == "never"
    assert parse_streaming("always", env={"BATCHRUN_STREAMING": "off"}) == "always"


def test_unknown_streaming_word_is_refused_naming_the_accepted_ones(monkeypatch):
    with pytest.raises(ValueError, match="'alwyas'.*auto, always, never"):
        parse_streaming("alwyas", env={})
    monkeypatch.setenv("BATCHRUN_STREAMING", "maybe")
    with pytest.raises(ValueError, match="BATCHRUN_STREAMING: unknown streaming policy 'maybe'"):
        parse_streaming(None)


# --- policy and blockers ----------------------------------------------------------------------------------------------


def test_auto_runs_resident_when_the_model_fits():
    candidate = plan(TINY, compute_dtype="float32")
    assert candidate.mode == "resident" and candidate.fits
    assert candidate.reason.startswith("auto: the model fits") and candidate.time.io_seconds_per_pass == 0


def test_auto_streams_a_model_that_does_not_fit_and_says_why():
    candidate = plan()
    assert candidate.mode == "streamed" and candidate.fits
    assert "over the 24.0 GiB budget" in candidate.reason and "131 GiB" in candidate.reason


def test_always_streams_even_a_model_that_fits():
    assert plan(TINY, streaming="always", compute_dtype="float32").mode == "streamed"


def test_never_on_a_model_that_does_not_fit_is_refused_with_the_numbers():
    candidate = plan(streaming="never")
    assert candidate.mode == "resident" and not candidate.fits
    assert any("resident run does not fit" in b and "24.0 GiB" in b and "131 GiB" in b for b in candidate.blockers)


def test_budget_below_one_layer_is_a_blocker():
    # two 1.6 GiB layer slots (the layer computing, the one read ahead) are over a 3 GiB budget, whatever the
    # embedding and head: the blocker shows the leanest floor, with them streamed
    candidate = plan(streaming="always", memory_budget_bytes=3 * GiB)
    assert any(b.startswith("does not fit even one layer") and "head chunk" in b and "embedding" not in b
               for b in candidate.blockers)


def test_a_row_too_long_for_the_budget_is_a_blocker():
    candidate = plan(rows=[RowCost(60_000, 1)], streaming="always", context_length=100_000)
    assert any(b.startswith("does not fit even one sequence") and "60,001 tokens" in b for b in candidate.blockers)


def test_rows_over_the_context_are_left_out_and_counted():
    candidate = plan(rows=[RowCost(9000, 4), RowCost(300, 8)])
    assert candidate.batching.passes == 8 and candidate.fits
    assert any("1 row(s) longer than the 8,192-token context" in c for c in candidate.caveats)
    assert not plan(rows=[RowCost(9000, 4)]).fits


def test_a_job_without_rows_is_sized_for_one_sequence():
    candidate = plan(rows=[], streaming="always")
    assert candidate.batching.passes == 0 and candidate.batching.batches == [] and candidate.fits
    assert (candidate.memory.peak_memory_bytes
            > candidate.memory.weights_bytes + kv_bytes_for_sequence(LLAMA_70B, 2, 4096))


def test_unknown_bandwidth_blocks_streaming_but_not_a_resident_run():
    unknown = Bandwidth(None, "assumed", "not measured")
    streamed = plan(bandwidth=unknown)
    assert "read bandwidth unknown" in streamed.blockers[0] and streamed.time.eta_seconds is None
    resident = plan(TINY, compute_dtype="float32", bandwidth=unknown)
    assert resident.fits and resident.time.eta_seconds is not None
    assert any("load the model is not counted" in c for c in resident.caveats)


def test_assumed_bandwidth_is_a_caveat():
    candidate = plan(bandwidth=Bandwidth(1e9, "assumed", "the low end of cold reads"))
    assert any("assumed read bandwidth of 1.00 GB/s" in c for c in candidate.caveats)


def test_downloading_needs_the_checkpoint_in_free_disk():
    short = plan(checkpoint_is_local=False, disk_free_bytes=100 * GiB)
    assert short.checkpoint.disk_needed_bytes == LLAMA_70B.checkpoint_bytes
    assert any("not enough disk" in b for b in short.blockers)
    assert plan(checkpoint_is_local=True, disk_free_bytes=1).fits  # read in place: nothing to download


def test_mixture_of_experts_is_read_whole_and_said_so():
    config = json.loads((CONFIGS / "llama-3-70b.json").read_text()) | {
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4}
    candidate = plan(sizes_from_config(config), streaming="always")
    assert any("8 experts" in c and "only 2 run per token" in c for c in candidate.caveats)
