"""A job's rows as its output shows them: the model's results, calibrated where the job calibrates, judged against
the labels the rows carry, with the values they carry through.

The calibrated view is computed from the stored raw probabilities every time answers are written, never stored:
batch calibration's prior is over all the job's rows that share a choice set, so an export made mid-run uses the
rows finished so far (and says so), and a resumed job ends with the answers an uninterrupted one would give.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from batchrun.output.pairs import PairVerdict, describe_pairs, fold_pairs, folded_result, pair_statistics
from batchrun.quality import (INCOMPLETE, Calibration, ChoiceRow, JudgedRow, LabelMetrics, SchemaCheck,
                              agreement_figures, calibrate, check_answer, check_regex_answer, describe_agreement,
                              enum_pointers, field_accuracy, label_metrics, mean_probs, numeric_score, same_text,
                              wilson_interval)
from batchrun.store import RowResult, Store


FORCED_HARDEST = 5  # the structured rows the summary names, where the grammar overrode the model most


@dataclass
class OutputRow:
    """One row of the output: `result` as the model computed it, and the answer the output gives."""

    result: RowResult
    answer: str | None
    score: float | None
    logprob: float | None
    output_tokens: int | None
    calibrated_probs: dict[str, float] | None = None
    correct: bool | None = None  # None: no label, or no answer to judge
    pair: PairVerdict | None = None  # a pair row's two orders folded into one (output/pairs.py)
    check: SchemaCheck | None = None  # a structured row's answer against its schema or pattern


@dataclass
class JobAnswers:
    rows: list[OutputRow]
    calibration: Calibration
    rows_total: int  # the job's rows, finished or not
    notes: list[str] = field(default_factory=list)


def output_rows(results: Sequence[RowResult], calibration: Calibration | None = None) -> list[OutputRow]:
    """Each result with the answer the output gives: the calibrated choice where there is one, else the model's."""
    found = []
    for result in sorted(results, key=lambda r: r.idx):
        calibrated = calibration.probs.get(result.idx) if calibration is not None else None
        row = _calibrated_row(result, calibrated) if calibrated is not None else OutputRow(
            result, result.answer, result.score, result.logprob, result.output_tokens)
        row = replace(row, check=structure_check(result))
        found.append(replace(row, correct=_judged(row)))
    return fold_pairs(found, _pair_row)


def structure_check(result: RowResult) -> SchemaCheck | None:
    """A structured row's answer checked against its JSON Schema by the validator, not the grammar that decoded it
    (or against its pattern); a JSON row cut by its token limit is incomplete, not checked."""
    if result.structure is None or result.failed or result.answer is None:
        return None
    (kind, source), = result.structure.items()
    if kind == "regex":
        return check_regex_answer(result.answer, source)
    if result.finish_reason == "length":
        return SchemaCheck(None, False, (f"/: {INCOMPLETE}: the token limit cut the answer before its JSON closed",))
    return check_answer(result.answer, json.dumps(source, separators=(",", ":"), ensure_ascii=False))


def field_figures(rows: Sequence[OutputRow]) -> dict | None:
    """JSON-labelled rows judged whole (exact match of the parsed value) and field by field (quality.fields); a row
    with no JSON (cut, or not parsed) gets every field wrong."""
    if not rows:
        return None
    enums: set[str] = set()
    for schema in {json.dumps(row.result.structure["json_schema"]) for row in rows}:
        enums |= enum_pointers(json.loads(schema))
    pairs = [(json.loads(row.check.json) if row.check.json is not None else None, json.loads(row.result.label))
             for row in rows]
    correct = sum(bool(row.correct) for row in rows)
    whole = LabelMetrics("exact_match", len(rows), correct, correct / len(rows), wilson_interval(correct, len(rows)),
                         {}, {})
    return {"whole": whole.to_json(), "per_field": field_accuracy(pairs, enums)}


def output_error(row: OutputRow) -> str | None:
    """The error the output shows: the row's own, or json_incomplete for a JSON row its token limit cut."""
    if row.result.error is None and row.check is not None and row.result.finish_reason == "length" \
            and "json_schema" in (row.result.structure or {}):
        return INCOMPLETE
    return row.result.error


def structured_counts(rows: Sequence[OutputRow]) -> dict | None:
    """How many structured rows validate, fail their schema, or were cut by the limit (None: the job has none)."""
    checked = [row for row in rows if row.check is not None]
    if not checked:
        return None
    cut = sum(output_error(row) == INCOMPLETE for row in checked)
    valid = sum(row.check.valid for row in checked)
    overridden = sorted((row for row in checked if (row.result.grammar or {}).get("overrides")),
                        key=lambda row: (-row.result.grammar["overrides"], row.result.idx))
    hardest = [{"id": row.result.id, "overrides": row.result.grammar["overrides"],
                "lowest_logprob": row.result.grammar["lowest_logprob"]} for row in overridden[:FORCED_HARDEST]]
    return {"rows": len(checked), "valid": valid, "invalid": len(checked) - valid - cut, "cut": cut,
            "forced_hardest": hardest}


