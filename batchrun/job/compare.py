"""Is the bigger model worth the wait? The user's labelled rows, run on each candidate model through the normal
executor (so the work is stored, and a later full `submit` on either model reuses it), judged against their labels,
beside what the whole job would cost on each model by its plan; with a panel, the models' answers combined row by
row into the panel's (output/panel.py), written as a file beside the spec and judged like each model's.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL, checkpoint_location
from batchrun.errors import SettingRefused
from batchrun.host import default_db_path, stored_spec
from batchrun.job.options import JobOptions
from batchrun.job.prepare import model_label, names_default_model, plan_report, read_job_spec
from batchrun.output import (Judge, OutputExists, check_output_writable, describe_panel, job_answers, panel_figures,
                             panel_of, quality, write_panel)
from batchrun.plan import format_duration
from batchrun.quality import PANEL_METHODS
from batchrun.spec import Request
from batchrun.store import Store

DEFAULT_SAMPLE = 200


@dataclass
class ModelResult:
    model: str
    job_id: str
    metric: str  # "accuracy" or "exact_match"
    raw: dict | None  # label metrics of the model's own answers
    calibrated: dict | None  # of the calibrated answers, where calibration changed anything
    calibration: str
    passes: int | None  # the whole job's, by the plan
    eta_seconds: float | None

    @property
    def judged(self) -> dict | None:
        return self.calibrated or self.raw

    def to_json(self) -> dict:
        return {**self.__dict__, "eta_human": format_duration(self.eta_seconds) if self.eta_seconds else None}


def stratified_sample(requests: Sequence[Request], size: int) -> list[Request]:
    """Exactly `min(size, labelled rows)` labelled rows, each label's share kept (at least one row of every label
    where size allows); chosen by a hash of the row's id, so the same spec gives the same sample. Spec order is
    kept."""
    by_label: dict[str, list[Request]] = {}
    for request in requests:
        if request.label is not None:
            by_label.setdefault(request.label, []).append(request)
    quota = label_quotas({label: len(members) for label, members in by_label.items()}, size)
    chosen = [request for label, members in by_label.items()
              for request in sorted(members, key=_row_hash)[:quota[label]]]
    return sorted(chosen, key=lambda request: request.index)


def label_quotas(counts: dict[str, int], size: int) -> dict[str, int]:
    """How many rows of each label a sample of `size` takes: largest-remainder apportionment, so the quotas add up
    to exactly `min(size, total)`; ties go to the label seen first, so the split is the same every time."""
    total = sum(counts.values())
    if total <= size:
        return dict(counts)
    shares = {label: divmod(size * count, total) for label, count in counts.items()}  # exact, no float ties
    quota = {label: whole for label, (whole, _) in shares.items()}
    by_remainder = sorted(counts, key=lambda label: shares[label][1], reverse=True)
    for label in by_remainder[:size - sum(quota.values())]:
        quota[label] += 1
    if size >= len(counts):  # a label with no row in the sample would go unjudged: lend it one from the largest
        for label in counts:
            if quota[label] == 0:
                quota[max(quota, key=quota.__getitem__)] -= 1
                quota[label] = 1
    return quota


def _row_hash(request: Request) -> str:
    return hashlib.sha256(json.dumps(request.id).encode()).hexdigest()


def sample_spec(requests: Sequence[Request]) -> Path:
    """The sampled rows as a spec of request rows that encode exactly as they do in the full job (same messages,
    choices and limits), so both jobs' rows share their keys and either reuses the other's answers."""
    lines = []
    for request in requests:
        # a pair row's two orders are two rows here, each judged against the choice its order should give
        row_id = request.id if request.pair is None else f"{request.id} ({request.pair.order})"
        row: dict = {"id": row_id, "messages": [{"role": role, "content": text} for role, text in request.messages]}
        if request.prompt is not None:  # a prompt row: the same text through the same encoding as the full job's
            system = request.messages[0][1] if request.messages[0][0] == "system" else ""
            row = {"id": row_id, "prompt": request.prompt, "system": system}
        if request.choices is not None:
            row["choices"] = list(request.choices)
        else:
            row.update(max_new_tokens=request.max_new_tokens, stop=list(request.stop))
        lines.append(json.dumps({**row, "label": request.label}, ensure_ascii=False) + "\n")
    return stored_spec("".join(lines).encode("utf-8"), "compare", ".jsonl")


@dataclass
class Comparison:
    spec: str
    sample_rows: int
    labelled_rows: int
    models: list[ModelResult]
    verdict: str
    panel: dict | None = None  # the panel's figures (output.panel_figures) and its file, where a panel was asked for

    def to_json(self) -> dict:
        found = {"spec": self.spec, "sample_rows": self.sample_rows, "labelled_rows": self.labelled_rows,
                 "models": [model.to_json() for model in self.models], "verdict": self.verdict}
        if self.panel is not None:  # the key only with a panel: other comparisons read as they did
            found["panel"] = self.panel
        return found


def compare(spec_path: Path, models: Sequence[str | None], options: JobOptions, *, sample: int = DEFAULT_SAMPLE,
            db: Path | None = None, quiet: bool = True, panel: str | None = None, output: Path | None = None,
            force: bool = False) -> Comparison:
    """Run up to `sample` labelled rows of the spec on each model and price the whole job on each. `panel` ("mean"
    or "majority"): also combine the models' answers into the panel's, written to `output` (default: <spec
    stem>.panel.parquet beside the spec; an existing file is replaced only with `force`)."""
    from batchrun.job.execute import submit  # the executor: torch loads here

    db_path = Path(db) if db is not None else default_db_path()
    panel_path = panel_output(spec_path, models, panel, output, force, db_path)
    refuse_one_model_twice(models)
    requests = read_job_spec(spec_path, options).requests
    labelled = [request for request in requests if request.label is not None]
    if not labelled:
        raise SettingRefused(f"{spec_path}: no row has a label; compare judges models on labelled rows (give rows a "
                             "label, or --label-column in corpus mode)")
    chosen = stratified_sample(labelled, sample)
    if panel is not None and all(request.choices is None for request in chosen):
        raise SettingRefused(f"{spec_path}: a panel combines choice rows' probabilities, and the sample has only "
                             "generation rows: give rows choices, or leave out --panel")
    sample_options = replace(options, template=None, id_column=None, label_column=None, keep_columns=None,
                             pair_columns=None, json_schema=None, choices=None, system=None, skip_invalid=False)
    results = []
    for model in models:
        summary = submit(sample_spec(chosen), options=replace(sample_options, model=model), db=db_path,
                         write_output=False, quiet=quiet)
        plan = plan_report(spec_path, [model], options)["candidates"][0]
        results.append(_model_result(model, summary.job_id, db_path, plan))
    found = Comparison(str(spec_path), len(chosen), len(labelled), results, verdict(results))
    if panel is not None:
        found.panel = _panel(panel, results, db_path, panel_path, force)
    return found


def panel_output(spec_path: Path, models: Sequence[str | None], panel: str | None, output: Path | None,
                 force: bool, db: Path) -> Path | None:
    """Where the panel's answers go, checked before any row runs: the method known, enough models, and a file that
    can be written there (an existing one only with force). None without a panel."""
    if panel is None:
        if output is not None:
            raise SettingRefused(f"--output {output} names the panel's answers file: give --panel "
                                 f"{'|'.join(PANEL_METHODS)} with it")
        if len(models) < 2:
            raise SettingRefused("compare needs at least two models (--model A --model B), or --panel with one")
        return None
    if panel not in PANEL_METHODS:
        raise SettingRefused(f"panel {panel!r}: use one of {', '.join(PANEL_METHODS)}")
    if not models:
        raise SettingRefused("a panel needs at least one model (--model A)")
    path = Path(output) if output is not None else spec_path.with_name(f"{spec_path.stem}.panel.parquet")
    check_output_writable(path, spec_path, db)
    if path.exists() and not force:
        raise OutputExists(path)
    return path


def _panel(method: str, results: Sequence[ModelResult], db: Path, path: Path, force: bool) -> dict:
    """The panel of the models' sample jobs: its answers written to `path`, its figures returned."""
    store = Store(db)
    try:
        judges = [Judge(result.model, result.job_id, job_answers(store, result.job_id)) for result in results]
    finally:
        store.close()
    combined = panel_of(method, judges)
    if not combined.rows:
        raise SettingRefused("the panel has no row to combine: no choice row was answered by every model (a panel "
                             "combines choice rows; generation rows have no probabilities to combine)")
    return {**panel_figures(combined), "output": str(write_panel(path, combined, force=force))}


