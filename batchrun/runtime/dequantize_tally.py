"""What this process has spent dequantizing GGUF blocks on the CPU, by ggml type and destination dtype: the rates a
run achieves, which the job hands to measure.judge_dequantize_rates so that the next plan prices dequantization as
this machine did it in a run (a streamed layer's decode shares the cores with the passes' compute). An accelerator's
decode runs asynchronously, so only host decodes are timed.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

_lock = threading.Lock()  # the reader thread decodes while the main thread reads the tally
_tally: dict[tuple[str, str], tuple[int, float]] = {}  # (ggml type, dtype name) -> (weights, seconds)


@contextmanager
def timed_decode(ggml_type: str, out: torch.Tensor) -> Iterator[None]:
    """Count the decode of `out`'s weights from `ggml_type` blocks done inside the block."""
    if out.device.type != "cpu":
        yield
        return
    started = time.perf_counter()
    yield
    seconds = time.perf_counter() - started
    key = (ggml_type, str(out.dtype).removeprefix("torch."))
    with _lock:
        weights, spent = _tally.get(key, (0, 0.0))
        _tally[key] = (weights + out.numel(), spent + seconds)


def dequantized() -> dict[tuple[str, str], tuple[int, float]]:
    """(ggml type, dtype) -> (weights decoded, seconds spent) by this process so far."""
    with _lock:
        return dict(_tally)


def dequantized_since(before: dict[tuple[str, str], tuple[int, float]], dtype: str) -> dict[str, tuple[int, float]]:
    """ggml type -> (weights, seconds) decoded into `dtype` since `before` (a dequantized() taken earlier)."""
    since = {}
    for (ggml_type, into), (weights, seconds) in dequantized().items():
        earlier = before.get((ggml_type, into), (0, 0.0))
        if into == dtype and weights > earlier[0]:
            since[ggml_type] = (weights - earlier[0], seconds - earlier[1])
    return since