def _pair_row(first: OutputRow, second: OutputRow, verdict: PairVerdict) -> OutputRow:
    """A pair row as the output shows it: its verdict is the answer, judged against the pair's label."""
    result = folded_result(first.result, second.result)
    correct = None if result.label is None or verdict.verdict is None else verdict.verdict == result.label
    return OutputRow(result, verdict.verdict, None, None, None, correct=correct, pair=verdict)


def _calibrated_row(result: RowResult, calibrated: dict[str, float]) -> OutputRow:
    """The most probable calibrated choice (the first of a tie, as the model's own pick is), its score and its
    tokens' log-probability: log p(c) less the row's normaliser, which the model's pick gives back exactly."""
    answer = max(calibrated, key=calibrated.__getitem__)
    raw = result.choice_probs
    logprob = None
    if result.logprob is not None and raw.get(result.answer, 0) > 0 and raw.get(answer, 0) > 0:
        logprob = math.log(raw[answer]) + result.logprob - math.log(raw[result.answer])
    tokens = (result.choice_tokens or {}).get(answer, result.output_tokens if answer == result.answer else None)
    return OutputRow(result, answer, numeric_score(calibrated), logprob, tokens, calibrated)


def _judged(row: OutputRow) -> bool | None:
    label = row.result.label
    if label is None or row.result.failed:
        return None
    if row.result.choice_probs is not None:
        return row.answer == label
    if _json_labelled(row):  # the whole value; field by field in quality's "fields"
        return row.check.json is not None and json.loads(row.check.json) == json.loads(label)
    return same_text(row.answer, label)


def _json_labelled(row: OutputRow) -> bool:
    return row.result.label is not None and row.check is not None and "json_schema" in row.result.structure


def job_answers(store: Store, job_id: str) -> JobAnswers:
    """The job's finished rows, calibrated as its settings say."""
    results = store.results(job_id)
    settings = store.job_settings(job_id)
    method = settings.get("calibrate") or "none"
    content_free = None
    if method == "content-free" and settings.get("content_free_job"):
        content_free = content_free_priors(store.results(settings["content_free_job"]))
    choice_rows = [ChoiceRow(r.idx, r.choice_probs, r.label) for r in results
                   if r.choice_probs is not None and not r.failed]
    calibration = calibrate(choice_rows, method, content_free)
    total = store.status(job_id)["rows_total"]
    found = JobAnswers(output_rows(results, calibration), calibration, total, list(calibration.notes))
    if method in ("batch", "labels") and len(results) < total:
        found.notes.append(f"calibration ({method}) from the {len(results)} of {total} rows finished so far; the "
                           "job's final answers use all of them")
    return found


def content_free_priors(results: Sequence[RowResult]) -> dict[tuple[str, ...], dict[str, float]]:
    """The content-free prior of each choice set: the mean of its content-free rows' probabilities."""
    groups: dict[tuple[str, ...], list[dict[str, float]]] = {}
    for result in results:
        if result.choice_probs is not None and not result.failed:
            groups.setdefault(tuple(result.choice_probs), []).append(result.choice_probs)
    return {choices: mean_probs(members) for choices, members in groups.items()}


def quality(answers: JobAnswers) -> dict:
    """Accuracy (choice rows) and exact match (generation rows) over the labelled rows that were answered, the
    model's own accuracy beside the calibrated one, the agreement figures of the choice rows (quality.agreement),
    and the calibration used: what `status`, `--json` and the summary show. A labelled row that errored has no
    answer to judge: it is counted apart."""
    labelled = [row for row in answers.rows if row.result.label is not None and row.pair is None]
    answered = [row for row in labelled if not row.result.failed]
    choice = [row for row in answered if row.result.choice_probs is not None]
    generation = [row for row in answered if row.result.choice_probs is None and not _json_labelled(row)]
    found = {"choice": _metrics(choice, "accuracy"), "generation": _metrics(generation, "exact_match"),
             "agreement": agreement_figures([_judged_row(row) for row in answers.rows if row.pair is None
                                             and row.result.choice_probs is not None and not row.result.failed]),
             "labelled_errored": len(labelled) - len(answered),
             "calibration": answers.calibration.to_json(), "notes": answers.notes}
    structured = structured_counts(answers.rows)
    if structured is not None:  # the key only where the job has structured rows
        found["structured"] = structured
    fields = field_figures([row for row in answered if _json_labelled(row)])
    if fields is not None:
        found["fields"] = fields
    pairs = pair_statistics(answers.rows)
    if pairs is not None:  # the key only where the job has pair rows: other jobs' summaries stay as they are
        found["pairs"] = pairs
    if answers.calibration.probs and choice:  # calibration changed something: the model's own figure beside it
        found["choice_uncalibrated"] = _metrics([replace(row, answer=row.result.answer) for row in choice],
                                                "accuracy")
    return {key: value.to_json() if isinstance(value, LabelMetrics) else value for key, value in found.items()}


