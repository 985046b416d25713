"""Answers out: Parquet (the default, carrying where its answers come from in its metadata), CSV and OpenAI
Batch-format JSONL, each written atomically.

A write goes to a hidden temp file beside the target, is fsynced, then renamed over it, so a reader
sees the old file or the new one, never half of either, and a failed write leaves the old file as it was.
"""
from __future__ import annotations

import csv
import errno
import glob
import io
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import BatchrunError
from batchrun.host import HOST, disk_free_bytes, faults, package_version, pid_alive
from batchrun.output.answers import OutputRow, job_answers, output_error, output_rows
from batchrun.output.pairs import PAIR_COLUMNS, PairVerdict
from batchrun.plan import format_bytes
from batchrun.quality import SchemaCheck
from batchrun.store import Rationale, RowResult, Store

CHOICE_PROBS_TYPE = pa.map_(pa.string(), pa.float64())


class OutputExists(BatchrunError, FileExistsError):
    """The answers file exists and overwriting it was not asked for (--force)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        super().__init__(f"{path} exists; pass --force to overwrite")


class OutputError(BatchrunError, OSError):
    """Writing an answers file failed (disk full, permissions); the previous file, if any, is unchanged."""

    def __init__(self, path: Path, reason: object):
        self.path, self.reason = Path(path), reason
        super().__init__(f"could not write {path}: {reason}; the previous file, if any, is unchanged")


class OutputFormatUnknown(BatchrunError, ValueError):
    """An output name whose extension says neither Parquet nor JSONL, and no --format."""


FORMATS_BY_SUFFIX = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                     ".json": "jsonl", ".csv": "csv"}
FORMAT_SUFFIXES = {"parquet": ".parquet", "jsonl": ".jsonl", "csv": ".csv"}
PROVENANCE_PREFIX = "batchrun."  # the Parquet key-value metadata keys this package writes


@dataclass(frozen=True)
class Provenance:
    """Where a file's answers come from, written into a Parquet file's key-value metadata as `batchrun.<field>`
    (settings as JSON text). None: not known for this job (its output was never written by a run)."""
    job_id: str
    job_fingerprint: str
    model: str  # the label jobs and plans show
    model_path: str | None  # the checkpoint directory the run read
    model_fingerprint: str | None  # sha256 of what the job's identity reads of the model
    spec_path: str
    spec_sha256: str | None
    settings: dict  # the job's answer settings, calibration included
    batchrun_version: str | None
    written_at: str

    def metadata(self) -> dict[str, str]:
        fields = {**asdict(self), "settings": json.dumps(self.settings, sort_keys=True)}
        return {PROVENANCE_PREFIX + name: str(value) for name, value in fields.items() if value is not None}


def job_provenance(store: Store, job_id: str) -> Provenance:
    """The job's provenance as recorded, stamped now."""
    job = store.job_record(job_id)
    recorded = job["provenance"]
    return Provenance(job["id"], job["fingerprint"], job["model"], recorded.get("model_path"),
                      recorded.get("model_fingerprint"), job["spec_path"], recorded.get("spec_sha256"),
                      job["settings"], package_version("batchrun"),
                      datetime.now(timezone.utc).isoformat(timespec="seconds"))


def default_output_path(spec_path: Path) -> Path:
    """Beside the spec: docs.jsonl -> docs.answers.parquet."""
    spec_path = Path(spec_path)
    return spec_path.with_name(f"{spec_path.stem}.answers.parquet")


def output_format(path: Path, fmt: str | None = None, *, format_option: bool = False) -> str:
    """'parquet', 'csv' or 'jsonl': `fmt` if given, else the extension's (any case); an unknown one is refused rather
    than written as Parquet under a name that says otherwise. `format_option`: the command has --format to suggest."""
    found = FORMATS_BY_SUFFIX.get(Path(path).suffix.lower())
    if fmt:
        if found not in (None, fmt):  # JSONL under a .parquet name would fool every reader that trusts the name
            raise OutputFormatUnknown(f"{path}: the name says {found} but --format {fmt} was given; name the file "
                                      f"for the format ({FORMAT_SUFFIXES[fmt]})")
        return fmt
    if found is None:
        raise OutputFormatUnknown(f"{path}: cannot tell the format from the extension; name it .parquet, .csv or "
                                  ".jsonl (OpenAI batch-output lines)"
                                  + (", or give --format" if format_option else ""))
    return found


