"""How long a plan says a job takes: reads, FLOPs and memory traffic per pass, the refill schedule, each
forward call's fixed cost, and decode rates by row count."""
from __future__ import annotations

import pytest

from batchrun.checkpoint import kv_bytes_for_sequence
from batchrun.plan import Bandwidth, RowCost, without_prefix
from batchrun.plan.batching import passes_for, prefill_call_count
from batchrun.plan.rates import HOST_FRESH_PAGE_SLOWDOWN
from batchrun.plan.refill import refill_schedule
from batchrun.plan.timing import (KV_COPIES_PER_DECODE, PassPricing, host_streaming_bytes, job_timeline,
                                  pass_memory_bytes, weight_rate_at)
from tests.support import LLAMA_70B, TINY, GiB, plan


@pytest.mark.parametrize("prefetch, efficiency", [(True, 1.0), (False, 0.70)])
def test_io_bound_eta_is_one_read_of_the_layers_per_pass(prefetch, efficiency):
    rows = [RowCost(300, 8)] * 4 + [RowCost(300, 0, (1, 1))] * 4
    candidate = plan(rows=rows, streaming="always", prefetch=prefetch, compute_flops_per_s=1e30)
    per_pass = LLAMA_70B.decoder_bytes / 1e9 / efficiency
    assert candidate.batching.passes == 1 + 8
    assert candidate.time.io_seconds_per_pass == pytest.approx(per_pass)
    assert candidate.time.eta_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + 9 * per_pass)
    assert candidate.time.first_answer_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + per_pass)
    assert candidate.time.answers_per_hour == pytest.approx(8 / candidate.time.eta_seconds * 3600)


def test_generation_passes_follow_the_refill_schedule():
    """A place a finished row leaves is taken in the next pass: 5 passes where batches would make 6 (rows of 1 and 2
    new tokens, then 2 and 4), the lower bound; the first answer comes out of the first pass."""
    rows = [RowCost(300, 1), RowCost(300, 4), RowCost(300, 2), RowCost(300, 2)]
    candidate = plan(rows=rows, streaming="always", compute_flops_per_s=1e30, batch_size=2)
    per_pass = LLAMA_70B.decoder_bytes / 1e9
    assert passes_for(rows, candidate.batching.batches) == 6
    assert candidate.batching.passes == candidate.batching.lower_bound_passes == 5
    assert candidate.time.eta_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + 5 * per_pass)
    assert candidate.time.first_answer_seconds == pytest.approx(LLAMA_70B.non_decoder_bytes / 1e9 + per_pass)


def test_long_prefill_on_a_slow_cpu_is_compute_bound_and_said_so():
    candidate = plan(rows=[RowCost(4000, 1)] * 8, streaming="always", bandwidth=Bandwidth(1e12, "declared", "x"),
                     compute_flops_per_s=1e11)
    # one pass per batch: choice-like rows
    for batch, seconds in zip(candidate.batching.batches, candidate.time.pass_seconds):
        assert seconds > 2 * LLAMA_70B.decoder_params * len(batch) * 4000 / 1e11
    assert candidate.time.seconds_per_pass == candidate.time.compute_seconds_per_pass
    assert any("compute-bound" in c for c in candidate.caveats)


def test_decode_passes_take_as_long_as_streaming_the_weights_and_kv_cache_from_memory():
    """A decode step of a few sequences is bound by RAM, not FLOPs (several times slower on a CPU): with the memory
    rate measured, the median (decode) pass is every weight plus the KV cache moved KV_COPIES_PER_DECODE times."""
    rows = [RowCost(300, 8)] * 4
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11)
    flops_only = plan(**options)
    bound = plan(**options, memory_bytes_per_s=1e10)
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 2
    kv_at = [4 * kv_bytes_for_sequence(LLAMA_70B, 2, 300 + step) for step in range(1, 8)]
    memory_rate = 1e10 / HOST_FRESH_PAGE_SLOWDOWN  # on the host every pass also faults in fresh pages
    decode = sorted((weights + KV_COPIES_PER_DECODE * kv) / memory_rate for kv in kv_at)
    assert bound.time.memory_bytes_per_s == 1e10 and flops_only.time.memory_bytes_per_s is None
    assert bound.time.seconds_per_pass == pytest.approx((decode[3] + decode[4]) / 2)  # median of 1 prefill + 7 decodes
    assert bound.time.seconds_per_pass > 5 * flops_only.time.seconds_per_pass
    # the prefill (1200 tokens) stays FLOP-bound: its weights stream once for all of them
    assert bound.time.eta_seconds - flops_only.time.eta_seconds == pytest.approx(
        sum(decode) - 7 * flops_only.time.seconds_per_pass, rel=0.01)


