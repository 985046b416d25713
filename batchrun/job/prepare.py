"""Everything before the first weight is read: spec, checkpoint, tokens, fingerprint, plan.

Shared by `batchrun plan` (which stops here) and `batchrun submit`. No torch at import.
"""
from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from batchrun import measure
from batchrun.checkpoint import (DEFAULT_REGISTRY_MODEL, CheckpointError, CheckpointSizes, checkpoint_sizes,
                                 default_model, load_config, load_tokenizer, registry_label, resolve_checkpoint,
                                 weights_label)
from batchrun.host import (anonymous_resident_bytes, auto_compute_dtype, available_memory_bytes, cpu_auto_reason,
                           cpu_bfloat16_feature, disk_free_bytes, peak_resident_bytes, reset_peak_resident,
                           resident_bytes, return_freed_memory)
from batchrun.job.identity import fingerprint, model_digest, model_identity_parts, one_row_per_key, row_keys
from batchrun.job.models import kept_model_bytes
from batchrun.job.options import JobOptions
from batchrun.plan import (Bandwidth, Candidate, PlanRequest, Rates, RowCost, make_plan, parse_streaming,
                           shared_prefix_tokens, windows_allow_sharing, with_group_heads)
from batchrun.spec import (EncodedRow, JobSpec, SpecSettings, cued_answer, encode_requests, kept_positions, read_spec,
                           sample_instance, shortest_first_pass_sequence, uses_chat_template)

# shown, stored and written for jobs run without --model: which model, and which of its files
DEFAULT_MODEL_LABEL = f"default ({weights_label(DEFAULT_REGISTRY_MODEL, converted=False)})"
# A model resolved with the process's peak this much higher was converted here (a registry model's first use)
PROVISIONING_PEAK_BYTES = 64 << 20
# What a run holds of each row it has read and encoded, for as long as it runs: the request (its text and settings)
# and the prompt's token ids as Python integers. A large spec's rows are part of the floor
# (docs/planning.md#the-memory-floor; the figures behind them: docs/performance.md#held-rows).
HELD_BYTES_PER_ROW = 1_100
HELD_BYTES_PER_PROMPT_TOKEN = 56
ASSUMED_BANDWIDTH = 1.0e9  # bytes/s: below the cold reads in docs/performance.md, so an unmeasured disk plans slow


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
    row_keys: dict[int, str | None]  # row index -> what its answer depends on (store/reuse.py)
    model_fingerprint: str = ""  # sha256 of the model as the job's identity sees it (the output's provenance)


def names_default_model(model: str | None) -> bool:
    """No --model, `--model default` (to name it beside another model) or the default's registry name
    (smollm2-135m: the same GGUF file, so the same job), unless a directory is called that. Its float32 conversion
    (smollm2-135m:converted) is another model's job."""
    return model is None or (model in ("default", DEFAULT_REGISTRY_MODEL.name) and not Path(model).exists())


def model_label(model: str | None) -> str:
    """How plans, jobs and outputs name a model: the default model's label, a registry model's name with what it
    is, or the --model given."""
    if names_default_model(model):
        return DEFAULT_MODEL_LABEL
    return (registry_label(model) if not Path(model).exists() else None) or model


def resolve_model(model: str | None, options: JobOptions) -> Path:
    peak_before = peak_resident_bytes()
    if names_default_model(model):
        checkpoint = default_model()
    else:
        checkpoint = resolve_checkpoint(model, hf_token=options.hf_token)
    _forget_provisioning_peak(peak_before)
    return checkpoint


def _forget_provisioning_peak(peak_before: int | None) -> None:
    """A registry model converted on first use peaks far above what the run then holds: that peak is the
    conversion's, once, not the run's for its plan to answer for. The memory it freed goes back and the process's
    peak is counted again from here."""
    peak = peak_resident_bytes()
    if peak_before is not None and peak is not None and peak - peak_before > PROVISIONING_PEAK_BYTES:
        return_freed_memory(always=True)
        reset_peak_resident()