def check_output_writable(path: Path, spec_path: Path | None = None, db_path: Path | None = None) -> None:
    """Before any work: a file can be created where `path` goes, so a night's run does not end unwritable. Leaves
    nothing behind: directories still to be made are only checked to be makeable (the write makes them). Never the
    job's own spec or database, even with --force: they are what a resume needs."""
    path = Path(path)
    if spec_path is not None and path.resolve() == Path(spec_path).resolve():
        raise OutputError(path, "it is the job spec itself; name another output file")
    if db_path is not None:
        db = Path(db_path).resolve()
        if path.resolve() in (db, *(db.with_name(db.name + s) for s in ("-wal", "-shm", "-journal"))):
            raise OutputError(path, "it is the job database (--db); name another output file")
    if path.is_dir():
        raise OutputError(path, "it is a directory (checked before running)")
    existing = path.parent.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(path, f"{existing} is a file, not a directory (checked before running)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(path, f"{existing} is not writable (checked before running)")
    if existing == path.parent.absolute():  # the directory exists: prove a file can really be made there
        probe = path.parent / f"{_temp_prefix(path)}{HOST}-{os.getpid()}"
        try:
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise OutputError(path, f"{error.strerror or error} (checked before running)") from None


def write_results(path: Path, results: Sequence[RowResult | OutputRow], fmt: str, *, model: str,
                  force: bool = False, provenance: Provenance | None = None) -> Path:
    """The answers in `fmt` at `path`, atomically; a Parquet file carries `provenance` in its metadata."""
    return _write_bytes(path, encode_results(results, fmt, model=model, provenance=provenance), force)


def encode_results(results: Sequence[RowResult | OutputRow], fmt: str, *, model: str = "",
                   provenance: Provenance | None = None) -> memoryview:
    """The bytes of an answers file in `fmt` (for a file, or for stdout)."""
    if fmt == "jsonl":
        return memoryview(_jsonl_text(results, model).encode("utf-8"))
    if fmt == "csv":
        return memoryview(_csv_text(results_table(results)).encode("utf-8"))
    table = results_table(results)
    if provenance is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **provenance.metadata()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return memoryview(sink.getvalue())


def _write_bytes(path: Path, data: memoryview, force: bool) -> Path:
    """`data` written atomically at `path`; a full disk is named, with what the file needs and what is free."""
    try:
        return atomic_write(Path(path), lambda temp: Path(temp).write_bytes(data), force=force)
    except OutputError as error:
        reason = error.reason
        if not (isinstance(reason, OSError) and reason.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)):
            raise
        directory = Path(path).absolute().parent
        try:
            free = format_bytes(disk_free_bytes(directory))
        except OSError:
            free = "an unknown amount"
        raise OutputError(path, f"{reason.strerror or reason}: the disk holding {directory} has {free} free and "
                                f"the file needs {format_bytes(data.nbytes)}") from None


