"""The token matrices, embedding and LM head, read from the checkpoint as a pass needs them instead of held.

A pass embeds only the tokens it carries: their rows are gathered from the shard by token id (one positional read
per run of consecutive ids), and the small table they make stands in for the embedding while the embedding runs.
The head multiplies every row of its matrix once a pass: its rows are read a chunk at a time (HEAD_CHUNK_BYTES at
the compute dtype, or a decoder layer's size where that is smaller) into one reused buffer, and each chunk's logits are
computed as it lands, for every micro-batch of the pass at once. A tied checkpoint's one matrix serves both. The
embedding table of a pass is the size of one hidden state of its tokens; the head holds a chunk and its read buffer;
neither holds the vocabulary.
"""
from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import torch

from batchrun.checkpoint import CheckpointError, GGUFTensorInfo, TensorInfo
from batchrun.plan import HEAD_CHUNK_BYTES
from batchrun.runtime.gguf_blocks import dequantize
from batchrun.runtime.turns import PassGroup
from batchrun.runtime.weights import SAFETENSORS_DTYPES, read_into


@dataclass
class PickedLogprobs:
    """What a forward call keeps of its logits: the log-probs of `tokens` ([b, keep, T] ids) at its kept positions.
    A streamed head that computes them itself, chunk by chunk, sets `reduced`: the call's output is then those
    log-probs, and no vocabulary row of the call is ever whole."""
    tokens: torch.Tensor
    reduced: bool = False


# The running forward call's picks (runtime.prefill.forward sets it): each micro-batch of a pass runs in a greenlet of
# its own, with its own value.
CALL_PICKS: ContextVar[PickedLogprobs | None] = ContextVar("batchrun_call_picks", default=None)
# Config keys of a transform some models apply to the head's output (Gemma 2's soft cap, Cohere's scale, Granite's
# divisor): log-probs reduced inside the head would skip it, so such a head returns whole logits.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def transforms_logits(config) -> bool:
    return any(getattr(config, key, None) not in (None, 1, 1.0) for key in LOGIT_TRANSFORMS)


class MatrixRows:
    """Rows of one [rows, width] matrix read from its shard with positional reads, cast to the compute dtype."""

    def __init__(self, info: TensorInfo, *, device: torch.device, dtype: torch.dtype, drop_page_cache: bool):
        if len(info.shape) != 2 or info.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {info.name} is not a matrix batchrun can read by rows")
        self.info = info
        self.rows, self.width = info.shape
        self.source = SAFETENSORS_DTYPES[info.dtype]
        self.row_bytes = self.width * self.source.itemsize
        self.device, self.dtype = device, dtype
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self.fd = os.open(info.file, os.O_RDONLY)
        self.bytes_read = 0
        self._staging: torch.Tensor | None = None

    def _raw(self, rows: int) -> torch.Tensor:
        """A reused byte buffer for `rows` rows as stored (a chunk of the head)."""
        nbytes = rows * self.row_bytes
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = None  # free the old one before allocating the larger
            self._staging = torch.empty(nbytes, dtype=torch.uint8)
        return self._staging[:nbytes]

    def _read(self, raw: torch.Tensor, first_row: int) -> None:
        offset = self.info.offset + first_row * self.row_bytes
        read_into(self.fd, memoryview(raw.numpy()), offset, self.info.file)
        self.bytes_read += raw.numel()

    def read_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        """Rows start..stop into `out` ([stop - start, width] at the compute dtype, contiguous), the pages handed back
        after. Stored at the compute dtype on the host, they are read straight into `out`."""
        if out.dtype == self.source and out.device.type == "cpu":
            raw = out.view(-1).view(torch.uint8)
            self._read(raw, start)
        else:
            raw = self._raw(stop - start)
            self._read(raw, start)
            out.copy_(raw.view(self.source).view(stop - start, self.width))
        if self.drop_page_cache:  # the head is read whole every pass, like a layer: it does not stay in the cache
            os.posix_fadvise(self.fd, self.info.offset + start * self.row_bytes, raw.numel(), os.POSIX_FADV_DONTNEED)
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of `ids` (sorted, distinct, on the host): [len(ids), width] at the compute dtype. Their pages stay
        cached: the same tokens come back pass after pass."""
        if len(ids) and (int(ids[0]) < 0 or int(ids[-1]) >= self.rows):
            bad = int(ids[0]) if int(ids[0]) < 0 else int(ids[-1])
            raise IndexError(f"token id {bad} is outside the embedding's {self.rows:,} rows ({self.info.name})")
        raw = torch.empty(len(ids) * self.row_bytes, dtype=torch.uint8)  # freed with the call: not held through a pass
        listed = ids.tolist()
        run_start = 0
        for i in range(1, len(listed) + 1):  # one read per run of consecutive ids
            if i == len(listed) or listed[i] != listed[i - 1] + 1:
                self._read(raw[run_start * self.row_bytes:i * self.row_bytes], listed[run_start])
                run_start = i
        return self._table(raw, len(listed)).to(self.device)

    def _table(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        """The gathered rows' bytes as a [rows, width] table at the compute dtype, in memory of its own."""
        return raw.view(self.source).view(rows, self.width).to(self.dtype, copy=True)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._staging = None