def prepare_model(model: str | None, options: JobOptions) -> PreparedModel:
    checkpoint = resolve_model(model, options)
    sizes = checkpoint_sizes(checkpoint, trust_remote_code=options.trust_remote_code)
    # What loading a tokenizer imports (transformers' model code, and torch with it) is the runtime's cost, already
    # counted: imported before the reading, so the reading is the tokenizer's own memory.
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401
    before = resident_bytes()
    tokenizer = load_tokenizer(checkpoint, options.trust_remote_code)
    gc.collect()  # what building it freed (the parsed tokenizer.json) goes back to the kernel
    return_freed_memory(always=True)
    after = resident_bytes()
    if tokenizer is None:
        raise CheckpointError(f"{checkpoint}: the checkpoint ships no tokenizer, so text prompts cannot be encoded")
    # A large vocabulary holds hundreds of MB: part of the run's fixed cost (docs/planning.md#the-memory-floor).
    tokenizer_bytes = max(after - before, 0) if before is not None and after is not None else 0
    return PreparedModel(model_label(model), checkpoint, sizes, tokenizer, sizes.max_position_embeddings,
                         tokenizer_bytes, *_decode_attention(checkpoint, options))


def _decode_attention(checkpoint: Path, options: JobOptions) -> tuple[bool, bool]:
    """(attends through transformers' sdpa, sdpa groups one-token queries): PreparedModel's two fields. The first is
    False, the safe side for the plan's memory, where the answer would take the repository's own code or a config
    transformers cannot read: planning reads config.json alone and must not fail on this."""
    from batchrun.runtime import (attends_through_sdpa, model_config,  # torch, loaded by now
                                  sdpa_groups_one_token_queries)

    groups = sdpa_groups_one_token_queries()
    if load_config(checkpoint, options.trust_remote_code).get("auto_map"):
        return False, groups
    try:
        config = model_config(checkpoint)
    except (ValueError, KeyError, OSError):  # e.g. a model_type this transformers does not know
        return False, groups
    return attends_through_sdpa(config), groups


def read_job_spec(spec_path: Path, options: JobOptions) -> JobSpec:
    return read_spec(spec_path, SpecSettings(
        template=options.template, id_column=options.id_column, choices=options.choices, system=options.system,
        max_new_tokens=options.max_new_tokens, stop=options.stop, skip_invalid=options.skip_invalid,
        label_column=options.label_column, keep_columns=options.keep_columns, pair_columns=options.pair_columns,
        then=options.then, json_schema=options.json_schema))


def row_costs(rows: Sequence[EncodedRow], prefixes: dict[int, int] | None = None) -> list[RowCost]:
    """Plan inputs; a row resuming with k generated tokens prefills k more and decodes k fewer."""
    prefixes = prefixes or {}
    costs = []
    for row in rows:
        if row.is_choice:
            costs.append(RowCost(len(row.prompt_ids), 0, tuple(len(c) for c in row.choice_ids),
                                 group=row.request.pair_group))
        else:
            done = prefixes.get(row.request.index, 0)
            costs.append(RowCost(len(row.prompt_ids) + done, max(1, row.request.max_new_tokens - done),
                                 resumed=done > 0))
    return costs


def verdict_costs(tokenizer, rows: Sequence[EncodedRow]) -> list[RowCost]:
    """What the verdicts of the rows that write a rationale first will cost (spec/verdicts.py): a choice row whose
    prompt is the row's, a rationale at its token limit and the cue."""
    lengths: dict[str, int] = {}

    def tokens(text: str) -> int:
        if text not in lengths:
            lengths[text] = max(1, len(tokenizer.encode(text, add_special_tokens=False)))
        return lengths[text]

    costs = []
    for row in rows:
        verdict = row.request.verdict
        if verdict is None or row.error:
            continue
        cue = tokens(cued_answer("x", verdict.cue)) + 1  # the cue on its line, a token spare for merges at the join
        costs.append(RowCost(len(row.prompt_ids) + row.request.max_new_tokens + cue, 0,
                             tuple(tokens(choice) for choice in verdict.choices), later=True))
    return costs


def compute_dtype_for(options: JobOptions, device: str, storage_dtype: str | None) -> str:
    """--dtype, else what auto computes in on the device for the checkpoint's storage dtype (safetensors code)."""
    if options.dtype and options.dtype != "auto":
        return options.dtype
    return auto_compute_dtype(device, storage_dtype)