def atomic_write(path: Path, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """Call write(temp_path), fsync it, and rename it over `path`; refuse to replace a file without force."""
    path = Path(path)
    if path.exists() and not force:
        raise OutputExists(path)
    temp = path.parent / f"{_temp_prefix(path)}{HOST}-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_temps(path)
        write(temp)
        _fsync_path(temp)
        faults.reached("output")
        os.replace(temp, path)
        _fsync_directory(path.parent)  # makes the rename itself durable
    except BaseException as exc:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass  # the original error matters more than a leftover temp file
        if isinstance(exc, OSError) and not isinstance(exc, OutputError):
            raise OutputError(path, exc) from exc
        raise
    return path


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _remove_abandoned_temps(path: Path) -> None:
    """Delete temp files of `path` left by a writer on this host that died mid-write (killed, out of memory): nothing
    else would ever remove them. A temp of a live process, or of another host sharing the directory, is kept."""
    prefix = _temp_prefix(path) + f"{HOST}-"
    for temp in path.parent.glob(glob.escape(prefix) + "*"):
        pid = temp.name[len(prefix):]
        if pid.isdecimal() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            try:
                temp.unlink()
            except OSError:
                pass  # another writer removed it first, or the directory is read-only: the new write decides


def results_table(rows: Sequence[RowResult | OutputRow]) -> pa.Table:
    """The answers as an Arrow table, one row per result, in input order: the answer the output gives (calibrated
    where the job calibrates), the model's own probabilities beside the calibrated ones, the label and whether the
    answer matches it, a pair row's P(a wins) in each order and its verdict's figures (where the job has pair rows),
    then the columns the rows carry through (metadata, kept corpus columns)."""
    ordered = as_output_rows(rows)
    results = [row.result for row in ordered]
    columns = {
        "id": _id_column([result.id for result in results]),
        "answer": pa.array([row.answer for row in ordered], pa.string()),
        "choice_probs": _probs_column([result.choice_probs for result in results]),
        "calibrated_probs": _probs_column([row.calibrated_probs for row in ordered]),
        "score": pa.array([row.score for row in ordered], pa.float64()),
        "logprob": pa.array([row.logprob for row in ordered], pa.float64()),
        "prompt_tokens": pa.array([r.prompt_tokens for r in results], pa.int64()),
        "output_tokens": pa.array([row.output_tokens for row in ordered], pa.int64()),
        "finish_reason": pa.array([r.finish_reason for r in results], pa.string()),
        "error": pa.array([output_error(row) for row in ordered], pa.string()),
        "label": pa.array([r.label for r in results], pa.string()),
        "correct": pa.array([row.correct for row in ordered], pa.bool_()),
    }
    if any(row.pair is not None for row in ordered):
        columns.update(pair_columns([row.pair for row in ordered]))
    if any(result.rationale is not None for result in results):
        columns.update(rationale_columns([result.rationale for result in results]))
    if any(row.check is not None for row in ordered):
        columns.update(structure_columns(ordered))
    for name, values in carried_columns(results).items():
        columns["input_" + name if name in columns else name] = values
    return pa.table(columns)


def answers_table(store: Store, job_id: str) -> pa.Table:
    """The job's answers as its Parquet file has them (an Arrow table, input order)."""
    return results_table(job_answers(store, job_id).rows)


def as_output_rows(rows: Sequence[RowResult | OutputRow]) -> list[OutputRow]:
    """Rows already judged stay as they are; bare results are the model's answers (no calibration)."""
    if all(isinstance(row, OutputRow) for row in rows):
        return sorted(rows, key=lambda row: row.result.idx)
    return output_rows([row.result if isinstance(row, OutputRow) else row for row in rows])


def pair_columns(verdicts: list[PairVerdict | None]) -> dict[str, pa.Array]:
    """A pair row's probabilities in each order, their mean, whether the orders agree and the answers' lengths;
    empty for the job's other rows."""
    types = {"consistent": pa.bool_(), "a_chars": pa.int64(), "b_chars": pa.int64()}
    return {name: pa.array([None if verdict is None else getattr(verdict, name) for verdict in verdicts],
                           types.get(name, pa.float64())) for name in PAIR_COLUMNS}


def rationale_columns(rationales: list[Rationale | None]) -> dict[str, pa.Array]:
    """The reasons a verdict row wrote before its choices were scored, their tokens and why they ended (stop, or
    length where the token limit cut them); empty for the job's other rows."""
    present = [(r.text, len(r.token_ids), r.finish_reason) if r is not None else (None, None, None)
               for r in rationales]
    texts, tokens, ends = zip(*present)
    return {"rationale": pa.array(texts, pa.string()), "rationale_tokens": pa.array(tokens, pa.int64()),
            "rationale_finish_reason": pa.array(ends, pa.string())}


def structure_columns(rows: Sequence[OutputRow]) -> dict[str, pa.Array]:
    """A structured row's parsed answer as JSON text, whether it validates against its schema, and where it does
    not (JSON-pointer paths with the validator's reasons); how many of its tokens the grammar overrode (the model's
    top token refused) and forced, and the lowest log-probability among the tokens the model chose. Empty for the
    job's other rows."""
    checks: list[SchemaCheck | None] = [row.check for row in rows]
    counts = [row.result.grammar or {} for row in rows]
    return {"json": pa.array([None if check is None else check.json for check in checks], pa.string()),
            "schema_valid": pa.array([None if check is None else check.valid for check in checks], pa.bool_()),
            "schema_errors": pa.array([None if check is None else list(check.errors) for check in checks],
                                      pa.list_(pa.string())),
            "grammar_overrides": pa.array([found.get("overrides") for found in counts], pa.int64()),
            "forced_tokens": pa.array([found.get("forced") for found in counts], pa.int64()),
            "lowest_logprob": pa.array([found.get("lowest_logprob") for found in counts], pa.float64())}


def _id_column(ids: list) -> pa.Array:
    # Keep integer ids integers; one string id anywhere makes the column strings (ints as their text).
    if all(isinstance(row_id, int) and not isinstance(row_id, bool) for row_id in ids):
        return pa.array(ids, pa.int64())
    return pa.array([str(row_id) for row_id in ids], pa.string())


def _probs_column(values: list[dict | None]) -> pa.Array:
    return pa.array([None if probs is None else list(probs.items()) for probs in values], CHOICE_PROBS_TYPE)


def carried_columns(results: Sequence[RowResult]) -> dict[str, pa.Array]:
    """The columns rows carry, in the order they first appear. `metadata` (any JSON object) is written as JSON text,
    as is a kept column whose values Arrow cannot hold in one type."""
    names: dict[str, None] = {}
    for result in results:
        names.update(dict.fromkeys(result.carried or {}))
    columns = {}
    for name in names:
        values = [(result.carried or {}).get(name) for result in results]
        if name == "metadata":
            columns[name] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values])
            continue
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[name] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values])
    return columns


