"""A job cut into shards: fixed ranges of its rows, each named by the job's fingerprint and its range, so every run
of the same job (after a crash, on another driver) cuts the same shards and finds what was published for them.

A shard's worker runs it as a job of its own, from a spec holding its rows as they were read here: messages (the
system message, template and prompt already applied), choices or token limit and stop strings, each row's id being
its place in the whole job. The worker checks that the rows encode on its node exactly as on the driver (the digest
of their row keys: model, compute dtype, tokens, choices, limits), so a node with another checkpoint, tokenizer or
dtype refuses the shard instead of answering differently.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

from batchrun.job import JobOptions
from batchrun.output import atomic_write
from batchrun.spec import EncodedRow


@dataclass(frozen=True)
class Shard:
    id: str  # START-END-HASH: the range in the job's rows and a digest of the job's fingerprint with it
    start: int  # the range of job row indices it covers, [start, end)
    end: int
    indices: tuple[int, ...]  # the job rows it computes (pending, runnable, one of each set of repeated rows)
    keys_digest: str  # of those rows' keys, in order: what the worker must find when it encodes them

    def to_json(self) -> dict:
        return {"id": self.id, "start": self.start, "end": self.end, "rows": len(self.indices)}


def shard_id(fingerprint: str, start: int, end: int) -> str:
    digest = hashlib.sha256(f"{fingerprint}:{start}:{end}".encode()).hexdigest()
    return f"{start:09d}-{end:09d}-{digest[:8]}"


def keys_digest(keys: Sequence[str | None]) -> str:
    return hashlib.sha256("\n".join(str(key) for key in keys).encode()).hexdigest()


def range_rows(shard_rows: int, computed_rows: int, total_rows: int) -> int:
    """The width of a shard's range in the job's rows for about `shard_rows` computed rows each, where only
    `computed_rows` of `total_rows` are computed (the rest done before, invalid, or repeats)."""
    return max(1, math.ceil(shard_rows * max(total_rows, 1) / max(computed_rows, 1)))


def cut_shards(rows: Sequence[EncodedRow], keys: Mapping[int, str | None], fingerprint: str, width: int) -> list[Shard]:
    """The shards of `rows` (the rows to compute, in job order): row index // width picks the range."""
    grouped: dict[int, list[int]] = {}
    for row in rows:
        grouped.setdefault(row.request.index // width, []).append(row.request.index)
    return [Shard(shard_id(fingerprint, number * width, (number + 1) * width), number * width, (number + 1) * width,
                  tuple(indices), keys_digest([keys[index] for index in indices]))
            for number, indices in sorted(grouped.items())]


def shard_row(row: EncodedRow) -> dict:
    """A row as its shard's spec holds it: the messages it is encoded from and what it asks for, its id its index."""
    request = row.request
    line: dict = {"id": request.index,
                  "messages": [{"role": role, "content": content} for role, content in request.messages]}
    if request.choices is not None:
        line["choices"] = list(request.choices)
    else:
        line["max_new_tokens"] = request.max_new_tokens
        if request.stop:
            line["stop"] = list(request.stop)
        if request.structure is not None:  # {"json_schema": ...} or {"regex": ...}, as a native row gives it
            line.update(request.structure.to_json())
    if request.verdict is not None:  # its rationale's limit and stops above, then its verdict
        line.update(choices=list(request.verdict.choices), then=request.verdict.cue)
    if request.continue_final:
        line["continue_final_message"] = True
    return line


def write_shard_spec(path, rows: Sequence[EncodedRow]) -> None:
    """The shard's spec, written whole; left as it is when it already holds these rows (a rerun cuts the same)."""
    data = "".join(json.dumps(shard_row(row), ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.is_file() and path.read_bytes() == data:
        return
    atomic_write(path, lambda temp: temp.write_bytes(data), force=True)


def shard_options(options: JobOptions, compute_dtype: str) -> JobOptions:
    """The options a worker runs a shard with: the rows carry their own messages, choices and limits, the driver's
    compute dtype is fixed (auto could pick another on another node), and calibration belongs to the whole job. A
    model given as a path here (a checkpoint directory, a GGUF file) goes as an absolute path, since a worker's working
    directory is not the driver's; a registry name or hub id goes as it is, for each node to resolve in its own state
    directory or hub cache (the row keys it must encode to tell a node with other bytes)."""
    return replace(options, template=None, id_column=None, label_column=None, keep_columns=None, pair_columns=None,
                   json_schema=None, choices=None, system=None, stop=None, then=None, calibrate="none",
                   skip_invalid=False, dtype=compute_dtype, model=_node_model(options.model))


def _node_model(model: str | None) -> str | None:
    local = Path(model).expanduser() if model is not None else None
    return str(local.absolute()) if local is not None and local.exists() else model