def bandwidth_for(checkpoint: Path, options: JobOptions) -> Bandwidth:
    if options.bandwidth_gbps:
        return Bandwidth(options.bandwidth_gbps * 1e9, "declared", "declared with --bandwidth")
    cached = measure.cached_bandwidth(checkpoint)
    if cached is not None:
        return cached
    return Bandwidth(ASSUMED_BANDWIDTH, "assumed",
                     "not measured on this disk yet; `batchrun disk --model ...` measures it")


def plan_rows(prepared: PreparedModel, rows: Sequence[EncodedRow], options: JobOptions, device: str,
              generated: dict[int, int] | None = None, held: Sequence[EncodedRow] | None = None) -> Candidate:
    """Plan `rows` (runnable ones); `generated`: row index -> tokens a previous run already generated; `held`: every
    row the run holds as it goes (the whole spec's, repeats and finished rows included; default `rows`). The
    verdicts of rows that write a rationale first are choice rows the run adds once its generation is done, packed
    after `rows`."""
    costs = row_costs(rows, generated) + verdict_costs(prepared.tokenizer, rows)
    # The kept positions and shortest sequence of the first pass (runtime/score.py): plan and run share the prefix.
    shortest = min((shortest_first_pass_sequence(row) for row in rows), default=0)
    prompts = [row.prompt_ids for row in rows]
    sizes = prepared.sizes
    windows_allow = windows_allow_sharing(sizes.sliding_windows, sizes.unplaced_window, costs)
    shared = shared_prefix_tokens(prompts, own_tokens=kept_positions(rows), sharing_allowed=windows_allow,
                                  shortest_sequence=shortest)
    if windows_allow:  # a pair row's two orders compute their question once (runtime/group_prefix.py)
        costs = with_group_heads(costs[:len(rows)], prompts, shared, kept_positions(rows)) + costs[len(rows):]
    common = 0 if windows_allow else shared_prefix_tokens(prompts, own_tokens=kept_positions(rows),
                                                          shortest_sequence=shortest)
    compute_dtype = compute_dtype_for(options, device, sizes.storage_dtype)
    rates = machine_rates(prepared, options, compute_dtype, device, costs,
                          held_rows_bytes(rows if held is None else held))
    budget = memory_budget(options, device, rates.runtime_overhead_bytes)
    request = PlanRequest(model=prepared.name, device=device, compute_dtype=compute_dtype,
                          memory_budget_bytes=budget, streaming=parse_streaming(options.streaming),
                          prefetch=options.prefetch, prefetch_depth=options.prefetch_depth,
                          batch_size=options.batch_size, context_length=prepared.context_length,
                          checkpoint_is_local=True,
                          pass_seconds=options.pass_minutes * 60 if options.pass_minutes else None,
                          token_matrices=options.token_matrices)
    # A decode step against the shared prefix reads it in place (prefix_attention); one without, where sdpa groups
    # a one-token query on the key heads.
    in_place = prepared.attends_through_sdpa and (shared > 0 or prepared.sdpa_groups_decode_queries)
    plan = make_plan(sizes, costs, request, rates, shared_prefix_tokens=shared, decode_in_place=in_place)
    caveats = (plan.caveats + _glued_choices_caveat(prepared.tokenizer, rows, options.raw) + one_choice_caveat(rows)
               + structure_limit_caveat(prepared.tokenizer, rows))
    if common:
        window = min([window for window in sizes.sliding_windows if window] + [sizes.unplaced_window or math.inf])
        caveats.append(f"the rows share a {common}-token prompt head, but the longest reaches past the model's "
                       f"{window}-token sliding window, so each row computes it (no shared prefix: the window would "
                       f"count the padding between the head and a row's own tokens)")
    reason = (_auto_dtype_reason(sizes)
              if device.split(":")[0] == "cpu" and options.dtype in (None, "auto") else None)
    return replace(plan, linear_kernel=measure.linear_kernel(compute_dtype, device), caveats=caveats,
                   compute_dtype_reason=reason)


