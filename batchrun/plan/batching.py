"""The cost of each row in tokens and passes, and THE rule that groups rows into batches.

The plan and the executor both call pack_batches, so the passes a plan promises are the passes a run makes.
No torch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Sequence

# Below this many shared tokens the saved compute does not pay for the extra micro-batch (executor and plan agree).
MIN_SHARED_PREFIX = 16


@dataclass(frozen=True)
class RowCost:
    """What one row costs the model. Generation rows: new_tokens > 0, no choices. Choice rows: new_tokens = 0 and
    the token length of each choice (each multi-token choice is scored as its own sequence prompt + choice)."""
    prompt_tokens: int
    new_tokens: int
    choice_tokens: tuple[int, ...] = ()
    resumed: bool = False  # a generation row with tokens from an earlier run (prompt_tokens counts them)
    # a choice row the run scores once its generation is done (a verdict after the rationale a row writes first):
    # packed apart, after the others, as the run makes its passes
    later: bool = False
    # rows that share a prompt head no other row has (a pair row's two orders: their question) share a batch, where
    # a pass computes that head once (runtime/group_prefix.py); None: a row of its own
    group: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be at least 1, got {self.prompt_tokens}")
        if self.new_tokens < 0:
            raise ValueError(f"new_tokens must not be negative, got {self.new_tokens}")
        if self.choice_tokens and self.new_tokens:
            raise ValueError("a choice row generates no tokens: new_tokens must be 0")
        if any(length < 1 for length in self.choice_tokens):
            raise ValueError(f"every choice needs at least one token, got {self.choice_tokens}")

    @property
    def is_choice(self) -> bool:
        return bool(self.choice_tokens)

    @property
    def holds_cache(self) -> bool:
        """Whether the row's sequences keep a KV cache across layers: a generation row keeps it for the passes that
        follow; a choice row is done in one pass, where each layer's keys and values are needed only in that layer."""
        return not self.is_choice

    def sequences(self) -> int:
        """Sequences the row occupies in a batch: single-token choices are all read off one next-token
        distribution; longer choices each need their own continuation."""
        if not self.is_choice or max(self.choice_tokens) == 1:
            return 1
        return len(self.choice_tokens)

    def sequence_length(self) -> int:
        """Tokens in each of the row's sequences when it is done (the KV cache it holds)."""
        return self.prompt_tokens + (max(self.choice_tokens) if self.is_choice else self.new_tokens)

    def tokens(self) -> int:
        """KV tokens the row holds: prompt + new tokens, or sequences x (prompt + longest choice)."""
        return self.sequences() * self.sequence_length()

    def prefill_length(self) -> int:
        """Tokens the first pass computes per sequence: the prompt (plus the choice being scored)."""
        return self.prompt_tokens + (max(self.choice_tokens) if self.is_choice else 0)

    def logit_positions(self) -> int:
        """Positions whose logits are kept: the last one for generation; every choice token + 1 for a choice."""
        return max(self.choice_tokens) + 1 if self.is_choice else 1

    def kept_logprobs(self, vocab_size: int, positions: int | None = None) -> int:
        """Log-probabilities each of the row's sequences keeps until its pass ends, at `positions` kept (the batch's
        most; the row's own by default): a choice sequence keeps only the tokens it reads (every single-token choice
        at one position, or its own choice's tokens), a generation row its next token's whole distribution."""
        if not self.is_choice:
            return vocab_size
        width = len(self.choice_tokens) if max(self.choice_tokens) == 1 else 1
        return (positions or self.logit_positions()) * width

    def passes(self) -> int:
        """Walks through the decoder stack: the prompt rides in the first; each further new token costs one."""
        return 1 if self.is_choice else max(self.new_tokens, 1)


