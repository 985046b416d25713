"""The plan's first step: the streaming policy, the mode it picks, and the memory that mode fixes whatever the
batches (the weights it keeps, where a streamed run keeps its embedding and head, the runtime). No torch."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from batchrun.plan.batching import RowCost, without_prefix
from batchrun.plan.formatting import format_bytes
from batchrun.plan.inputs import Notes, PlanInputs
from batchrun.plan.memory import batch_bytes, batch_limits
from batchrun.plan.weights import (HELD, TokenMatrices, Weights, head_read_bytes, resident_weights, streamed_weights,
                                   token_matrix_placements)

STREAMING_ENV = "BATCHRUN_STREAMING"
# People type booleans too; an unknown word is refused (a typo must not silently change the policy).
STREAMING_WORDS = {
    "auto": "auto", "always": "always", "never": "never",
    "yes": "always", "on": "always", "true": "always", "1": "always",
    "no": "never", "off": "never", "false": "never", "0": "never",
}


def parse_streaming(value: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The streaming policy: the flag's word first, then $BATCHRUN_STREAMING, default "auto"."""
    source = "--streaming"
    if value is None:
        value, source = env.get(STREAMING_ENV) or "auto", STREAMING_ENV
    word = value.strip().lower()
    if word not in STREAMING_WORDS:
        raise ValueError(f"{source}: unknown streaming policy {value!r}; accepted: auto, always, never, "
                         "yes/no, on/off, true/false, 1/0")
    return STREAMING_WORDS[word]


@dataclass(frozen=True)
class Fixed:
    """The memory a run holds whatever its batches: the weights its mode keeps and the runtime."""
    mode: str  # "resident" | "streamed"
    reason: str
    weights: Weights
    bytes: int  # weights + runtime
    largest_row_bytes: int  # the sizing row that needs the most, alone
    placement: TokenMatrices = HELD  # where a streamed run keeps the embedding and head
    placement_reason: str = ""
    packs_weights: bool = False  # a streamed run's long prefills multiply a packed copy of the layer


def fixed_memory(job: PlanInputs, sizing_rows: Sequence[RowCost]) -> tuple[Fixed, Notes]:
    """The mode and the memory it fixes: the weights it keeps and the runtime, with at least the largest row beside
    them; and what stops that mode before any batch."""
    sizes, request, overhead = job.sizes, job.request, job.rates.runtime_overhead_bytes
    budget = request.memory_budget_bytes
    row_bytes = [batch_bytes(sizes, job.compute_bytes, job.device, sizing_rows, [i]) for i in range(len(sizing_rows))]
    largest_row = max(range(len(sizing_rows)), key=row_bytes.__getitem__)
    largest_row_bytes = row_bytes[largest_row]
    resident = resident_weights(sizes, request.compute_dtype)
    resident_need = resident.bytes + overhead + largest_row_bytes
    resident_sum = (f"{resident.what} + runtime {format_bytes(overhead)} + largest row "
                    f"{format_bytes(largest_row_bytes)} = {format_bytes(resident_need)}")
    mode, reason = choose_mode(job.policy, resident_need <= budget, resident_sum, budget)
    if mode == "streamed":
        placed, why = _placed_weights(job, sizing_rows, largest_row_bytes)
        fixed = Fixed(mode, reason, placed.weights, placed.weights.bytes + overhead, largest_row_bytes,
                      placed.matrices, why, placed.packs)
    else:
        fixed = Fixed(mode, reason, resident, resident.bytes + overhead, largest_row_bytes)
    return fixed, _fit_blockers(job, fixed, resident_need, resident_sum, sizing_rows[largest_row].tokens())


def choose_mode(policy: str, resident_fits: bool, resident_sum: str, budget: int) -> tuple[str, str]:
    """(mode, reason) for the policy: auto streams only when the resident footprint exceeds the budget."""
    if policy == "always":
        return "streamed", "streaming forced (policy always)"
    if policy == "never":
        return "resident", "streaming off (policy never)"
    if resident_fits:
        return "resident", f"auto: the model fits: {resident_sum}, within the {format_bytes(budget)} budget"
    return "streamed", f"auto: resident needs {resident_sum}, over the {format_bytes(budget)} budget"