def _auto_dtype_reason(sizes: CheckpointSizes) -> str | None:
    """Why --dtype auto computes a CPU run in what it does (None where there is nothing to choose)."""
    if sizes.file_format != "gguf":
        return cpu_auto_reason(sizes.storage_dtype)
    native = cpu_bfloat16_feature()
    return ("auto: float32, in which the GGUF's dequantized weights are exact (bfloat16 rounds them); "
            + (f"--dtype bfloat16 multiplies natively on this CPU ({native}) in half the memory" if native
               else "this CPU has no bfloat16 units (AVX512-BF16 or AMX) for --dtype bfloat16"))


def memory_budget(options: JobOptions, device: str, runtime_bytes: int) -> int:
    """--memory as given; else the memory a run may use, counted once. On the host what is available (MemAvailable,
    or the cgroup's limit less its usage) already leaves out what this process holds, while the plan counts the
    runtime (`runtime_bytes`: imports, tokenizer, the job's encoded rows) on its own: so what this process holds is
    given back, up to what the plan counts for it (its anonymous memory: the files it maps are page cache, which a
    cgroup's headroom may already count as free). Counted twice, the runtime would take its share of a small budget
    a second time (docs/planning.md#memory-the-plan-counts). A model a Ray worker keeps open from its last shard
    (job.models) is given back too: the plan counts its weights."""
    if options.memory_gb:
        return int(options.memory_gb * 1e9)
    available = available_memory_bytes(device)
    if device.split(":")[0] in ("cuda", "mps"):  # the device's own memory: this process's imports are not on it
        return available
    return available + min(anonymous_resident_bytes() or 0, runtime_bytes + kept_model_bytes())


def held_rows_bytes(rows: Sequence[EncodedRow]) -> int:
    """What the run holds of `rows` while it runs: each request and its prompt's token ids."""
    return len(rows) * HELD_BYTES_PER_ROW + sum(len(row.prompt_ids) for row in rows) * HELD_BYTES_PER_PROMPT_TOKEN


def machine_rates(prepared: PreparedModel, options: JobOptions, compute_dtype: str, device: str,
                  costs: Sequence[RowCost], rows_bytes: int = 0) -> Rates:
    """What the plan learns from this machine (batchrun.measure), for this checkpoint computed in compute_dtype;
    `rows_bytes`: what the job's rows hold (held_rows_bytes), fixed beside the runtime and the tokenizer."""
    return Rates(
        bandwidth=bandwidth_for(prepared.checkpoint, options),
        compute_flops_per_s=measure.compute_rate(compute_dtype, device),
        memory_bytes_per_s=measure.memory_read_rate(compute_dtype, device),
        disk_free_bytes=disk_free_bytes(prepared.checkpoint),
        runtime_overhead_bytes=measure.runtime_overhead_bytes(compute_dtype) + prepared.tokenizer_bytes + rows_bytes,
        tokenizer_bytes=prepared.tokenizer_bytes, rows_bytes=rows_bytes,
        decode_rates=_decode_rates(prepared.sizes, compute_dtype, device, costs),
        packs_weights=measure.packs_weights(compute_dtype, device),
        layer_call_seconds=measure.layer_call_seconds(device), compute_threads=measure.compute_threads(),
        dequantize_weights_per_s=measure.dequantize_rates(
            {**prepared.sizes.layer_params_by_type, **prepared.sizes.non_decoder_params_by_type}, compute_dtype,
            device))


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


def one_choice_caveat(rows: Sequence[EncodedRow]) -> list[str]:
    """A row with a single choice is answered with it at probability 1.0 whatever the document says."""
    alone = [row for row in rows if row.is_choice and len(row.request.choices) == 1]
    if not alone:
        return []
    return [f"{len(alone)} row(s) have a single choice ({alone[0].request.location}: {alone[0].request.choices[0]!r}): "
            "each is answered with it at probability 1.0, which says nothing about the document; give every row "
            "two or more choices"]