def refuse_one_model_twice(models: Sequence[str | None]) -> None:
    """Two spellings of one checkpoint would judge a model against itself, a mistake: refused before any row runs,
    naming both spellings as given."""
    seen: dict[str, str] = {}
    for model in models:
        spelling = "default" if model is None else model
        where = str(checkpoint_location(DEFAULT_REGISTRY_MODEL.name if names_default_model(model) else model))
        if where in seen:
            raise SettingRefused(f"--model {seen[where]} and --model {spelling} are the same model ({where}); "
                                 "compare judges different models against each other: give another --model")
        seen[where] = spelling


def _model_result(model: str | None, job_id: str, db: Path, plan: dict) -> ModelResult:
    store = Store(db)
    try:
        answers = job_answers(store, job_id)
    finally:
        store.close()
    found = quality(answers)
    metric = "accuracy" if found["choice"] else "exact_match"
    judged = found["choice"] or found["generation"]
    own = found.get("choice_uncalibrated")  # present only where calibration changed something
    raw, calibrated = (own, judged) if own else (judged, None)
    chosen = {tuple(item["choices"]): item["values"] for item in found["calibration"]["chosen"]}
    how = found["calibration"]["method"] + (f" ({', '.join(sorted(set(chosen.values())))})" if chosen else "")
    return ModelResult(model_label(model), job_id, metric, raw, calibrated, how, plan.get("passes"),
                       plan.get("eta_seconds") if plan.get("fits") else None)


