"""What each committed pass of a run leaves behind: its record in the store (seconds, rows, peak memory, the plan's
estimate of it), the bar and `status`, and its word on the measured rates that priced it (measure.judge_*), the GGUF
dequantization rates among them."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tqdm import tqdm

from batchrun.host import faults, peak_resident_bytes
from batchrun.job.progress import RunProgress
from batchrun.measure import (compute_threads, judge_compute_rate, judge_dequantize_rates, judge_generation_rates,
                              judge_runtime_overhead)
from batchrun.plan import Candidate
from batchrun.runtime import dequantized, dequantized_since
from batchrun.store import RowResult, Store


def to_row_result(answer, row_id) -> RowResult:
    """A computed answer (runtime.Answer) as the store keeps it: the same fields, with the row's id."""
    return RowResult(id=row_id, error=None, **vars(answer))


def error_result(idx: int, row_id, message: str, prompt_tokens: int | None = None) -> RowResult:
    return RowResult(idx=idx, id=row_id, answer=None, choice_probs=None, score=None, logprob=None,
                     prompt_tokens=prompt_tokens, output_tokens=None, finish_reason="error", error=message)


@dataclass
class PassCommits:
    """Where a run's passes go: the job's rows in the store, the progress bar, each pass's seconds (also recorded
    in the store with the plan's estimate of the pass and the peak memory so far, for the job's report)."""
    store: Store
    job_id: str
    bar: tqdm
    pass_seconds: list[float]
    plan: Candidate
    progress: RunProgress = field(init=False)
    _choice_pass: bool = False
    _rate_judged: bool = False
    _generation_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [measured, planned] so far
    _generation_judged: bool = False
    _peak_before_first_pass: int | None = None
    _dequantized_before: dict = field(default_factory=dequantized)  # this process's GGUF decodes before the run
    _dequantize_judged: set = field(default_factory=set)  # the ggml types whose rates the run has judged
    _threads: int = field(default_factory=compute_threads)  # what the plan's rates were measured with

    def __post_init__(self) -> None:
        self.store.record_run_estimate(self.job_id, mode=self.plan.mode, planned_seconds=self.plan.time.eta_seconds)
        self.progress = RunProgress(self.store, self.job_id, self.bar, self.plan, self.pass_seconds)

    def pass_started(self, rows: Callable[[], int], *, answers: bool) -> float:
        """A pass carrying `rows()` rows starts (`answers`: it answers them all); returns when (time.monotonic)."""
        self.progress.begin(rows, answers=answers)
        self._choice_pass = answers
        if not self.pass_seconds:
            self._peak_before_first_pass = self._peak_memory_bytes()
        return time.monotonic()

    def pass_committed(self, rows: int, started: float) -> None:
        """A pass that began at `started` (time.monotonic) is committed with `rows` answers."""
        faults.reached("committed")
        seconds = time.monotonic() - started
        self.pass_seconds.append(seconds)
        planned = self.plan.time.pass_seconds
        number = len(self.pass_seconds)
        planned_seconds = planned[number - 1] if number <= len(planned) else None
        peak = self._peak_memory_bytes()
        self.store.record_pass(self.job_id, seconds=seconds, rows_finished=rows,
                               peak_memory_bytes=peak, planned_seconds=planned_seconds)
        self.progress.committed(rows)
        self._judge_compute_rate(seconds, planned_seconds)
        self._judge_generation_rates(seconds, planned_seconds)
        self._judge_runtime_overhead(number, peak)
        self._judge_dequantize_rates()

    def _judge_dequantize_rates(self) -> None:
        """The GGUF blocks the run has decoded into the compute dtype so far tell the cached rate of each type whether
        it holds, once they are enough to judge by (measure.judge_dequantize_rates). Only host decodes are timed."""
        if not self.plan.device.startswith("cpu"):
            return
        observed = dequantized_since(self._dequantized_before, self.plan.compute_dtype)
        waiting = {ggml_type: seen for ggml_type, seen in observed.items() if ggml_type not in self._dequantize_judged}
        if waiting:
            self._dequantize_judged |= judge_dequantize_rates(waiting, self.plan.compute_dtype, self.plan.device,
                                                              self._threads, job=self.job_id)

    def _judge_runtime_overhead(self, number: int, peak: int | None) -> None:
        """The host's first pass tells the cached runtime figure whether the plan held (measure.judge_runtime_overhead)
        where the pass set the process's peak: a process that peaked higher before (a notebook's earlier work) says
        nothing of this run."""
        if number != 1 or not peak or self.plan.device.startswith("cuda"):
            return
        if peak > (self._peak_before_first_pass or 0):
            judge_runtime_overhead(peak, self.plan.memory.peak_memory_bytes, job=self.job_id)

    def _judge_compute_rate(self, seconds: float, planned: float | None) -> None:
        """A resident choice pass is all prefill compute, priced at the cached compute rate: the run's first long one
        tells the rate whether it holds (measure.judge_compute_rate)."""
        if self._rate_judged or not self._choice_pass or self.plan.mode != "resident" or not planned:
            return
        self._rate_judged = judge_compute_rate(self.plan.compute_dtype, self.plan.device, seconds, planned,
                                               job=self.job_id)

    def _judge_generation_rates(self, seconds: float, planned: float | None) -> None:
        """Generation passes priced by their compute (every resident one; a streamed one that computes longer than
        it reads) add up until they tell the rates that priced them whether those hold
        (measure.judge_generation_rates): a decode pass of a small model is too short to judge alone."""
        io_seconds = self.plan.time.io_seconds_per_pass
        if self._generation_judged or self._choice_pass or not planned or (io_seconds and planned <= io_seconds):
            return
        self._generation_seconds[0] += seconds
        self._generation_seconds[1] += planned
        self._generation_judged = judge_generation_rates(self.plan.compute_dtype, self.plan.device,
                                                         *self._generation_seconds, job=self.job_id)

    def _peak_memory_bytes(self) -> int | None:
        """What the plan's peak memory is measured against: the device's peak reserved memory on CUDA, else this
        process's peak resident memory."""
        if self.plan.device.startswith("cuda"):
            import torch

            return int(torch.cuda.max_memory_reserved(self.plan.device))
        return peak_resident_bytes()