def structure_limit_caveat(tokenizer, rows: Sequence[EncodedRow]) -> list[str]:
    """Structured rows whose token limit is below what a typical answer of their schema takes (every property
    present, strings a few words long): such a row is cut before its JSON closes (json_incomplete)."""
    needs: dict[str, int] = {}
    short = []
    for row in rows:
        structure = row.request.structure
        if structure is None or not structure.is_json:
            continue
        if structure.key not in needs:
            text = json.dumps(sample_instance(json.loads(structure.source)), separators=(", ", ": "))
            needs[structure.key] = len(tokenizer.encode(text, add_special_tokens=False)) + 1  # and the end
        if row.request.max_new_tokens < needs[structure.key]:
            short.append((row, needs[structure.key]))
    if not short:
        return []
    row, need = short[0]
    most = max(need for _, need in short)
    return [f"{len(short)} structured row(s) allow fewer tokens than a typical answer of their schema takes "
            f"({row.request.location}: max_new_tokens {row.request.max_new_tokens}, estimated {need}): such a row is "
            f"cut before its JSON closes (json_incomplete); give max_new_tokens of at least {most} (more where the "
            "document's strings are long)"]


def detect_device(options: JobOptions) -> str:
    if options.device:
        from batchrun.runtime import check_device
        return check_device(options.device)
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "cpu"
    from batchrun.runtime import default_device
    return default_device()


def prepare_job(spec_path: Path, options: JobOptions) -> PreparedJob:
    spec = read_job_spec(spec_path, options)  # every bad row is reported before any model work
    options = options.with_effective_calibration(spec.requests)
    device = detect_device(options)
    prepared = prepare_model(options.model, options)
    rows = encode_rows(prepared, spec, options)
    dtype = compute_dtype_for(options, device, prepared.sizes.storage_dtype)
    model_identity = model_identity_parts(prepared.checkpoint)
    return PreparedJob(spec, options, prepared, rows, fingerprint(spec, model_identity, dtype, rows, options.calibrate),
                       device, dtype, row_keys(model_identity, dtype, rows),
                       model_digest(model_identity).hexdigest())


def encode_rows(prepared: PreparedModel, spec: JobSpec, options: JobOptions) -> list[EncodedRow]:
    """The spec's rows as the model sees them; an over-long row's document cut where --truncate asks."""
    return encode_requests(prepared.tokenizer, spec.requests, raw=options.raw, context_length=prepared.context_length,
                           truncate=options.truncate, template=options.template)


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
    """What `batchrun plan` prints: the spec's token totals and one candidate per model, each with the seconds
    `submit` takes to start before its passes (with_start_seconds)."""
    began = time.monotonic()
    spec = read_job_spec(spec_path, options)
    read_seconds = time.monotonic() - began
    device = detect_device(options)
    report: dict = {"spec": str(spec_path), "rows": spec.total_rows, "invalid_rows": len(spec.invalid),
                    "device": device, "candidates": []}
    if spec.pair_rows:
        report["pair_rows"] = spec.pair_rows
    if spec.verdict_rows:
        report["verdict_rows"] = spec.verdict_rows
    for model in models:
        try:
            prepared = prepare_model(model, options)
        except CheckpointError as exc:
            report["candidates"].append({"model": model_label(model), "mode": None, "fits": False,
                                         "reason": "the checkpoint cannot be used", "blockers": [str(exc)],
                                         "caveats": []})
            continue
        began = time.monotonic()
        rows = encode_rows(prepared, spec, options)
        encode_seconds = time.monotonic() - began
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
        candidate = plan_rows(prepared, distinct, options, device, held=rows).to_json()
        refusal = nothing_runs(rows, len(spec.invalid))
        if refusal:
            candidate["blockers"].append(refusal)
            candidate["fits"] = False
        candidate["model"] = model_label(model)
        report["candidates"].append(with_start_seconds(candidate, read_seconds + encode_seconds))
    return report


def with_start_seconds(candidate: dict, spec_seconds: float) -> dict:
    """`candidate` with what `submit` spends before its first pass counted in its ETA and first answer: importing
    the runtime (measure.runtime_import_seconds) and reading and encoding the spec (`spec_seconds`, as this process
    just did). On a small CPU the imports alone last as long as a small job's passes (docs/planning.md#time)."""
    start = (measure.runtime_import_seconds() or 0.0) + spec_seconds
    candidate["start_seconds"] = start
    for key in ("eta_seconds", "first_answer_seconds"):
        if candidate.get(key) is not None:
            candidate[key] += start
    return candidate