def test_decode_passes_are_priced_at_the_rate_their_row_count_reads_the_layer_matrices():
    """With rates measured by row count (measure.decode_rates), each decode pass's weights stream at its own rows'
    rate, interpolated: 4 sequences at 4 rows' 5 GB/s take twice the 10 GB/s memory rate. The prefill and the KV
    cache are priced as before."""
    rows = [RowCost(300, 8)] * 4
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11,
                   memory_bytes_per_s=1e10)
    flat = plan(**options)
    by_rows = plan(**options, decode_rates={1: 2e10, 4: 5e9, 16: 1e9})
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 2
    assert by_rows.time.pass_seconds[0] == flat.time.pass_seconds[0]  # the prefill
    for priced, before in zip(by_rows.time.pass_seconds[1:], flat.time.pass_seconds[1:]):
        assert priced - before == pytest.approx(weights / (5e9 / HOST_FRESH_PAGE_SLOWDOWN)
                                                - weights / (1e10 / HOST_FRESH_PAGE_SLOWDOWN))
    assert plan(**options | dict(memory_bytes_per_s=None), decode_rates={4: 5e9}).time.pass_seconds == \
        plan(**options | dict(memory_bytes_per_s=None)).time.pass_seconds  # FLOPs alone: no memory terms at all


def test_every_forward_call_through_a_layer_adds_the_layers_fixed_cost_to_its_pass():
    """Beyond its roofline, a pass pays a decoder layer's fixed cost (Python, small ops) once per layer for each of
    its forward calls: the prefill's calls cut by length plus the shared prefix's own, each decode call."""
    rows = [RowCost(1200, 4)] * 2 + [RowCost(240, 4)] * 2  # a 200-token shared prefix, then 1,000 or 40 tokens
    options = dict(rows=rows, streaming="never", memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11,
                   memory_bytes_per_s=1e10, shared_prefix_tokens=200)
    bare, with_calls = plan(**options), plan(**options, layer_call_seconds=1e-3)
    own = [without_prefix(row, 200) for row in rows]
    calls = prefill_call_count(own, range(4), bare.batching.micro_batch_size, "cpu")
    assert bare.batching.passes == 4 and calls == 2  # cut by length
    layers = LLAMA_70B.num_layers
    assert with_calls.time.pass_seconds[0] - bare.time.pass_seconds[0] == pytest.approx(layers * (calls + 1) * 1e-3)
    for priced, before in zip(with_calls.time.pass_seconds[1:], bare.time.pass_seconds[1:]):
        assert priced - before == pytest.approx(layers * 1e-3)  # the four sequences decode in one call
    assert with_calls.time.eta_seconds > bare.time.eta_seconds


def test_a_host_streaming_with_a_reader_decodes_on_one_thread_fewer():
    """stream.py leaves a core to the reader in decode passes: on 2 threads a decode pass computes on one, its
    roofline twice as long (each layer call's fixed cost, Python, stays what it is); the prefill keeps every thread,
    and so do decode passes whose linears widen a narrower checkpoint's tiles on every core, a run without a reader
    thread and a resident one."""
    options = dict(rows=[RowCost(300, 4)] * 4, streaming="always", bandwidth=Bandwidth(1e15, "declared", "fast"),
                   memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11, memory_bytes_per_s=1e10,
                   layer_call_seconds=1e-4)
    one, two = plan(**options, compute_threads=1), plan(**options, compute_threads=2)
    assert two.time.pass_seconds[0] == one.time.pass_seconds[0]  # the prefill
    calls = LLAMA_70B.num_layers * 1e-4  # one decode call through every layer
    for decode_two, decode_one in zip(two.time.pass_seconds[1:], one.time.pass_seconds[1:]):
        assert decode_two - calls == pytest.approx(2 * (decode_one - calls))
    for unchanged in (dict(compute_dtype="float32"), dict(prefetch=False), dict(streaming="never")):
        assert plan(**options | unchanged, compute_threads=2).time.pass_seconds == \
            plan(**options | unchanged, compute_threads=1).time.pass_seconds


def test_decode_micro_batches_that_cannot_merge_are_priced_a_call_each():
    """Sliding-window caches of rows longer than the window cannot be padded and stacked: each admission's
    micro-batch decodes in a call of its own while one of its rows lives, and each call reads every weight from RAM
    once more. Row 0 ends after 2 tokens; row 2, admitted into its place, decodes beside row 1 in two calls."""
    rows = [RowCost(600, 2), RowCost(600, 4), RowCost(600, 4), RowCost(600, 4)]
    schedule = refill_schedule(rows, [0, 1, 2, 3], 2, 10**9)
    assert [(p.admitted, p.decoding) for p in schedule[:4]] == [((0, 1), ()), ((), (0, 1)), ((2,), (1,)),
                                                                ((), (1, 2))]
    pricing = PassPricing(LLAMA_70B, 2, "cpu", flops_per_s=4e11, memory_bytes_per_s=1e10, layer_call_seconds=1e-4)
    merged = job_timeline(pricing, rows, [], None, schedule=schedule).compute_seconds
    unmerged = job_timeline(pricing, rows, [], None, schedule=schedule, decode_merges=False).compute_seconds
    assert unmerged[:3] == merged[:3]  # one micro-batch alive until row 2 joins
    weights = pass_memory_bytes(LLAMA_70B, 2, 2, 604, True)[0]
    assert unmerged[3] - merged[3] == pytest.approx(weights / 1e10 + LLAMA_70B.num_layers * 1e-4)


