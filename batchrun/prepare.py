"""Everything before the first weight is read: spec, checkpoint, tokens, fingerprint, plan.

Shared by `batchrun plan` (which stops here) and `batchrun submit`. No torch at import.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from array import array
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from batchrun import available, measure
from batchrun.checkpoint import (CheckpointError, CheckpointSizes, checkpoint_sizes, load_config, read_tensor_infos,
                                 resolve_checkpoint)
from batchrun.checkpoint_files import weight_sample_digest
from batchrun.compute_dtype import cpu_auto_dtype, cpu_auto_reason
from batchrun.errors import SettingRefused
from batchrun.batching import shared_prefix_tokens, windows_allow_sharing
from batchrun.plan import Bandwidth, Candidate, RowCost, make_plan, parse_streaming
from batchrun.prompts import (EncodedRow, encode_requests, kept_positions, shortest_first_pass_sequence,
                              uses_chat_template)
from batchrun.spec import JobSpec, read_spec
from batchrun.tokenizer import load_tokenizer

# Settings that can change answers, recorded with a job. Its identity is what they do to its rows (fingerprint):
# batch size, memory budget, streaming policy and prefetch change no row, so a job resumes whatever they are.
ANSWER_SETTINGS = ("template", "id_column", "choices", "system", "max_new_tokens", "stop", "raw", "dtype")
DEFAULT_MODEL_LABEL = "default (SmolLM2-135M-Instruct)"  # shown, stored and written for jobs run without --model
ASSUMED_BANDWIDTH = 1.0e9  # bytes/s: the low end of cold sequential reads measured on this kind of machine


@dataclass
class JobOptions:
    model: str | None = None
    template: str | None = None
    id_column: str | None = None
    choices: tuple[str, ...] | None = None
    system: str | None = None
    max_new_tokens: int = 16
    stop: tuple[str, ...] | None = None
    raw: bool = False
    dtype: str | None = None
    skip_invalid: bool = False
    device: str | None = None
    batch_size: int | None = None
    memory_gb: float | None = None
    streaming: str | None = None
    prefetch: bool = True
    prefetch_depth: int = 1  # layers read ahead of the one computing
    micro_batch: int | None = None  # sequences per forward call within a pass (default: the plan's)
    bandwidth_gbps: float | None = None
    hf_token: str | None = field(default=None, repr=False)
    trust_remote_code: bool = False

    def __post_init__(self):
        """The checks the CLI's option types make, for scripts that build options themselves."""
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise SettingRefused(f"dtype {self.dtype!r}: use float32, bfloat16 or float16 (or None: the device's)")
        for name in ("batch_size", "micro_batch", "prefetch_depth", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SettingRefused(f"{name} must be a positive integer, got {value!r}")
        for name in ("memory_gb", "bandwidth_gbps"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise SettingRefused(f"{name} must be a positive number, got {value!r}")
        if self.streaming is not None:
            try:
                parse_streaming(self.streaming)
            except ValueError as error:
                raise SettingRefused(str(error)) from None

    def answer_settings(self) -> dict:
        values = asdict(self)
        return {k: (list(values[k]) if isinstance(values[k], tuple) else values[k]) for k in ANSWER_SETTINGS}


@dataclass
class PreparedModel:
    name: str
    checkpoint: Path
    sizes: CheckpointSizes
    tokenizer: object
    context_length: int | None
    tokenizer_bytes: int = 0  # resident memory the tokenizer took as it loaded: a run holds it beside the model
    # How its decode steps attend (prefix_attention): through transformers' sdpa, and whether sdpa then reads a
    # one-token query's keys and values where they lie. The plan sizes decode calls by them.
    attends_through_sdpa: bool = False
    sdpa_groups_decode_queries: bool = False


@dataclass
class PreparedJob:
    spec: JobSpec
    options: JobOptions
    model: PreparedModel
    rows: list[EncodedRow]  # valid rows, tokenized (some may carry an error: too long for the context)
    fingerprint: str
    device: str
    compute_dtype: str
    row_keys: dict[int, str | None]  # row index -> what its answer depends on (store_reuse.py)


def names_default_model(model: str | None) -> bool:
    """No --model, or `--model default` (to name it beside another model), unless a directory is called that."""
    return model is None or (model == "default" and not Path(model).exists())


def model_label(model: str | None) -> str:
    """How plans, jobs and outputs name a model: the --model given, or the default model's label."""
    return DEFAULT_MODEL_LABEL if names_default_model(model) else model


def resolve_model(model: str | None, options: JobOptions) -> Path:
    if names_default_model(model):
        from batchrun.default import default_model
        return default_model()
    return resolve_checkpoint(model, hf_token=options.hf_token)


def prepare_model(model: str | None, options: JobOptions) -> PreparedModel:
    checkpoint = resolve_model(model, options)
    sizes = checkpoint_sizes(checkpoint, trust_remote_code=options.trust_remote_code)
    # What loading a tokenizer imports (transformers' model code, and torch with it) is the runtime's cost, already
    # counted: imported before the reading, so the reading is the tokenizer's own memory.
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401
    before = measure.resident_bytes()
    tokenizer = load_tokenizer(checkpoint, options.trust_remote_code)
    after = measure.resident_bytes()
    if tokenizer is None:
        raise CheckpointError(f"{checkpoint}: the checkpoint ships no tokenizer, so text prompts cannot be encoded")
    # A 262k-entry vocabulary (Gemma) holds ~310 MB, SmolLM2's ~50 MB: part of the run's fixed cost.
    tokenizer_bytes = max(after - before, 0) if before is not None and after is not None else 0
    return PreparedModel(model_label(model), checkpoint, sizes, tokenizer, sizes.max_position_embeddings,
                         tokenizer_bytes, *_decode_attention(checkpoint, options))


def _decode_attention(checkpoint: Path, options: JobOptions) -> tuple[bool, bool]:
    """(attends through transformers' sdpa, sdpa groups one-token queries): PreparedModel's two fields. The first is
    False, the safe side for the plan's memory, where the answer would take the repository's own code or a config
    transformers cannot read: planning reads config.json alone and must not fail on this."""
    from transformers import AutoConfig

    from batchrun import prefix_attention  # torch, imported with transformers' model code by now

    groups = prefix_attention.sdpa_groups_one_token_queries()
    if load_config(checkpoint, options.trust_remote_code).get("auto_map"):
        return False, groups
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (ValueError, KeyError, OSError):  # e.g. a model_type this transformers does not know
        return False, groups
    return prefix_attention.attends_through_sdpa(config), groups


def read_job_spec(spec_path: Path, options: JobOptions) -> JobSpec:
    return read_spec(spec_path, template=options.template, id_column=options.id_column, choices=options.choices,
                     system=options.system, max_new_tokens=options.max_new_tokens, stop=options.stop,
                     skip_invalid=options.skip_invalid)


def model_identity_parts(checkpoint: Path) -> list[bytes]:
    """The model as a job's identity sees it: config, generation config (end-of-sequence ids), tensor headers and
    the first bytes of every tensor's data."""
    parts = [(checkpoint / "config.json").read_bytes()]
    generation_config = checkpoint / "generation_config.json"
    if generation_config.is_file():
        parts.append(generation_config.read_bytes())
    infos = read_tensor_infos(checkpoint)
    parts += [f"{name}:{info.dtype}:{info.shape}:{info.nbytes}".encode() for name, info in sorted(infos.items())]
    parts.append(weight_sample_digest(infos).encode())
    return parts


def row_keys(model_identity: Sequence[bytes], compute_dtype: str,
             rows: Sequence[EncodedRow]) -> dict[int, str | None]:
    """Row index -> what its answer depends on, the row's share of the fingerprint without its id and place: the
    same key in another job of the database is the same answer (store_reuse.py). None for a row that cannot run."""
    model = hashlib.sha256()
    for part in model_identity:
        model.update(part)
    model.update(compute_dtype.encode())
    keys: dict[int, str | None] = {}
    for row in rows:
        if row.error:
            keys[row.request.index] = None
            continue
        digest = model.copy()
        generates = not row.is_choice
        digest.update(json.dumps([row.request.choices, row.request.max_new_tokens if generates else None,
                                  row.request.stop if generates else None]).encode())
        for ids in (row.prompt_ids, *row.choice_ids):
            digest.update(array("q", [len(ids), *ids]).tobytes())
        keys[row.request.index] = digest.hexdigest()
    return keys


def fingerprint(spec: JobSpec, model_identity: Sequence[bytes], compute_dtype: str,
                rows: Sequence[EncodedRow]) -> str:
    """Spec bytes + model identity + every row as it will run + the compute dtype.

    The model is its config, generation config (end-of-sequence ids), tensor headers and the first bytes of every
    tensor's data: a fine-tune with the same config and shapes is another job, not a resume of the base model's.
    A row is its id, token ids (which stand for the tokenizer, chat template, system message, template and --raw),
    choices, token limit and stop strings: an option that changes no row (--max-new-tokens on a spec of choice
    rows, --choices where every row has its own) keeps the job, one that changes any row makes a new one."""
    digest = hashlib.sha256()
    digest.update(spec.content_sha256.encode())
    for part in model_identity:
        digest.update(part)
    for row in rows:
        request = row.request
        generates = not row.is_choice
        digest.update(json.dumps([request.index, request.id, request.choices, row.error,
                                  request.max_new_tokens if generates else None,
                                  request.stop if generates else None]).encode())
        for ids in (row.prompt_ids, *row.choice_ids):  # packed: a big corpus has hundreds of millions of tokens
            digest.update(array("q", [len(ids), *ids]).tobytes())
    for bad in spec.invalid:  # recorded as errored rows (--skip-invalid): their ids and reasons are answers too
        digest.update(json.dumps([bad.index, bad.id, bad.location, bad.reason]).encode())
    digest.update(json.dumps({"dtype": compute_dtype}).encode())
    return digest.hexdigest()


def row_costs(rows: Sequence[EncodedRow], prefixes: dict[int, int] | None = None) -> list[RowCost]:
    """Plan inputs; a row resuming with k generated tokens prefills k more and decodes k fewer."""
    prefixes = prefixes or {}
    costs = []
    for row in rows:
        if row.is_choice:
            costs.append(RowCost(len(row.prompt_ids), 0, tuple(len(c) for c in row.choice_ids)))
        else:
            done = prefixes.get(row.request.index, 0)
            costs.append(RowCost(len(row.prompt_ids) + done, max(1, row.request.max_new_tokens - done),
                                 resumed=done > 0))
    return costs


def compute_dtype_for(options: JobOptions, device: str, storage_dtype: str | None) -> str:
    """--dtype, else auto for the device and the checkpoint's storage dtype (safetensors code), as
    devices.default_dtype."""
    if options.dtype and options.dtype != "auto":
        return options.dtype
    kind = device.split(":")[0]  # "cpu:0" is the CPU too
    if kind == "cpu":
        return cpu_auto_dtype(storage_dtype)
    return "float16" if kind == "mps" else "bfloat16"


def bandwidth_for(checkpoint: Path, options: JobOptions) -> Bandwidth:
    if options.bandwidth_gbps:
        return Bandwidth(options.bandwidth_gbps * 1e9, "declared", "declared with --bandwidth")
    cached = measure.cached_bandwidth(checkpoint)
    if cached is not None:
        return cached
    return Bandwidth(ASSUMED_BANDWIDTH, "assumed",
                     "not measured on this disk yet; `batchrun disk --model ...` measures it")


def plan_rows(prepared: PreparedModel, rows: Sequence[EncodedRow], options: JobOptions, device: str,
              generated: dict[int, int] | None = None) -> Candidate:
    """Plan `rows` (runnable ones); `generated`: row index -> tokens a previous run already generated."""
    costs = row_costs(rows, generated)
    # The kept positions and shortest sequence of the first pass (score.py), so plan and run share the same prefix.
    shortest = min((shortest_first_pass_sequence(row) for row in rows), default=0)
    prompts = [row.prompt_ids for row in rows]
    sizes = prepared.sizes
    windows_allow = windows_allow_sharing(sizes.sliding_windows, sizes.unplaced_window, costs)
    shared = shared_prefix_tokens(prompts, own_tokens=kept_positions(rows), sharing_allowed=windows_allow,
                                  shortest_sequence=shortest)
    common = 0 if windows_allow else shared_prefix_tokens(prompts, own_tokens=kept_positions(rows),
                                                          shortest_sequence=shortest)
    compute_dtype = compute_dtype_for(options, device, sizes.storage_dtype)
    budget = int(options.memory_gb * 1e9) if options.memory_gb else available.available_memory_bytes(device)
    plan = make_plan(
        prepared.sizes, costs, model=prepared.name, device=device, compute_dtype=compute_dtype,
        memory_budget_bytes=budget, streaming=parse_streaming(options.streaming), prefetch=options.prefetch,
        prefetch_depth=options.prefetch_depth,
        bandwidth=bandwidth_for(prepared.checkpoint, options),
        compute_flops_per_s=measure.compute_rate(compute_dtype, device),
        memory_bytes_per_s=measure.memory_read_rate(compute_dtype, device),
        disk_free_bytes=available.disk_free_bytes(prepared.checkpoint), checkpoint_is_local=True,
        runtime_overhead_bytes=measure.runtime_overhead_bytes() + prepared.tokenizer_bytes,
        batch_size=options.batch_size,
        context_length=prepared.context_length, shared_prefix_tokens=shared,
        decode_rates=_decode_rates(sizes, compute_dtype, device, costs),
        # A decode step against the shared prefix reads it in place (prefix_attention); one without, where sdpa
        # groups a one-token query on the key heads.
        decode_in_place=prepared.attends_through_sdpa and (shared > 0 or prepared.sdpa_groups_decode_queries),
        packs_weights=measure.packs_weights(compute_dtype, device),
        layer_call_seconds=measure.layer_call_seconds(device), compute_threads=measure.compute_threads())
    caveats = plan.caveats + _glued_choices_caveat(prepared.tokenizer, rows, options.raw)
    if common:
        window = min([window for window in sizes.sliding_windows if window] + [sizes.unplaced_window or math.inf])
        caveats.append(f"the rows share a {common}-token prompt head, but the longest reaches past the model's "
                       f"{window}-token sliding window, so each row computes it (no shared prefix: the window would "
                       f"count the padding between the head and a row's own tokens)")
    reason = (cpu_auto_reason(sizes.storage_dtype)
              if device.split(":")[0] == "cpu" and options.dtype in (None, "auto") else None)
    return replace(plan, linear_kernel=measure.linear_kernel(compute_dtype, device), caveats=caveats,
                   compute_dtype_reason=reason)


def _decode_rates(sizes: CheckpointSizes, compute_dtype: str, device: str, costs) -> dict[int, float] | None:
    """The layer matrices' rates by row count, measured only where a decode pass will run (a generating row) and
    the weights are plain matrices (a quantized checkpoint's packed tensors are not what its matmuls multiply)."""
    if sizes.quantization or not any(cost.passes() > 1 for cost in costs):
        return None
    return measure.decode_rates(sizes.layer_matrices, sizes.num_layers, compute_dtype, device)


def _glued_choices_caveat(tokenizer, rows: Sequence[EncodedRow], raw: bool) -> list[str]:
    """Without a chat template a choice is scored as the very next text after the prompt: "...one word.positive"."""
    if uses_chat_template(tokenizer, raw):
        return []
    glued = sum(1 for row in rows if row.is_choice and not row.request.messages[-1][1][-1:].isspace()
                and any(not choice[:1].isspace() for choice in row.request.choices))
    if not glued:
        return []
    return [f"{glued} choice row(s) score each choice as the text right after the prompt (\"...one word.positive\"): "
            "with no chat template, write choices with the space a continuation begins with (\" positive\")"]


def detect_device(options: JobOptions) -> str:
    if options.device:
        from batchrun.devices import check_device
        return check_device(options.device)
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "cpu"
    from batchrun.devices import default_device
    return default_device()


def prepare_job(spec_path: Path, options: JobOptions) -> PreparedJob:
    spec = read_job_spec(spec_path, options)  # every bad row is reported before any model work
    device = detect_device(options)
    prepared = prepare_model(options.model, options)
    rows = encode_requests(prepared.tokenizer, spec.requests, raw=options.raw,
                           context_length=prepared.context_length)
    dtype = compute_dtype_for(options, device, prepared.sizes.storage_dtype)
    model_identity = model_identity_parts(prepared.checkpoint)
    return PreparedJob(spec, options, prepared, rows, fingerprint(spec, model_identity, dtype, rows), device, dtype,
                       row_keys(model_identity, dtype, rows))


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


def nothing_runs(rows: Sequence[EncodedRow], invalid_rows: int = 0) -> str | None:
    """Why a job none of whose rows can run on this model is refused (a spec meant for another model, a context
    too short for every prompt): a run would only record errors, and exit as if it had answered."""
    errored = [row for row in rows if row.error]
    if len(errored) < len(rows) or not (rows or invalid_rows):
        return None
    reasons = "; ".join(f"{row.request.location}: {row.error}" for row in errored[:3])
    more = len(errored) - 3 + invalid_rows
    return (f"none of the {len(rows) + invalid_rows} rows can run on this model"
            + (f": {reasons}" if reasons else "") + (f" (and {more} more)" if more > 0 else ""))


def plan_report(spec_path: Path, models: Sequence[str | None], options: JobOptions) -> dict:
    """What `batchrun plan` prints: the spec's token totals and one candidate per model."""
    from batchrun.checkpoint import CheckpointError

    spec = read_job_spec(spec_path, options)
    device = detect_device(options)
    report: dict = {"spec": str(spec_path), "rows": spec.total_rows, "invalid_rows": len(spec.invalid),
                    "device": device, "candidates": []}
    for model in models:
        try:
            prepared = prepare_model(model, options)
        except CheckpointError as exc:
            report["candidates"].append({"model": model_label(model), "mode": None, "fits": False,
                                         "reason": "the checkpoint cannot be used", "blockers": [str(exc)],
                                         "caveats": []})
            continue
        rows = encode_requests(prepared.tokenizer, spec.requests, raw=options.raw,
                               context_length=prepared.context_length)
        runnable = [r for r in rows if not r.error]
        distinct = one_row_per_key(runnable, row_keys(model_identity_parts(prepared.checkpoint),
                                                      compute_dtype_for(options, device, prepared.sizes.storage_dtype),
                                                      runnable))
        if "prompt_tokens_total" not in report:
            report["repeated_rows"] = len(runnable) - len(distinct)
            report["prompt_tokens_total"] = sum(len(r.prompt_ids) for r in rows)
            report["prompt_tokens_max"] = max((len(r.prompt_ids) for r in rows), default=0)
            report["new_tokens_max"] = max((r.request.max_new_tokens for r in rows if not r.is_choice), default=0)
            report["unrunnable_rows"] = [{"location": r.request.location, "reason": r.error} for r in rows if r.error]
        candidate = plan_rows(prepared, distinct, options, device).to_json()
        refusal = nothing_runs(rows, len(spec.invalid))
        if refusal:
            candidate["blockers"].append(refusal)
            candidate["fits"] = False
        candidate["model"] = model_label(model)
        report["candidates"].append(candidate)
    return report
