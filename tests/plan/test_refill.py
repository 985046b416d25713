"""The refill schedule: which rows a pass prefills and which it decodes."""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from batchrun.plan import RowCost
from batchrun.plan.batching import lower_bound_passes, pack_batches, passes_for
from batchrun.plan.refill import ScheduledPass, refill_schedule


def fits(rows, members, max_sequences: int, max_tokens: int) -> bool:
    """pack_batches' limits for rows live at once: sequences, and sequences x the longest sequence's tokens."""
    members = list(members)
    sequences = sum(rows[i].sequences() for i in members)
    longest = max((rows[i].sequence_length() for i in members), default=0)
    return sequences <= max_sequences and sequences * longest <= max_tokens


def test_rows_of_equal_answers_make_the_passes_of_their_batches():
    rows = [RowCost(100, 3)] * 5
    schedule = refill_schedule(rows, range(5), max_sequences=2, max_tokens=10**6)
    assert len(schedule) == passes_for(rows, pack_batches(rows, 2, 10**6)) == 9
    assert schedule[:4] == [ScheduledPass((0, 1), ()), ScheduledPass((), (0, 1)), ScheduledPass((), (0, 1)),
                            ScheduledPass((2, 3), ())]


def test_a_finished_row_s_place_is_taken_in_the_next_pass():
    rows = [RowCost(100, 1), RowCost(100, 4), RowCost(100, 2), RowCost(100, 2)]
    schedule = refill_schedule(rows, range(4), max_sequences=2, max_tokens=10**6)
    assert schedule == [ScheduledPass((0, 1), ()),  # row 0's one token comes out of its prefill
                        ScheduledPass((2,), (1,)),  # row 2 takes row 0's place
                        ScheduledPass((), (1, 2)),
                        ScheduledPass((3,), (1,)),  # row 1's 4th token and row 3's prefill
                        ScheduledPass((), (3,))]
    assert len(schedule) == lower_bound_passes(rows, 2) == 5
    assert passes_for(rows, pack_batches(rows, 2, 10**6)) == 6  # batches: (1, 2) then (2, 4) new tokens


def test_without_refilling_while_rows_live_the_rows_run_batch_after_batch():
    """Where rows admitted in different passes could not decode in one call, a pass admits only into an empty pool:
    the same rows take the passes of their batches."""
    rows = [RowCost(100, 1), RowCost(100, 4), RowCost(100, 2), RowCost(100, 2)]
    schedule = refill_schedule(rows, range(4), max_sequences=2, max_tokens=10**6, refill_while_live=False)
    assert schedule == [ScheduledPass((0, 1), ()), ScheduledPass((), (1,)), ScheduledPass((), (1,)),
                        ScheduledPass((), (1,)), ScheduledPass((2, 3), ()), ScheduledPass((), (2, 3))]
    assert len(schedule) == passes_for(rows, pack_batches(rows, 2, 10**6)) == 6


def test_the_token_budget_holds_back_a_long_row_until_it_fits():
    rows = [RowCost(90, 2), RowCost(90, 6), RowCost(290, 2)]
    schedule = refill_schedule(rows, range(3), max_sequences=4, max_tokens=400)
    assert schedule[0].admitted == (0, 1)  # 3 x 300 tokens would be over 400
    assert not fits(rows, [1, 2], 4, 400)
    assert [p.admitted for p in schedule] == [(0, 1), (), (), (), (), (), (2,), ()]


def test_a_row_over_the_limits_runs_alone():
    rows = [RowCost(50, 2), RowCost(5000, 2), RowCost(50, 2)]
    schedule = refill_schedule(rows, range(3), max_sequences=4, max_tokens=1000)
    assert [p.admitted for p in schedule] == [(0,), (), (1,), (), (2,), ()]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 12)), min_size=1, max_size=40),
       st.integers(1, 12), st.integers(1, 4000))
def test_every_row_gets_all_its_passes_within_the_limits_and_no_more_passes_than_batches(specs, max_sequences,
                                                                                         max_tokens):
    rows = [RowCost(p, n) for p, n in specs]
    batches = pack_batches(rows, max_sequences, max_tokens)
    order = [i for batch in batches for i in batch]
    schedule = refill_schedule(rows, order, max_sequences, max_tokens)
    admitted = [i for p in schedule for i in p.admitted]
    assert sorted(admitted) == list(range(len(rows)))
    for i in range(len(rows)):
        start = next(k for k, p in enumerate(schedule) if i in p.admitted)
        decoding = [k for k, p in enumerate(schedule) if i in p.decoding]
        assert decoding == list(range(start + 1, start + rows[i].passes()))
    for p in schedule:
        members = p.admitted + p.decoding
        assert len(members) == 1 or fits(rows, members, max_sequences, max_tokens)
    assert lower_bound_passes(rows, max_sequences) <= len(schedule) <= passes_for(rows, batches)
    assert len(schedule) >= math.ceil(sum(r.passes() for r in rows) / max_sequences)
