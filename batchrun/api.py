"""The Python API: submit a spec and get its answers back as a pyarrow Table, or plan it (plan_job).

A spec is a path (JSONL or Parquet, as `batchrun submit` takes) or rows in memory: a list of dicts (rows as in a
JSONL spec) or a pyarrow Table (rows as in a Parquet spec). Rows in memory are written once to a spec file in the
state directory named by the hash of their bytes, so they get the file's validation and messages, and the same
rows make the same job: a second call resumes it, or answers from the database without computing anything.

No torch at import: the executor is loaded when `submit` runs.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Union

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.distributed import RayRefusals, RaySettings, cluster_settings, submit_job
from batchrun.host import default_db_path, stored_spec
from batchrun.job import JobOptions, plan_report
from batchrun.output import answers_table
from batchrun.spec import SpecError
from batchrun.store import Store

__all__ = ["plan_job", "spec_path", "submit"]

Spec = Union[str, os.PathLike, pa.Table, Iterable[Mapping]]


def submit(spec: Spec, *, output: str | os.PathLike | None = None, db: str | os.PathLike | None = None,
           force: bool = False, quiet: bool = True, options: JobOptions | None = None,
           ray_address: str | RaySettings | None = None, shared: str | os.PathLike | None = None,
           **settings) -> pa.Table:
    """Run a spec (or resume it) and return its answers, one row per spec row in spec order.

    `spec`: a spec file's path (JSONL, CSV/TSV or Parquet, compressed or not), a list of dicts (rows as in a JSONL
    spec) or a pyarrow Table (rows as in a Parquet spec). `settings`: any `JobOptions` field (model, choices,
    max_new_tokens, streaming, ...), applied over `options`. The answers are the columns of the Parquet file
    `batchrun submit` writes. No file is written unless `output` names one (.parquet, or .jsonl for OpenAI batch-output
    lines); `force` overwrites it. Progress is committed to the database (`db`, default $BATCHRUN_HOME/batchrun.db)
    after every pass, so calling again with the same spec resumes an interrupted run and recomputes nothing that is
    done. `quiet=False` shows a progress bar. Raises SpecError naming every bad row before any weight is read; rows in
    memory are named by the spec file written for them under $BATCHRUN_HOME/specs (JSONL: line N is rows[N-1]).

    `ray_address` runs the rows on a Ray cluster, `shared` naming a directory every node sees (docs/distributed.md);
    a RaySettings there sets the shards' size and snapshots too. The answers are those of a run on one machine.

    >>> import batchrun
    >>> rows = [
    ...     {"id": "r1", "prompt": "Review: Lovely hotel.\\nSentiment?", "choices": ["positive", "negative"]},
    ...     {"id": "r2", "prompt": "Name a fruit.", "max_new_tokens": 4},
    ... ]
    >>> answers = batchrun.submit(rows)
    >>> answers.column_names
    ['id', 'answer', 'choice_probs', 'calibrated_probs', 'score', 'logprob', 'prompt_tokens', 'output_tokens',
     'finish_reason', 'error', 'label', 'correct']
    >>> answers["id"].to_pylist(), answers["answer"][0].as_py() in ("positive", "negative")
    (['r1', 'r2'], True)
    """
    options = job_options(options, settings)
    db_path = Path(db) if db is not None else default_db_path()
    cluster = ray_settings(ray_address, shared)
    summary = submit_job(spec_path(spec), cluster, options=options, output=output, db=db_path, force=force,
                         quiet=quiet, write_output=output is not None)
    store = Store(db_path)
    try:
        return answers_table(store, summary.job_id)
    finally:
        store.close()


def plan_job(spec: Spec, *, models: Sequence[str | os.PathLike | None] | None = None,
             options: JobOptions | None = None, **settings) -> dict:
    """What running a spec would cost, per model: the report `batchrun plan --json` prints. Reads no weights.

    `spec` and `settings` are as in `submit`. `models`: checkpoints to compare (directories, GGUF files, registry
    names, hub ids, or None for the default model); by default the one `options` or `model=` names. The report
    holds the spec's row and token counts and one candidate per model: `mode` (resident or streamed), `fits`,
    `batch_size`, `passes`, `peak_memory_bytes`, `eta_seconds`, and the `blockers` and `caveats` behind them.

    >>> import batchrun
    >>> report = batchrun.plan_job([{"id": "r1", "prompt": "Review: Lovely hotel.\\nSentiment?",
    ...                              "choices": ["positive", "negative"]}])
    >>> report["rows"], report["candidates"][0]["fits"], report["candidates"][0]["mode"]
    (1, True, 'resident')
    """
    options = job_options(options, settings)
    chosen = [None if model is None else os.fspath(model) for model in models] if models else [options.model]
    return plan_report(spec_path(spec), chosen, options)


_RAY_REFUSALS = RayRefusals(TypeError, "shared applies to a run on a Ray cluster: give ray_address too",
                            "ray_address needs shared=: a directory every node of the cluster sees at the same path")


def ray_settings(ray_address: str | RaySettings | None, shared: str | os.PathLike | None) -> RaySettings | None:
    """The cluster a submit runs on: None for this machine; an address needs the shared directory beside it."""
    if isinstance(ray_address, RaySettings):
        if shared is not None and Path(shared).expanduser().absolute() != ray_address.shared:
            raise TypeError("shared is given twice, in RaySettings and as shared=, with different directories")
        return ray_address
    return cluster_settings(ray_address, shared, _RAY_REFUSALS)


def job_options(options: JobOptions | None, settings: dict) -> JobOptions:
    """`options` with `settings` (JobOptions fields, as keywords) applied over it; lists become the tuples the CLI
    gives, and a model path its text, as jobs record it."""
    known = {field.name for field in dataclasses.fields(JobOptions)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; settings are JobOptions fields: "
                        f"{', '.join(sorted(known))}")
    settings = {name: tuple(value) if name in ("choices", "stop") and isinstance(value, list) else value
                for name, value in settings.items()}
    options = dataclasses.replace(options or JobOptions(), **settings)
    if isinstance(options.model, os.PathLike):
        options = dataclasses.replace(options, model=os.fspath(options.model))
    return options


def spec_path(spec: Spec) -> Path:
    """The spec file to run: `spec` itself when it is a path, else the state directory's file for its rows."""
    if isinstance(spec, (str, os.PathLike)):
        return Path(spec)
    if isinstance(spec, (pa.Table, pa.RecordBatch)) or hasattr(spec, "__arrow_c_stream__"):
        return _stored_spec(_parquet_bytes(pa.table(spec)), ".parquet")
    if isinstance(spec, Mapping):
        raise SpecError(["rows: got one dict; pass a list of rows (dicts), a pyarrow Table or a spec path"])
    if isinstance(spec, (bytes, bytearray)) or not isinstance(spec, Iterable):
        raise TypeError(f"a spec is a path, a list of dicts or a pyarrow Table, not {type(spec).__name__}")
    return _stored_spec(_jsonl_bytes(spec), ".jsonl")


def _jsonl_bytes(rows: Iterable) -> bytes:
    """One JSON line a row, as a JSONL spec holds them; a row's values must be JSON values (numpy's become theirs)."""
    lines = []
    for index, row in enumerate(rows):
        try:  # ValueError: a circular reference, or a string no UTF-8 can hold (a lone surrogate)
            lines.append((json.dumps(row, ensure_ascii=False, default=_json_value) + "\n").encode("utf-8"))
        except (TypeError, ValueError) as error:
            raise SpecError([f"rows[{index}]: not a JSON value ({error})"]) from None
    return b"".join(lines)


def _json_value(value: object) -> object:
    """numpy scalars and arrays, as a column taken from pandas holds them, as the Python values they stand for."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _parquet_bytes(table: pa.Table) -> bytes:
    """The table as Parquet, one row group: the same table makes the same bytes however its chunks were split."""
    buffer = io.BytesIO()
    pq.write_table(table.combine_chunks(), buffer)
    return buffer.getvalue()


def _stored_spec(data: bytes, suffix: str) -> Path:
    return stored_spec(data, "rows", suffix)