def pack_batches(rows: Sequence[RowCost], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Row indices grouped into batches. Rows are sorted by kind (choice, then resumed generation rows, then the
    others) and prompt length, then batches are filled greedily while sequences <= max_sequences and padded tokens
    (sequences x longest sequence) <= max_tokens. A batch holds one kind only. A row that alone exceeds a limit gets
    a batch of its own. Resumed rows go first so they finish: sorted by length with the rest, rows an interrupted
    run had half-written went to the back each time (after 18 interruptions, 22 rows half-done and 2 done).

    A batch makes as many passes as its longest answer needs, so where generation rows ask for different numbers of
    new tokens, rows are also packed sorted by that number first (then by length) and that packing is kept when it
    makes fewer passes: 500 rows of 4 new tokens and 500 of 64, 100 a batch, make 640 passes sorted by length alone
    (every batch waits for a 64-token answer) and 340 grouped by answer length, the lower bound."""
    if max_sequences < 1 or max_tokens < 1:
        raise ValueError(f"batch limits must be positive, got {max_sequences} sequences / {max_tokens} tokens")
    grouped = _group_lengths(rows)
    by_length = pack_in_order(rows, sorted(range(len(rows)), key=lambda i: _kind_key(rows[i], grouped) + (i,)),
                              max_sequences, max_tokens)
    if len({row.passes() for row in rows if not row.is_choice}) < 2:
        return by_length
    by_passes = pack_in_order(rows, sorted(range(len(rows)),
                                           key=lambda i: _kind_key(rows[i], grouped, by_passes=True) + (i,)),
                              max_sequences, max_tokens)
    return by_passes if passes_for(rows, by_passes) < passes_for(rows, by_length) else by_length


def _group_lengths(rows: Sequence[RowCost]) -> dict[int, int]:
    """Each group's longest prompt: its rows sort as one, next to each other."""
    lengths: dict[int, int] = {}
    for row in rows:
        if row.group is not None:
            lengths[row.group] = max(lengths.get(row.group, 0), row.prompt_tokens)
    return lengths


def _kind_key(row: RowCost, grouped: dict[int, int], by_passes: bool = False) -> tuple:
    length = (grouped[row.group], row.group) if row.group is not None else (row.prompt_tokens, -1)
    return (row.later, not row.is_choice, not row.resumed) + ((row.passes(),) if by_passes else ()) + length


def pack_in_order(rows: Sequence[RowCost], order: Sequence[int], max_sequences: int,
                  max_tokens: int) -> list[list[int]]:
    """Batches filled greedily with the rows in `order` (pack_batches' rule, for one ordering); a group's rows
    (adjacent in `order`) go into a batch together where they fit in one."""
    batches: list[list[int]] = []
    current: list[int] = []
    sequences = longest = 0
    for unit in _units(rows, order):
        grown_sequences = sequences + sum(rows[i].sequences() for i in unit)
        grown_longest = max(longest, *(rows[i].sequence_length() for i in unit))
        first, row = (rows[current[0]] if current else None), rows[unit[0]]
        fits = (first and (first.is_choice, first.later) == (row.is_choice, row.later)
                and grown_sequences <= max_sequences and grown_sequences * grown_longest <= max_tokens)
        if current and not fits:
            batches.append(current)
            current = []
            grown_sequences = sum(rows[i].sequences() for i in unit)
            grown_longest = max(rows[i].sequence_length() for i in unit)
        current.extend(unit)
        sequences, longest = grown_sequences, grown_longest
    if current:
        batches.append(current)
    return [part for batch in batches for part in _split_over_limits(rows, batch, max_sequences, max_tokens)]


def _units(rows: Sequence[RowCost], order: Sequence[int]) -> list[list[int]]:
    """`order` as the units a batch takes whole: a group's adjacent rows, else one row."""
    units: list[list[int]] = []
    for index in order:
        group = rows[index].group
        if units and group is not None and rows[units[-1][0]].group == group:
            units[-1].append(index)
        else:
            units.append([index])
    return units


def _split_over_limits(rows: Sequence[RowCost], batch: list[int], max_sequences: int,
                       max_tokens: int) -> list[list[int]]:
    """A batch that one group alone made exceed a limit, cut row by row as rows of their own would be."""
    count = sum(rows[i].sequences() for i in batch)
    if len(batch) < 2 or (count <= max_sequences and count * max(rows[i].sequence_length() for i in batch)
                          <= max_tokens):
        return [batch]
    alone = [replace(rows[i], group=None) for i in batch]
    return [[batch[j] for j in part] for part in pack_in_order(alone, range(len(batch)), max_sequences, max_tokens)]


# A micro-batch computes every padding position like a real token; each further micro-batch costs one more turn at
# every layer (a hand-off and a heap trim) and a smaller matmul. Charged as this many padded tokens per layer, about
# what a turn costs on a CPU (docs/performance.md#micro-batches).
MICRO_BATCH_COST_TOKENS = 32
# A group's own prompt head (a pair row's question: runtime/group_prefix.py) must save more than the two extra calls
# a layer it costs (its prefix's and its micro-batch's).
GROUP_PREFIX_MIN = 2 * MICRO_BATCH_COST_TOKENS


def micro_batches(lengths: Sequence[int], size: int | None) -> list[list[int]]:
    """Sequence indices grouped into the micro-batches of one pass, each left-padded to its longest member.

    No group holds more than `size` sequences, so none outgrows the activations the plan sized one micro-batch for
    (`size` sequences at the longest length). Within that, sequences are sorted by length and cut into
    contiguous runs where the padding plus MICRO_BATCH_COST_TOKENS per group is least (exact, by dynamic
    programming). `size` None or 0: one group, the plain forward call.
    """
    count = len(lengths)
    if count == 0:
        return []
    if not size or count == 1:
        return [list(range(count))]
    size = min(size, count)
    order = sorted(range(count), key=lambda i: (lengths[i], i))
    ordered = [lengths[i] for i in order]
    cut = _least_padding_cuts(ordered, size)
    groups: list[list[int]] = []
    end = count
    while end:
        groups.append(sorted(order[cut[end]:end]))
        end = cut[end]
    return groups[::-1]


def _least_padding_cuts(ordered: Sequence[int], size: int) -> dict[int, int]:
    """cut[end]: where the last group of the best grouping of the `end` shortest sequences starts (`ordered` sorted).

    best[j], the least cost of grouping the j shortest, never falls as j grows (drop the longest sequence from its
    group: no padding is added). So for a group ending at `end`, of the starts whose sequences are all as long as its
    longest the earliest is best, and once the padding plus the least grouping before any allowed start costs more
    than the best found, no earlier start can win. Without a size cap no cut falls inside a run of equal lengths
    (moving the run's upper part down adds no padding), so only run boundaries are tried: trying every start is
    quadratic in a pass's sequences (docs/performance.md#micro-batches)."""
    count = len(ordered)
    tokens_before = [0]
    for length in ordered:
        tokens_before.append(tokens_before[-1] + length)
    run_start = [0] * count  # first index of the run of equal lengths holding each index
    for index in range(1, count):
        run_start[index] = run_start[index - 1] if ordered[index] == ordered[index - 1] else index
    unconstrained = size >= count
    ends = [end for end in range(1, count + 1) if not unconstrained or end == count or ordered[end] != ordered[end - 1]]
    best = {0: 0.0}
    cut: dict[int, int] = {}
    for end in ends:
        longest = ordered[end - 1]
        best_here = math.inf
        earliest = max(0, end - size)
        floor = best.get(earliest, 0.0)  # no start the cap allows has a cheaper grouping before it
        start = max(run_start[end - 1], earliest)  # the earliest start adding no padding
        while start >= earliest:
            padding = (end - start) * longest - (tokens_before[end] - tokens_before[start])
            if floor + padding + MICRO_BATCH_COST_TOKENS >= best_here:
                break
            if start in best:
                cost = best[start] + padding + MICRO_BATCH_COST_TOKENS
                if cost < best_here:
                    best_here, cut[end] = cost, start
            start = run_start[start - 1] if unconstrained and start else start - 1
        best[end] = best_here
    return cut


def prefill_groups(lengths: Sequence[int], size: int | None, device) -> list[list[int]]:
    """The forward calls of a prefill: micro_batches within the planned `size`. With none planned (every sequence's
    activations fit at once), a CPU still cuts by length, where a padded position costs what a token does
    (docs/streaming.md#micro-batches); an accelerator makes one call, where a call costs more than padding does.
    `device`: "cpu", "cuda:0", a torch.device."""
    if size is None and str(device).split(":")[0] == "cpu":
        size = len(lengths)
    return micro_batches(lengths, size)


def prefill_call_count(rows: Sequence[RowCost], batch: Sequence[int], size: int | None, device) -> int:
    """Forward calls of a batch's prefill, cut as the executor cuts them (prefill_groups)."""
    return len(prefill_calls(rows, batch, size, device))


def prefill_calls(rows: Sequence[RowCost], batch: Sequence[int], size: int | None,
                  device) -> tuple[tuple[int, ...], ...]:
    """The prefill lengths of each forward call of a batch's prefill, cut as the executor cuts them."""
    if len(batch) == 1 and rows[batch[0]].sequences() == 1:  # the plan sizes every row alone: skip the cache
        return ((rows[batch[0]].prefill_length(),),)
    lengths = tuple(rows[i].prefill_length() for i in batch for _ in range(rows[i].sequences()))
    return _calls(lengths, size, str(device).split(":")[0])


@functools.lru_cache(maxsize=64)  # the plan asks for a batch's memory, its largest turn and its time
def _calls(lengths: tuple[int, ...], size: int | None, device_kind: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(lengths[i] for i in group) for group in prefill_groups(lengths, size, device_kind))


def batch_shape(rows: Sequence[RowCost], batch: Sequence[int]) -> tuple[int, int, int, int]:
    """(sequences, longest sequence, longest prefill, most logit positions) of a batch, padding included."""
    members = [rows[i] for i in batch]
    return (sum(r.sequences() for r in members), max(r.sequence_length() for r in members),
            max(r.prefill_length() for r in members), max(r.logit_positions() for r in members))


def kept_logprobs(rows: Sequence[RowCost], batch: Sequence[int], vocab_size: int) -> int:
    """The most log-probabilities one sequence of the batch keeps until the pass ends (RowCost.kept_logprobs at the
    batch's kept positions, which its longest choice sets for every row)."""
    positions = max(rows[i].logit_positions() for i in batch)
    return max(rows[i].kept_logprobs(vocab_size, positions) for i in batch)


def passes_for(rows: Sequence[RowCost], batches: Sequence[Sequence[int]]) -> int:
    """Passes a job makes: each batch walks the stack once per token its longest generation needs (choice: once)."""
    return sum(max(rows[i].passes() for i in batch) for batch in batches)


def lower_bound_passes(rows: Sequence[RowCost], batch_sequences: int) -> int:
    """max(max T_i, ceil(sum T_i / B)) with T_i the passes of row i (1 for a choice row): no packing can do better."""
    if not rows:
        return 0
    needs = [row.passes() for row in rows]
    return max(max(needs), math.ceil(sum(needs) / batch_sequences))


def shared_prefix_tokens(prompts: Sequence[Sequence[int]], sharing_allowed: bool = True, own_tokens: int = 1,
                         shortest_sequence: int | None = None) -> int:
    """Tokens every prompt starts with, which a pass computes once for all its sequences (0 below
    MIN_SHARED_PREFIX, for a single prompt, or when the model's caches cannot share: sliding windows). The last
    `own_tokens` of each sequence stay its own: the positions whose logits the pass keeps. `shortest_sequence`:
    the shortest sequence's length where the pass appends tokens to the prompts (multi-token choices)."""
    if not sharing_allowed or len(prompts) < 2:
        return 0
    first, shortest = prompts[0], min(len(p) for p in prompts)
    common = 0
    while common < shortest and all(p[common] == first[common] for p in prompts):
        common += 1
    shared = min(common, (shortest if shortest_sequence is None else shortest_sequence) - own_tokens)
    return shared if shared >= MIN_SHARED_PREFIX else 0


def with_group_heads(rows: Sequence[RowCost], prompts: Sequence[Sequence[int]], everyone: int,
                     own_tokens: int) -> list[RowCost]:
    """`rows` as a pass computes them where a group shares a head of its own (a pair row's two orders: their
    question): the group's first row computes the head, the others only what follows it. A head counts where it is
    at least GROUP_PREFIX_MIN tokens longer than `everyone` (the prefix all rows share), as the run decides."""
    members: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        if row.group is not None:
            members.setdefault(row.group, []).append(index)
    costs = list(rows)
    for group in members.values():
        head = shared_prefix_tokens([prompts[i] for i in group], own_tokens=own_tokens) if len(group) > 1 else 0
        if head - everyone < GROUP_PREFIX_MIN:
            continue
        for index in group[1:]:
            costs[index] = replace(rows[index], prompt_tokens=rows[index].prompt_tokens - head)
    return costs


def windows_allow_sharing(sliding_windows: Sequence[int | None], unplaced_window: int | None,
                          rows: Sequence[RowCost]) -> bool:
    """Sliding-window layers count the padding between a shared prefix and a row's own tokens, so a model with them
    shares a prefix only where no row can reach past the smallest window: the longest prompt plus the most tokens
    any row adds (prefill.SharedPrefix.usable checks each pass, which never spans more). `unplaced_window`: the
    window of a config that does not say which layers slide; inside it no layer's window cuts anything either."""
    if not rows:
        return True
    longest = (max(row.prompt_tokens for row in rows)
               + max(row.sequence_length() - row.prompt_tokens for row in rows))
    return inside_windows(sliding_windows, unplaced_window, longest)


def inside_windows(sliding_windows: Sequence[int | None], unplaced_window: int | None, columns: int) -> bool:
    """Whether `columns` cache positions fit inside the smallest sliding window (or the model has none): no window
    cuts anything there, so windowed layers attend exactly as full ones."""
    windows = [window for window in [*sliding_windows, unplaced_window] if window]
    return not windows or columns <= min(windows)


def without_prefix(row: RowCost, shared: int) -> RowCost:
    """The part of a row its own sequences compute and keep when `shared` prompt tokens are computed once."""
    return replace(row, prompt_tokens=row.prompt_tokens - shared) if shared else row
