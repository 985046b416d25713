"""What every throughput runner shares: the job file it reads, the result file it writes, the bytes it read
from disk, and a clock on every forward call (one forward call = one walk through the decoder stack = one pass).

Runners run in their own process (under the benchmark's memory cap) and may run in another virtual environment
(AirLLM), so this module needs only the standard library and torch.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Job:
    """One sweep, as every runner sees it: raw prompts, and either single-token choices or a new-token limit."""

    kind: str  # "choice" | "generate"
    checkpoint: str
    prompts: list[str]
    choices: list[str] | None = None
    max_new_tokens: int = 0
    dtype: str = "float32"  # the compute dtype, batchrun's own for the checkpoint on this machine (--dtype auto)

    @classmethod
    def read(cls, path: str | Path) -> "Job":
        return cls(**json.loads(Path(path).read_text()))

    def write(self, path: str | Path) -> Path:
        Path(path).write_text(json.dumps(asdict(self), indent=1))
        return Path(path)


@dataclass
class RunnerResult:
    """What a runner reports. answer_seconds runs from the first prompt's start to the last answer; setup (imports,
    model construction) is outside it and in setup_seconds."""

    answers: list[dict]  # per prompt: {"answer": str, "output_tokens": int}
    forward_seconds: list[float]  # one entry per forward call (pass), in order
    answer_seconds: float
    setup_seconds: float
    disk_read_bytes: int  # /proc/self/io read_bytes over the answering phase: what really came from storage
    batch_size: int
    notes: list[str] = field(default_factory=list)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))


def disk_read_bytes() -> int:
    """Bytes this process has made the kernel fetch from storage (page-cache hits are not counted)."""
    match = re.search(r"^read_bytes: (\d+)$", Path("/proc/self/io").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


class ForwardClock:
    """Times every call of `module.forward` (pre/post hooks): with a module that walks every layer, every call
    is one pass."""

    def __init__(self, module):
        self.seconds: list[float] = []
        self._started: float | None = None
        self._hooks = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, module, args):
        self._started = time.perf_counter()

    def _after(self, module, args, output):
        if self._started is not None:
            self.seconds.append(time.perf_counter() - self._started)
            self._started = None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def choice_token_ids(tokenizer, choices: list[str]) -> list[int]:
    """The token of each choice; the benchmark picks single-token choices so one forward scores them all."""
    ids = []
    for choice in choices:
        tokens = tokenizer.encode(choice, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(f"choice {choice!r} is {len(tokens)} tokens {tokens}; the runners score single-token "
                             "choices only")
        ids.append(tokens[0])
    return ids


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids as batchrun's raw mode makes them (the tokenizer's own special tokens, no chat template)."""
    return [tokenizer(prompt, add_special_tokens=True)["input_ids"] for prompt in prompts]


def left_pad(seqs: list[list[int]], pad_id: int):
    """input_ids, attention_mask, position_ids [B, S], left-padded so every prompt ends at the last position."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def generated_tokens(row, eos_ids: set[int], limit: int) -> list[int]:
    """The new tokens of one generate() output row up to and including the first EOS (the rest is padding)."""
    tokens = []
    for token in row.tolist()[:limit]:
        tokens.append(token)
        if token in eos_ids:
            break
    return tokens


def chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]
