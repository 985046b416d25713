"""What makes two runs one job, and two rows one answer: the fingerprint of a job (spec, model, rows as they run,
compute dtype) and each row's key (what its answer depends on, without its id and place).
"""
from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path
from typing import Callable, Mapping, Sequence

from batchrun.checkpoint import is_gguf_file, load_config, read_tensor_infos, weight_sample_digest
from batchrun.spec import EncodedRow, JobSpec


def model_identity_parts(checkpoint: Path) -> list[bytes]:
    """The model as a job's identity sees it: config, generation config (end-of-sequence ids), tensor headers and
    the first bytes of every tensor's data. A GGUF file's config is the one built from its metadata, its headers
    its quantized tensors': a job on a GGUF is another job than one on its float32 conversion."""
    if is_gguf_file(checkpoint):
        parts = [json.dumps(load_config(checkpoint), sort_keys=True).encode()]
    else:
        parts = [(checkpoint / "config.json").read_bytes()]
        generation_config = checkpoint / "generation_config.json"
        if generation_config.is_file():
            parts.append(generation_config.read_bytes())
    infos = read_tensor_infos(checkpoint)
    parts += [f"{name}:{info.dtype}:{info.shape}:{info.nbytes}".encode() for name, info in sorted(infos.items())]
    parts.append(weight_sample_digest(infos).encode())
    return parts


def model_digest(model_identity: Sequence[bytes]):
    """The sha256 of the model as a job's identity sees it; its hexdigest is the model's fingerprint."""
    digest = hashlib.sha256()
    for part in model_identity:
        digest.update(part)
    return digest


def row_keys(model_identity: Sequence[bytes], compute_dtype: str,
             rows: Sequence[EncodedRow]) -> dict[int, str | None]:
    """Row index -> what its answer depends on, the row's share of the fingerprint without its id and place: the
    same key in another job of the database is the same answer (store/reuse.py). None for a row that cannot run."""
    model = model_digest(model_identity)
    model.update(compute_dtype.encode())
    keys: dict[int, str | None] = {}
    for row in rows:
        if row.error:
            keys[row.request.index] = None
            continue
        digest = model.copy()
        generates = not row.is_choice
        described = [row.request.choices, row.request.max_new_tokens if generates else None,
                     row.request.stop if generates else None]
        digest.update(json.dumps(described + _verdict(row.request)).encode())
        if row.request.structure is not None:  # an unstructured row keeps the key it always had
            digest.update(f"{row.request.structure.kind}\0{row.request.structure.source}".encode())
        for ids in (row.prompt_ids, *row.choice_ids):
            digest.update(array("q", [len(ids), *ids]).tobytes())
        keys[row.request.index] = digest.hexdigest()
    return keys


def fingerprint(spec: JobSpec, model_identity: Sequence[bytes], compute_dtype: str,
                rows: Sequence[EncodedRow], calibrate: str = "none") -> str:
    """Spec bytes + model identity + every row as it will run + the compute dtype.

    The model is its config, generation config (end-of-sequence ids), tensor headers and the first bytes of every
    tensor's data: a fine-tune with the same config and shapes is another job, not a resume of the base model's.
    A row is its id, token ids (which stand for the tokenizer, chat template, system message, template and --raw),
    choices, token limit, stop strings and the structure its answer must take: an option that changes no row
    (--max-new-tokens on a spec of choice rows, --choices where every row has its own) keeps the job, one that
    changes any row makes a new one. A row's label and carried values, a pair row's order, and the calibration, are the
    job's too (they change its output); a job without them keeps the identity it always had."""
    digest = hashlib.sha256()
    digest.update(spec.content_sha256.encode())
    for part in model_identity:
        digest.update(part)
    for row in rows:
        request = row.request
        generates = not row.is_choice
        described = [request.index, request.id, request.choices, row.error,
                     request.max_new_tokens if generates else None, request.stop if generates else None]
        if request.label is not None or request.carried is not None:
            described += [request.label, request.carried]
        if request.pair is not None:
            described.append(request.pair.to_json())
        described += _verdict(request)
        if request.structure is not None:
            described.append(request.structure.to_json())
        digest.update(json.dumps(described, sort_keys=True).encode())
        for ids in (row.prompt_ids, *row.choice_ids):  # packed: a big corpus has hundreds of millions of tokens
            digest.update(array("q", [len(ids), *ids]).tobytes())
    for bad in spec.invalid:  # recorded as errored rows (--skip-invalid): their ids and reasons are answers too
        carried = [bad.carried] if bad.carried is not None else []  # kept columns: a corpus's failed rows carry them
        digest.update(json.dumps([bad.index, bad.id, bad.location, bad.reason, *carried], sort_keys=True).encode())
    digest.update(json.dumps({"dtype": compute_dtype} if calibrate == "none"
                             else {"dtype": compute_dtype, "calibrate": calibrate}).encode())
    return digest.hexdigest()


def _verdict(request) -> list:
    """What a row that writes its reasons first scores after them (its cue and choices); nothing for other rows, whose
    keys and jobs stay as they were."""
    return [] if request.verdict is None else [request.verdict.to_json()]


def one_row_per_key(rows: Sequence[EncodedRow], key_of: Mapping[int, str | None],
                    progress: Callable[[EncodedRow], int] = lambda row: 0) -> list[EncodedRow]:
    """The rows to compute: one of each set of identical rows (a corpus's repeated documents: same key), the one with
    the most `progress` (tokens a stopped run generated), else the first; the others are answered from it
    (Store.fill_duplicates). A row without a key is its own."""
    chosen: dict[object, EncodedRow] = {}
    for row in rows:
        key = key_of.get(row.request.index) or ("row", row.request.index)
        held = chosen.get(key)
        if held is None or progress(row) > progress(held):
            chosen[key] = row
    kept = {row.request.index for row in chosen.values()}
    return [row for row in rows if row.request.index in kept]