@dataclass(frozen=True)
class _Placement:
    """One way a streamed run may hold its weights, as _placed_weights weighs it."""
    weights: Weights
    matrices: TokenMatrices
    packs: bool  # long prefills multiply a packed copy of the layer (one layer more)
    sequences: int  # what a pass carries beside it; 0: not even one fits
    read: int  # bytes a pass reads

    @property
    def read_per_sequence(self) -> float:
        return self.read / self.sequences if self.sequences else math.inf

    @property
    def word(self) -> str:
        return self.matrices.word + (" + packed layer" if self.packs else "")


def _placed_weights(job: PlanInputs, sizing_rows: Sequence[RowCost],
                    largest_row_bytes: int) -> tuple[_Placement, str]:
    """A streamed run's weights: where the embedding and head stay (weights.token_matrix_placements) and whether long
    prefills pack a copy of the layer (measure.packs_weights). Of the ways asked, the one whose passes read the
    fewest bytes per sequence they carry, the sequences a pass holds being what the budget leaves beside those
    weights (batch_limits, as passes.pack sizes them): a head held reads nothing a pass but takes its matrix from
    the sequences, streamed every pass reads it once more; a packed layer speeds long prefills where it costs no
    sequence. Equals go to the fewer reads, then to packing."""
    sizes, request = job.sizes, job.request
    overhead = job.rates.runtime_overhead_bytes
    sizing_budget = job.sizing_budget - job.prefix_bytes()
    own_rows = [without_prefix(row, job.shared) for row in sizing_rows]
    weighed: list[_Placement] = []
    for matrices in token_matrix_placements(sizes, request.token_matrices):
        for packs in ((True, False) if job.rates.packs_weights else (False,)):
            weights = streamed_weights(sizes, request.compute_dtype, request.prefetch, job.device,
                                       request.prefetch_depth, packs, matrices)
            fits = weights.bytes + overhead + largest_row_bytes <= request.memory_budget_bytes
            sequences = batch_limits(sizes, job.compute_bytes, job.device, own_rows,
                                     sizing_budget - weights.bytes - overhead, request.batch_size)[0] if fits else 0
            weighed.append(_Placement(weights, matrices, packs, sequences,
                                      sizes.decoder_bytes + head_read_bytes(sizes, matrices)))
    fitting = [w for w in weighed if w.sequences]
    # min keeps the first of equals; where nothing fits, the leanest (the blocker shows the smallest floor)
    chosen = min(fitting, key=lambda w: w.read_per_sequence) if fitting else weighed[-1]
    if len(weighed) == 1:
        return chosen, f"{chosen.word} (asked)"
    others = "; ".join(f"{w.word}: {w.sequences} a pass reading {format_bytes(w.read)}" for w in weighed
                       if w is not chosen)
    return chosen, (f"{chosen.word}: {chosen.sequences} sequence(s) a pass reading {format_bytes(chosen.read)} "
                    f"({others})")


def _fit_blockers(job: PlanInputs, fixed: Fixed, resident_need: int, resident_sum: str,
                  largest_row_tokens: int) -> Notes:
    """What stops the mode before any batch: a quantized checkpoint streamed, or memory short of one sequence."""
    budget, overhead = job.request.memory_budget_bytes, job.rates.runtime_overhead_bytes
    blockers = []
    if fixed.mode == "streamed" and job.sizes.quantization:
        blockers.append(f"the checkpoint is quantized ({job.sizes.quantization}): streaming reads unquantized "
                        "safetensors only (packed weights need their scales); run it resident (--streaming "
                        "never) if it fits, or use an unquantized checkpoint")
    if fixed.mode == "resident" and resident_need > budget:
        blockers.append(f"resident run does not fit: {resident_sum}, over the {format_bytes(budget)} budget; "
                        "allow streaming (auto or always)")
    elif fixed.bytes > budget:
        blockers.append(f"does not fit even one layer: {fixed.weights.what} + runtime {format_bytes(overhead)}"
                        f" = {format_bytes(fixed.bytes)}, over the {format_bytes(budget)} budget")
    elif fixed.bytes + fixed.largest_row_bytes > budget:
        blockers.append(f"does not fit even one sequence: the largest row ({largest_row_tokens:,} "
                        f"tokens) needs {format_bytes(fixed.largest_row_bytes)} of KV cache and activations "
                        f"beside {format_bytes(fixed.bytes)} of weights and runtime; budget {format_bytes(budget)}")
    return Notes(blockers=tuple(blockers))