def _judged_row(row: OutputRow) -> JudgedRow:
    return JudgedRow(row.result.id, row.answer, row.calibrated_probs or row.result.choice_probs, row.score,
                     row.result.label)


def _metrics(rows: Sequence[OutputRow], kind: str) -> LabelMetrics | None:
    if not rows:
        return None
    return label_metrics([row.result.label for row in rows], [row.answer for row in rows], kind)


def job_quality(store: Store, job_id: str) -> dict:
    return quality(job_answers(store, job_id))


def describe_quality(found: dict) -> list[str]:
    """The quality summary as terminal lines: accuracy with its interval (the model's own beside a calibrated one),
    per-class precision and recall, the confusion counts, the agreement figures and corrected shares, exact match
    for generation rows."""
    lines = []
    choice, method = found.get("choice"), found["calibration"]["method"]
    chosen = sorted({item["values"] for item in found["calibration"].get("chosen", [])})
    if chosen:  # auto: what it took for the job's choice sets
        method += f" ({', '.join(chosen)})"
    if choice:
        line = _rate_text("accuracy", choice)
        own = found.get("choice_uncalibrated")
        if own:
            line += f" with {method} calibration; the model's own answers: {_rate_text('', own).strip()}"
        lines.append(line)
        lines.append("  per class (precision / recall / labelled): " + "; ".join(
            f"{_choice_name(name)} {_share(values['precision'])} / {_share(values['recall'])} / {values['support']}"
            for name, values in choice["per_class"].items()))
        lines.append("  confusion (label: answers): " + "; ".join(
            f"{_choice_name(label)}: "
            + ", ".join(f"{_choice_name(answer)} {count}" for answer, count in answers.items())
            for label, answers in choice["confusion"].items()))
        lines += ["  " + line for line in describe_agreement(found.get("agreement") or {})]
    if found.get("generation"):
        lines.append(_rate_text("exact match", found["generation"]) + " (after trimming and case-folding)")
    if found.get("labelled_errored"):
        lines.append(f"  {found['labelled_errored']} labelled row(s) errored: not judged")
    if found.get("pairs"):
        lines += describe_pairs(found["pairs"])
    if found.get("fields"):
        lines += describe_fields(found["fields"])
    if found.get("structured"):
        counts = found["structured"]
        lines.append(f"structured answers: {counts['valid']} of {counts['rows']} valid against their schema, "
                     f"{counts['invalid']} invalid, {counts['cut']} cut by the token limit (json_incomplete)")
        if counts.get("forced_hardest"):
            lines.append("  forced hardest (the model's top token refused): " + ", ".join(
                f"{row['id']} {row['overrides']}x (lowest logprob {row['lowest_logprob']:.2f})"
                for row in counts["forced_hardest"]))
    return lines


def describe_fields(fields: dict) -> list[str]:
    """Structured answers against their JSON labels: the whole value, then each field (worst first) with the
    confusion counts of enum fields."""
    lines = [_rate_text("structured exact match", fields["whole"]) + " (the whole JSON value)"]
    for pointer, figures in sorted(fields["per_field"].items(), key=lambda item: (item[1]["rate"], item[0])):
        lines.append("  field " + _rate_text(pointer, figures))
        if figures.get("confusion"):
            lines.append("    confusion (label: answers): " + "; ".join(
                f"{label}: " + ", ".join(f"{answer} {count}" for answer, count in answers.items())
                for label, answers in figures["confusion"].items()))
    return lines


def _rate_text(name: str, metrics: dict) -> str:
    low, high = metrics["interval"]
    return (f"{name} {metrics['correct']}/{metrics['labelled']} = {metrics['rate']:.1%} "
            f"(95% CI {low:.1%}-{high:.1%})")


def _choice_name(name: str) -> str:
    """A choice as the summary lines show it: quoted where spaces begin or end it (" positive"), which the lines'
    own spacing would hide, or where it is empty."""
    return repr(name) if not name or name != name.strip() else name


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def describe_calibration(calibration: Calibration) -> list[str]:
    """What was divided out or fitted, per choice set: 'calibrated (batch) over 60 rows: prior positive 0.31, ...'."""
    lines = []
    for choices, used in calibration.rows_used.items():
        method = calibration.chosen.get(choices, calibration.method)
        if method == "labels":
            values = calibration.biases.get(choices)
            what, rows = "biases", f"{used} labelled rows"
        else:
            values = calibration.priors.get(choices)
            what, rows = "prior", f"{used} rows" if method == "batch" else "its content-free inputs"
        if values:
            shown = ", ".join(f"{choice} {value:+.2f}" if what == "biases" else f"{choice} {value:.3f}"
                              for choice, value in values.items())
            how = method if method == calibration.method else f"{calibration.method}: {method}"
            lines.append(f"calibrated ({how}) from {rows}: {what} {shown}")
    return lines