def test_a_row_counts_weight_rate_is_interpolated_in_time_per_byte():
    rates = {1: 2e10, 4: 1e10, 16: 4e9}
    assert weight_rate_at(rates, 1) == 2e10 and weight_rate_at(rates, 4) == 1e10
    assert weight_rate_at(rates, 10) == pytest.approx(1 / (0.5 / 1e10 + 0.5 / 4e9))  # halfway from 4 to 16 rows
    assert weight_rate_at(rates, 32) == pytest.approx(2e9)  # past the last: time per byte doubles with the rows
    assert weight_rate_at({8: 1e10}, 2) == 1e10  # below the fewest measured: their rate


def test_a_host_streaming_pass_also_moves_the_layers_through_ram_copied_and_a_prefill_widened():
    """The kernel copies each layer out of the page cache, and for a prefill a bf16 checkpoint computed in float32 is
    widened in its slot (a decode pass widens tiles inside its matmuls): RAM traffic the host's passes share; an
    accelerator computes beside it, a resident run has none."""
    decoder = LLAMA_70B.decoder_bytes  # bf16
    assert host_streaming_bytes(LLAMA_70B, 4) == 2 * decoder + decoder + 2 * decoder  # copy; read bf16, write f32
    assert host_streaming_bytes(LLAMA_70B, 4, decode=True) == 2 * decoder  # the copy only
    assert host_streaming_bytes(LLAMA_70B, 2) == 2 * decoder  # computed at its stored dtype: the copy only
    options = dict(rows=[RowCost(300, 8)] * 4, streaming="always", bandwidth=Bandwidth(1e15, "declared", "fast"),
                   memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11, memory_bytes_per_s=1e10,
                   compute_dtype="float32")
    host, accelerator = plan(**options), plan(**options, device="cuda")
    slowed_rate = 1e10 / HOST_FRESH_PAGE_SLOWDOWN
    weights = (LLAMA_70B.decoder_params + LLAMA_70B.vocab_size * LLAMA_70B.hidden_size) * 4
    kv_at = [4 * kv_bytes_for_sequence(LLAMA_70B, 4, 300 + step) for step in range(1, 8)]
    decode = sorted((weights + KV_COPIES_PER_DECODE * kv + host_streaming_bytes(LLAMA_70B, 4, decode=True))
                    / slowed_rate for kv in kv_at)
    assert host.time.seconds_per_pass == pytest.approx((decode[3] + decode[4]) / 2)  # median of 1 prefill + 7 decodes
    assert sorted(host.time.pass_seconds[1:]) == pytest.approx(decode)  # every pass, kept for benchmarks/plan_accuracy
    assert "pass_seconds" not in host.to_json()  # the JSON plan stays a summary
    copied = host_streaming_bytes(LLAMA_70B, 4, decode=True)
    assert accelerator.time.seconds_per_pass < host.time.seconds_per_pass - copied / 1e10
    resident = plan(**options | dict(streaming="never"))
    assert resident.mode == "resident"
    assert resident.time.seconds_per_pass < host.time.seconds_per_pass - copied / slowed_rate * 0.99


def test_resident_eta_counts_loading_once_and_compute_per_pass():
    candidate = plan(TINY, rows=[RowCost(100, 3)], compute_dtype="float32", compute_flops_per_s=1e9)
    assert candidate.time.io_seconds_per_pass == 0
    assert candidate.time.eta_seconds > candidate.time.load_seconds == TINY.checkpoint_bytes / 1e9
    assert plan(TINY, compute_dtype="float32", compute_flops_per_s=None).time.eta_seconds is None


def test_the_compute_bound_caveat_counts_prefill_and_decode_passes_apart():
    """A streamed generation job whose layers read in no time: every pass computes longer than it reads, one with
    the prompts' prefill and the rest decode steps, and the caveat says which, instead of calling all of them long
    prefills."""
    candidate = plan(rows=[RowCost(300, 6)] * 2, streaming="always", bandwidth=Bandwidth(1e15, "declared", "fast"),
                     memory_budget_bytes=400 * GiB, compute_flops_per_s=4e11, memory_bytes_per_s=1e10)
    assert candidate.batching.passes == 6
    caveat = next(c for c in candidate.caveats if "compute-bound" in c)
    assert caveat.startswith("6 of 6 passes are compute-bound (1 with prefills, 5 decode only)")