def verdict(results: Sequence[ModelResult]) -> str:
    """One sentence per runner-up: how much more often the best model is right, for how much of the wait, and
    whether the difference is established (the 95% intervals do not overlap)."""
    if len(results) < 2:  # a panel of one: no runner-up
        return ""
    ranked = sorted(results, key=lambda result: result.judged["rate"], reverse=True)
    best = ranked[0]
    return " ".join(_against(best, other) for other in ranked[1:])


def _against(best: ModelResult, other: ModelResult) -> str:
    a, b = best.judged, other.judged
    measure = "accurate" if best.metric == "accuracy" else "often exactly right"
    rates = f"{a['rate']:.0%} vs {b['rate']:.0%} on {a['labelled']} labelled rows"
    points = round(100 * (a["rate"] - b["rate"]))
    if points == 0:
        head = f"{best.model} and {other.model} are as {measure} ({rates})"
    else:
        head = f"{best.model} is {points} points more {measure} ({rates})"
    wait = _wait(best, other)
    if points and a["interval"][0] <= b["interval"][1]:
        return (f"{head}, but the difference is not established: the 95% intervals overlap "
                f"({_interval(a)} and {_interval(b)}); label more rows to tell them apart{wait}.")
    return f"{head}{wait}."


def _wait(best: ModelResult, other: ModelResult) -> str:
    if not (best.eta_seconds and other.eta_seconds):
        return "" if best.eta_seconds or other.eta_seconds else "; neither plan fits this machine"
    ratio = best.eta_seconds / other.eta_seconds
    times = f"{format_duration(best.eta_seconds)} instead of {format_duration(other.eta_seconds)}"
    if 0.9 <= ratio <= 1.1:  # plans are good to 20-30%: closer than this is the same wait
        return f" for about the same wait: {times}"
    if ratio > 1:
        return f" for {ratio:.1f}x the wait: {times}"
    return f" and {1 / ratio:.1f}x faster: {times}"


def _interval(metrics: dict) -> str:
    low, high = metrics["interval"]
    return f"{low:.0%}-{high:.0%}"


def describe(found: dict) -> list[str]:
    """A comparison (as `to_json` gives it) as terminal lines: one per model, then the verdict."""
    lines = [f"{found['sample_rows']} of {found['labelled_rows']} labelled rows of {found['spec']}, "
             "stratified by label, on each model; the whole job priced by its plan:"]
    for result in found["models"]:
        raw = result["raw"]
        line = f"  {result['model']}: {result['metric'].replace('_', ' ')} {raw['rate']:.1%} ({_interval(raw)}) raw"
        if result["calibrated"]:
            line += f", {result['calibrated']['rate']:.1%} ({_interval(result['calibrated'])}) calibrated " \
                    f"[{result['calibration']}]"
        passes = f"{result['passes']} pass{'' if result['passes'] == 1 else 'es'}"
        lines.append(line + f"; whole job: {passes}, {result['eta_human'] or 'does not fit'}")
    lines += [found["verdict"]] if found["verdict"] else []
    if found.get("panel"):
        lines += describe_panel(found["panel"]) + [f"panel's answers: {found['panel']['output']}"]
    return lines
