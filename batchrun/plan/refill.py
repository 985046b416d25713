"""Which generation rows ride in which pass: a pass's free places are refilled from the queue as rows finish.

A batch that waits for its last row to finish leaves the places of its early finishers empty for the rest of its
passes. Here generation rows wait in one queue (in the order pack_batches sorts them) and every pass admits the next
rows while the live ones and the admitted ones stay within the batch limits the plan sized (sequences, and sequences x
longest sequence in tokens): the admitted rows' prompts are prefilled in the same pass that decodes the others' next
token, so a finished row's place goes to the waiting rows at once (in queue order: the next row waits until it fits).
With every row running to its new-token count this makes the passes of the batches one after another; where rows
differ in length or stop early it approaches the lower bound, max(longest answer, sum of answers / batch size). The
plan simulates the schedule with every row running to its count; the executor admits the same way as rows really
finish. No torch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from batchrun.plan.batching import RowCost


@dataclass(frozen=True)
class ScheduledPass:
    admitted: tuple[int, ...]  # rows whose prompts this pass prefills (their first token comes out of it)
    decoding: tuple[int, ...]  # rows admitted before, each generating one more token


def admit(rows: Sequence[RowCost], live: Sequence[int], queue: deque, max_sequences: int,
          max_tokens: int) -> list[int]:
    """Take rows from the head of `queue` while they fit beside `live` within pack_batches' limits (sequences, and
    sequences x the longest sequence's tokens: a decode micro-batch pads its members to the longest); a row too
    large for the limits alone still runs, alone, when nothing else is live. Queue order is kept: a row that does
    not fit holds back those behind it, so rows finish in about the order the plan packed them."""
    sequences = sum(rows[i].sequences() for i in live)
    longest = max((rows[i].sequence_length() for i in live), default=0)
    admitted: list[int] = []
    while queue:
        row = rows[queue[0]]
        grown_sequences, grown_longest = sequences + row.sequences(), max(longest, row.sequence_length())
        if (live or admitted) and (grown_sequences > max_sequences or grown_sequences * grown_longest > max_tokens):
            break
        admitted.append(queue.popleft())
        sequences, longest = grown_sequences, grown_longest
    return admitted


def shares_prefix(rows: int, max_sequences: int) -> bool:
    """Whether generation rows share their prompt prefix (computed by the first pass, kept for the later rows):
    where more than one row runs and a pass may hold more than one."""
    return rows > 1 and max_sequences > 1


def refill_schedule(rows: Sequence[RowCost], order: Sequence[int], max_sequences: int,
                    max_tokens: int, *, refill_while_live: bool = True) -> list[ScheduledPass]:
    """The passes of generation rows `order` when each runs to its new-token count (RowCost.passes).
    `refill_while_live` False: rows are admitted only once every live row has finished, batch after batch, where
    rows admitted in different passes could not decode in one call (score.GreedyPool.refills)."""
    queue = deque(order)
    left: dict[int, int] = {}  # live row -> passes it still needs
    schedule = []
    while queue or left:
        admitted = admit(rows, list(left), queue, max_sequences, max_tokens) if refill_while_live or not left else []
        schedule.append(ScheduledPass(tuple(admitted), tuple(left)))
        left.update((i, rows[i].passes()) for i in admitted)
        left = {i: n - 1 for i, n in left.items() if n > 1}
    return schedule