def write_parquet(path: Path, rows: Sequence[RowResult | OutputRow], *, force: bool = False,
                  provenance: Provenance | None = None) -> Path:
    return write_results(path, rows, "parquet", model="", force=force, provenance=provenance)


def _csv_text(table: pa.Table) -> str:
    """The Parquet columns as CSV: probabilities and other nested values as JSON text, booleans as true/false, a
    missing value as an empty field."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.column_names)
    columns = [[_csv_value(value, pa.types.is_map(column.type)) for value in column.to_pylist()]
               for column in table.columns]
    writer.writerows(zip(*columns))
    return out.getvalue()


def _csv_value(value, is_map: bool) -> str:
    if value is None:
        return ""
    if is_map:  # Arrow gives a map as key/value pairs
        return json.dumps(dict(value), ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def read_parquet_results(path: Path) -> list[dict]:
    """An answers file's rows as dicts, the probabilities as dicts (Arrow gives a map as key/value pairs)."""
    rows = pq.read_table(path).to_pylist()
    for row in rows:
        for key in ("choice_probs", "calibrated_probs"):
            if row.get(key) is not None:
                row[key] = dict(row[key])
    return rows


def openai_batch_line(row: RowResult | OutputRow, *, model: str, created: int) -> dict:
    """One OpenAI Batch output line for a result.

    A choice row's content is the chosen label, its probabilities ride in the body as `choice_probs` (the calibrated
    ones as `calibrated_probs`, and a numeric one's `score`), and its finish_reason is reported as "stop", a value
    OpenAI clients accept. A generated answer's summed log-probability rides as `logprob`: the Parquet columns, under
    the names they have there. A label, its verdict and the values a row carries sit beside custom_id.
    """
    row = row if isinstance(row, OutputRow) else as_output_rows([row])[0]
    result = row.result
    line_id, custom_id = f"batch_req_{result.idx}", str(result.id)
    line = {"id": line_id, "custom_id": custom_id, "response": None, "error": None}
    for key, value in (("label", result.label), ("correct", row.correct), ("metadata", _line_metadata(result))):
        if value is not None:
            line[key] = value
    if result.failed:
        line["error"] = {"code": "row_failed", "message": result.error or "unknown error"}
        return line
    prompt_tokens, completion_tokens = result.prompt_tokens or 0, row.output_tokens or 0
    body: dict = {
        "id": f"chatcmpl-{result.idx}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": row.answer},
            "finish_reason": "stop" if result.finish_reason == "choice" else result.finish_reason,
            "logprobs": None,
        }],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    extras = {"choice_probs": result.choice_probs, "calibrated_probs": row.calibrated_probs, "score": row.score,
              "logprob": row.logprob, **(row.pair.columns() if row.pair is not None else {}),
              **(_rationale_extras(result.rationale) if result.rationale is not None else {})}
    body.update({key: value for key, value in extras.items() if value is not None})
    line["response"] = {"status_code": 200, "request_id": f"req_{result.idx}", "body": body}
    return line


def _rationale_extras(rationale: Rationale) -> dict:
    return {"rationale": rationale.text, "rationale_tokens": len(rationale.token_ids),
            "rationale_finish_reason": rationale.finish_reason}


def _line_metadata(result: RowResult) -> dict | None:
    """A request's metadata object as it was given; kept corpus columns as one object."""
    carried = result.carried
    if not carried:
        return None
    return carried["metadata"] if set(carried) == {"metadata"} else carried


def write_jsonl(path: Path, rows: Sequence[RowResult | OutputRow], *, model: str, force: bool = False) -> Path:
    return write_results(path, rows, "jsonl", model=model, force=force)


def _jsonl_text(rows: Sequence[RowResult | OutputRow], model: str) -> str:
    created = int(time.time())
    return "".join(json.dumps(openai_batch_line(row, model=model, created=created), ensure_ascii=False) + "\n"
                   for row in as_output_rows(rows))


def _fsync_path(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory to fsync it
        return
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
