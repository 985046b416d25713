"""The pass bound: batches cut small enough that no pass is planned longer than the request's bound (a crash loses
the pass in flight), and what holding passes to it could not do or costs. No torch."""
from __future__ import annotations

from dataclasses import dataclass, replace

from batchrun.plan.batching import pack_batches
from batchrun.plan.formatting import format_duration
from batchrun.plan.inputs import Notes, PlanInputs
from batchrun.plan.mode import Fixed
from batchrun.plan.passes import Packing, decode_calls, read_times, schedule_passes, time_passes
from batchrun.plan.timing import Timeline

# Passes over the bound are cut by the share the bound is of the longest, a little more (a pass's fixed costs do not
# shrink with its rows), and timed again, at most this many times (a pass's time is about linear in its tokens: two
# rounds usually).
BOUND_MARGIN = 0.95
BOUND_ROUNDS = 12
# Past this share of the job's time the bound's extra passes are called out: a larger bound would cost less.
BOUND_COST_NOTED = 0.10


@dataclass(frozen=True)
class Bounding:
    """The pass bound: what was asked, what passes are held to, and the passes and their time without it."""
    seconds: float
    target: float  # the bound, or what a pass cannot be shorter than where that is longer
    held_by: str | None  # why the target is longer: "read" (a streamed pass reads every layer), "row" (one row a pass)
    unbounded_passes: int
    unbounded_seconds: float


@dataclass(frozen=True)
class Bounded:
    """What bound_passes gives: the batches, the bound as applied (None: no bound), those batches' timeline where
    the bound timed them, and what the step says of the job."""
    packing: Packing
    bound: Bounding | None = None
    timeline: Timeline | None = None
    notes: Notes = Notes()


def bound_passes(job: PlanInputs, fixed: Fixed, packing: Packing) -> Bounded:
    """Batches small enough that no pass is planned longer than the request's bound, with the bound and the
    timeline of those batches. A pass cannot be shorter than a streamed pass's read of every layer, nor than one row
    a pass takes: where the bound is shorter, passes are held to that instead (any smaller would cost more passes
    and save nothing)."""
    bound = job.request.pass_seconds
    if bound is None or not packing.batches:
        return Bounded(packing)
    io_seconds = read_times(job, fixed.mode, fixed.placement)[1]
    unbounded = _trial_timeline(job, fixed.mode, packing, io_seconds)
    if not unbounded.known:
        return Bounded(packing, None, unbounded,
                       Notes(caveats=("pass times unknown: passes are not held to the pass bound",)))
    read = io_seconds or 0.0
    found = Bounding(bound, max(bound, read), "read" if read > bound else None, len(unbounded.pass_seconds),
                     sum(unbounded.pass_seconds))
    bounded, timeline = _shrunk_to(job, fixed.mode, (packing, unbounded), found.target, io_seconds)
    longest = max(timeline.pass_seconds)
    if longest > found.target and bounded.max_sequences == 1:
        found = replace(found, target=longest, held_by="row")
        bounded, timeline = _shrunk_to(job, fixed.mode, (packing, unbounded), longest, io_seconds)
    return Bounded(bounded, found, timeline)


def bound_notes(mode: str, bound: Bounding | None, timeline: Timeline) -> Notes:
    """What the bound could not do, and what it costs where that is much."""
    if bound is None or not timeline.known:
        return Notes()
    passes = timeline.pass_seconds
    caveats = []
    held = {"read": f"a streamed pass reads every layer ({format_duration(bound.target)})",
            "row": f"one row a pass takes up to {format_duration(bound.target)}"}.get(bound.held_by)
    if held:
        caveats.append(f"{held}, longer than the {format_duration(bound.seconds)} pass bound: passes are held "
                       "to that instead")
    over = [seconds for seconds in passes if seconds > bound.target]
    if over:
        caveats.append(f"{len(over)} pass(es) are planned longer than the {format_duration(bound.target)} bound "
                       f"(the longest {format_duration(max(over))})")
    extra = sum(passes) - bound.unbounded_seconds
    if bound.unbounded_seconds and extra > BOUND_COST_NOTED * bound.unbounded_seconds:
        reads = " reading every layer again" if mode == "streamed" else ""
        caveats.append(f"the pass bound adds {extra / bound.unbounded_seconds:.0%} to the job's time (passes "
                       f"{bound.unbounded_passes:,} -> {len(passes):,}{reads}): a larger --pass-minutes costs "
                       "less, and a crash loses more")
    return Notes(caveats=tuple(caveats))


def _shrunk_to(job: PlanInputs, mode: str, start: tuple[Packing, Timeline], target: float,
               io_seconds: float | None) -> tuple[Packing, Timeline]:
    """From `start` (batches and their timeline), limits cut round by round by the share `target` is of the longest
    pass (a little more: a pass's fixed costs do not shrink with its rows) until no pass is longer, or one row a
    pass."""
    packing, timeline = start
    for _ in range(BOUND_ROUNDS):
        longest = max(timeline.pass_seconds)
        if longest <= target or packing.max_sequences == 1:
            break
        packing = _shrunk(job, packing, target / longest * BOUND_MARGIN)
        timeline = _trial_timeline(job, mode, packing, io_seconds)
    return packing, timeline


def _shrunk(job: PlanInputs, packing: Packing, scale: float) -> Packing:
    """The batches repacked under limits `scale` times the current ones (at least one sequence fewer)."""
    max_sequences = max(1, min(packing.max_sequences - 1, int(packing.max_sequences * scale)))
    max_tokens = max(1, int(packing.max_tokens * scale))
    micro = packing.micro_sequences
    own_rows, planned = job.own_rows, packing.planned
    packed = pack_batches([own_rows[i] for i in planned], max_sequences, max_tokens)
    return replace(packing, max_sequences=max_sequences, max_tokens=max_tokens,
                   micro_sequences=micro if micro is not None and micro < max_sequences else None,
                   batches=[[planned[i] for i in batch] for batch in packed])


def _trial_timeline(job: PlanInputs, mode: str, packing: Packing, io_seconds: float | None) -> Timeline:
    """The job's passes timed as the planner's time step times them, for batches the plan weighs."""
    return time_passes(job, mode, schedule_passes(job, packing), decode_calls(job, packing), io_seconds)