class GGUFMatrixRows(MatrixRows):
    """Rows of a GGUF matrix: each row is whole blocks, so a run of rows is one byte range, read as it is stored and
    dequantized into the compute dtype (the embedding's rows gathered from the quantized rows, the head dequantized
    chunk by chunk)."""

    def __init__(self, info: GGUFTensorInfo, *, device: torch.device, dtype: torch.dtype, drop_page_cache: bool):
        if len(info.shape) != 2:
            raise CheckpointError(f"{info.file}: tensor {info.name} is not a matrix batchrun can read by rows")
        self.info = info
        self.rows, self.width = info.shape
        self.row_bytes = info.row_bytes
        self.device, self.dtype = device, dtype
        self.drop_page_cache = drop_page_cache and hasattr(os, "posix_fadvise")
        self.fd = os.open(info.file, os.O_RDONLY)
        self.bytes_read = 0
        self._staging = None

    def _decoded(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        return dequantize(raw, self.info.dtype, (rows, self.width))

    def read_rows(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        raw = self._raw(stop - start)
        self._read(raw, start)
        out.copy_(self._decoded(raw, stop - start))
        if self.drop_page_cache:
            os.posix_fadvise(self.fd, self.info.offset + start * self.row_bytes, raw.numel(), os.POSIX_FADV_DONTNEED)
        return out

    def _table(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        return self._decoded(raw, rows).to(self.dtype)


def matrix_rows(info: TensorInfo, *, device: torch.device, dtype: torch.dtype, drop_page_cache: bool) -> MatrixRows:
    """The row reader for a safetensors or GGUF matrix."""
    kind = GGUFMatrixRows if isinstance(info, GGUFTensorInfo) else MatrixRows
    return kind(info, device=device, dtype=dtype, drop_page_cache=drop_page_cache)


def placeholder(rows: int, width: int, *, device: torch.device, dtype: torch.dtype) -> torch.nn.Parameter:
    """A matrix of the right shape, dtype and device holding one row of zeros: what stands for a streamed matrix
    between passes (code that asks the model its device or dtype reads it; no forward computes from it)."""
    return torch.nn.Parameter(torch.zeros(1, width, device=device, dtype=dtype).expand(rows, width),
                              requires_grad=False)


class GatheredEmbedding:
    """Hooks on an embedding module: before it runs, its weight becomes the table of the call's distinct token ids
    and the ids their places in it; after, the placeholder comes back."""

    def __init__(self, module: torch.nn.Module, rows: MatrixRows):
        self.module, self.rows = module, rows
        self.placeholder = placeholder(rows.rows, rows.width, device=rows.device, dtype=rows.dtype)
        module._parameters["weight"] = self.placeholder
        # A padding index (a checkpoint with a pad token) names a row of the whole matrix, which a table of the
        # call's tokens renumbers, and torch refuses one past the table's end. It only keeps that row out of
        # gradients: inference computes the same embedding without it.
        self.padding_idx = getattr(module, "padding_idx", None)
        if self.padding_idx is not None:
            module.padding_idx = None
        self.handles = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                        module.register_forward_hook(self._after)]

    def _before(self, module, args, kwargs):
        ids = args[0] if args else next(iter(kwargs.values()))
        distinct, places = torch.unique(ids, sorted=True, return_inverse=True)
        table = self.rows.gather(distinct.cpu())  # [distinct ids, width]
        module._parameters["weight"] = torch.nn.Parameter(table, requires_grad=False)
        places = places.view(ids.shape)
        if args:
            return (places, *args[1:]), kwargs
        return args, {**kwargs, next(iter(kwargs)): places}

    def _after(self, module, args, output):
        module._parameters["weight"] = self.placeholder

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.module.padding_idx = self.padding_idx


class StreamedHead(torch.nn.Module):
    """Stands in for the LM head module: logits = hidden @ weight.T (+ bias), the weight read a chunk at a time.

    The micro-batches of one pass reach the head in turn (turns.LayerTurns, as at a decoder layer, with the head as
    layer `turn`): each leaves its hidden states, and the last multiplies them all by one read of the head; the
    others then take their logits in turn."""

    def __init__(self, rows: MatrixRows, turn: int, pass_group: Callable[[], PassGroup | None],
                 chunk_bytes: int = HEAD_CHUNK_BYTES, reduces: bool = True):
        super().__init__()
        self.reduces = reduces  # a call's picks are reduced here (PickedLogprobs), where nothing follows the head
        self.rows = rows
        self.weight = placeholder(rows.rows, rows.width, device=rows.device, dtype=rows.dtype)
        self.register_parameter("bias", None)  # the replaced module's, set once it is loaded
        self.turn, self.pass_group = turn, pass_group
        self.chunk_rows = max(1, min(rows.rows, chunk_bytes // (rows.width * rows.dtype.itemsize)))
        self._chunk: torch.Tensor | None = None
        self._held: list[torch.Tensor] = []
        self._logits: dict[int, torch.Tensor] = {}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., width] -> [..., rows] or [..., T] picked
        picks = CALL_PICKS.get() if self.reduces else None
        group = self.pass_group()
        if group is None or group.turns.micro_batches == 1:
            return self.logits([(hidden, picks)])[0]
        turns, micro, last = group.turns, group.micro, group.last_micro
        turns.wait(self.turn, micro)
        if micro == 0:
            self._held, self._logits = [], {}  # a pass that failed halfway leaves nothing for this one
        self._held.append((hidden, picks))
        if last:
            self._logits = dict(enumerate(self.logits(self._held)))
            self._held = []
            turns.advance(self.turn, micro)
            return self._logits.pop(micro)
        turns.advance(self.turn, micro)
        turns.wait(self.turn + 1, micro)  # the last micro-batch computes every one's logits
        turns.advance(self.turn + 1, micro)
        return self._logits.pop(micro)

    def logits(self, calls: list[tuple[torch.Tensor, PickedLogprobs | None]]) -> list[torch.Tensor]:
        """Each call's logits, or its picks' log-probs, from one read of the head, chunk by chunk: every call's
        positions stacked into one [positions, width] matrix, one product a chunk (the model hands the head a
        strided view of its last positions, which a bfloat16 product multiplies far slower than the same rows
        stacked). Positions whose call has picks never get a whole row: a running log-sum-exp and the picked
        tokens' logits are taken from each chunk as it lands."""
        flat = torch.cat([hidden.reshape(-1, hidden.shape[-1]) for hidden, _ in calls])  # [positions, width]
        counts = [hidden.shape[:-1].numel() for hidden, _ in calls]
        whole = [i for i, (_, picks) in enumerate(calls) if picks is None]
        whole_rows = _positions_of(counts, whole, flat.device)
        reduced = _PickReduction.of(calls, counts, flat.device)
        whole_input = flat if reduced is None else flat[whole_rows]  # [whole positions, width]
        picked_input = flat[reduced.rows] if reduced is not None else None  # [picked positions, width]
        logits = flat.new_empty(len(whole_rows), self.rows.rows)  # [whole positions, vocabulary]
        for start in range(0, self.rows.rows, self.chunk_rows):
            stop = min(self.rows.rows, start + self.chunk_rows)
            weight = self.rows.read_rows(start, stop, self._chunk_buffer()[:stop - start])  # [chunk, width]
            bias = self.bias[start:stop] if self.bias is not None else None
            if len(whole_rows):
                logits[:, start:stop] = torch.nn.functional.linear(whole_input, weight, bias)
            if reduced is not None:
                # a block of positions at a time: its logits no larger than the chunk of the head they come from
                block = max(1, self.chunk_rows * self.rows.width // (stop - start))
                for first in range(0, len(picked_input), block):
                    rows = slice(first, first + block)
                    reduced.add(torch.nn.functional.linear(picked_input[rows], weight, bias), start, rows)
        outputs, whole_parts = [], iter(logits.split([counts[i] for i in whole]))
        picked_parts = iter(reduced.finish() if reduced is not None else ())
        for hidden, picks in calls:
            if picks is None:
                outputs.append(next(whole_parts).view(*hidden.shape[:-1], self.rows.rows))
            else:
                outputs.append(next(picked_parts).view(*picks.tokens.shape))
                picks.reduced = True
        return outputs

    def _chunk_buffer(self) -> torch.Tensor:
        if self._chunk is None:
            self._chunk = torch.empty(self.chunk_rows, self.rows.width, dtype=self.rows.dtype, device=self.rows.device)
        return self._chunk


@dataclass
class StreamedMatrices:
    """The token matrices a streamed model reads as passes need them (the embedding gathered, the head streamed,
    either or both), and the readers of their tensors: one per tensor, as a tied matrix serves both uses."""

    gathered: GatheredEmbedding | None = None
    head: StreamedHead | None = None
    head_path: str = ""  # the head module the streamed head takes the place of
    rows: list[MatrixRows] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(rows.bytes_read for rows in self.rows)

    def close(self) -> None:
        if self.gathered is not None:
            self.gathered.remove()
        for rows in self.rows:
            rows.close()


def _positions_of(counts: list[int], calls: list[int], device) -> torch.Tensor:
    """The rows of the stacked positions that belong to `calls` (indices into counts), in order."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    parts = [torch.arange(starts[i], starts[i] + counts[i], device=device) for i in calls]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


class _PickReduction:
    """log_softmax(logits)[picks] over chunks of the vocabulary: per position a running maximum and sum of
    exponentials, and each picked token's logit taken from the chunk that holds it."""

    def __init__(self, rows: torch.Tensor, picks: torch.Tensor):
        self.rows, self.picks = rows, picks  # [P] stacked positions, [P, T] token ids
        self.maximum = torch.full((len(rows),), -torch.inf, device=rows.device)
        self.total = torch.zeros(len(rows), device=rows.device)
        self.picked = torch.zeros(picks.shape, device=rows.device)
        self.sizes: list[int] = []

    @classmethod
    def of(cls, calls, counts: list[int], device) -> _PickReduction | None:
        chosen = [i for i, (_, picks) in enumerate(calls) if picks is not None]
        if not chosen:
            return None
        width = max(calls[i][1].tokens.shape[-1] for i in chosen)
        picks = [torch.nn.functional.pad(calls[i][1].tokens.reshape(counts[i], -1),
                                         (0, width - calls[i][1].tokens.shape[-1])) for i in chosen]
        reduction = cls(_positions_of(counts, chosen, device), torch.cat(picks).to(device))
        reduction.sizes = [(counts[i], calls[i][1].tokens.shape[-1]) for i in chosen]
        return reduction

    def add(self, chunk: torch.Tensor, start: int, rows: slice) -> None:
        """The logits [positions, chunk] of vocabulary rows start.. for the positions `rows` of the reduction."""
        chunk = chunk.float()
        before = self.maximum[rows]
        maximum = torch.maximum(before, chunk.max(dim=-1).values)
        self.total[rows] = (self.total[rows] * torch.exp(before - maximum)
                            + torch.exp(chunk - maximum[:, None]).sum(dim=-1))
        self.maximum[rows] = maximum
        picks = self.picks[rows]
        inside = (picks >= start) & (picks < start + chunk.shape[-1])
        places = (picks - start).clamp(0, chunk.shape[-1] - 1)
        self.picked[rows] = torch.where(inside, chunk.gather(-1, places), self.picked[rows])

    def finish(self) -> list[torch.Tensor]:
        """Each call's picks' log-probs, [positions, its T]."""
        logprobs = self.picked - (self.maximum + torch.log(self.total))[:, None]
        parts = logprobs.split([count for count, _ in self.sizes])
        return [part[:, :width] for part, (_, width) in zip(parts, self.sizes)]
