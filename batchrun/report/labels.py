"""Section 3, the answers against labels: accuracy with its 95% interval, the confusion matrix, how well confidence
predicts correctness (the reliability diagram), per-class precision and recall, and the agreement figures
(report.agreement).

The metrics come from the output's job_quality (its contract: "choice" and "generation" each None or a dict with
labelled, correct, rate, interval, per_class, confusion; "agreement" None or quality.agreement's dict); the
reliability diagram is binned here from the rows' own confidence and correctness.
"""
from __future__ import annotations

from batchrun.report import charts
from batchrun.report.agreement import agreement_parts
from batchrun.report.answers import PromptLookup
from batchrun.report.data import CHOICE, GENERATION, ReportData, Rows
from batchrun.report.page import Section, figure, heading, note, percent, table

MOST_CLASSES = 20  # rows and columns of a confusion matrix; the rest are one "(other)" line
PER_CLASS_SHOWN = 30
RELIABILITY_BINS = 10
OTHER = "(other)"


def labels_section(data: ReportData, prompts: PromptLookup | None = None) -> Section:
    quality = data.quality or {}
    kinds = [(CHOICE, quality.get(CHOICE)), (GENERATION, quality.get(GENERATION))]
    labelled = [(kind, metrics) for kind, metrics in kinds if metrics and metrics.get("labelled")]
    if not labelled and (quality.get("pairs") or {}).get("accuracy"):
        return Section("labels", "Against labels", note("The labelled rows are pair rows: their verdicts are scored "
                                                        "against their labels under Pairs judged in both orders."))
    if not labelled and quality.get("fields"):
        return Section("labels", "Against labels", note("The labelled rows are structured rows: their JSON labels are "
                                                        "scored field by field under Structured answers."))
    if not labelled:
        return Section("labels", "Against labels",
                       note("No answered row has a label, so there is nothing to score the answers against (give rows "
                            "a `label` field to see accuracy here)."))
    parts = []
    for kind, metrics in labelled:
        parts.append(heading("Choice rows" if kind == CHOICE else "Generation rows (exact match)"))
        parts.append(_accuracy_line(metrics))
        own = quality.get("choice_uncalibrated") if kind == CHOICE else None
        if own and own.get("labelled"):
            parts.append(note("Calibrated answers above; the model's own answers: " + _accuracy_text(own) + "."))
        if kind == CHOICE:
            parts += _choice_parts(data.rows, metrics)
            parts += agreement_parts(quality.get("agreement"), prompts)
    if quality.get("labelled_errored"):
        parts.append(note(f"{quality['labelled_errored']:,} labelled rows errored: they have no answer to judge and "
                          "are counted nowhere above."))
    return Section("labels", "Against labels", "\n".join(parts))


def _accuracy_line(metrics: dict) -> str:
    return note(_accuracy_text(metrics) + ".", "accuracy")


def _accuracy_text(metrics: dict) -> str:
    low, high = metrics.get("interval") or (None, None)
    interval = f" (95% interval {percent(low)} to {percent(high)})" if low is not None else ""
    return (f"{percent(metrics.get('rate'))} correct{interval}: {metrics['correct']:,} of {metrics['labelled']:,} "
            "labelled rows answered")


def _choice_parts(rows: Rows, metrics: dict) -> list[str]:
    parts = []
    confusion = metrics.get("confusion") or {}
    if confusion:
        labels, answers, counts = _folded_confusion(confusion)
        shares = [[count / (sum(line) or 1) for count in line] for line in counts]
        parts.append(figure("confusion", charts.heatmap(
            "confusion", counts, shares, row_labels=labels, column_labels=answers, title="Confusion matrix",
            xlabel="answer", ylabel="label"), "Rows by label (down) and answer (across), coloured by the share of "
                                              "the label's rows; the diagonal is correct."))
    curves = _reliability_curves(rows)
    if curves:
        errors = ", ".join(f"{name} {_calibration_error(*curve):.3f}" for name, curve in curves.items())
        parts.append(figure("reliability", charts.reliability("reliability", curves, title="Reliability"),
                            f"Labelled choice rows binned by confidence: a well calibrated model lies on the "
                            f"diagonal. Expected calibration error: {errors}."))
    per_class = metrics.get("per_class") or {}
    if per_class:
        ranked = sorted(per_class.items(), key=lambda kv: (-(kv[1].get("support") or 0), str(kv[0])))
        lines = [[name, values.get("precision"), values.get("recall"), values.get("support")]
                 for name, values in ranked[:PER_CLASS_SHOWN]]
        parts += [heading("Per class"),
                  table(["class", "precision", "recall", "labelled rows"], lines, numeric=(1, 2, 3),
                        left_out=len(ranked) - len(lines), what="classes", name="per-class")]
    return parts


def _folded_confusion(confusion: dict[str, dict[str, int]]) -> tuple[list[str], list[str], list[list[int]]]:
    """The most frequent labels and answers (labels' own names first, so the diagonal is the correct answers), the
    rest summed into "(other)"."""
    support = {label: sum(answers.values()) for label, answers in confusion.items()}
    labels = sorted(support, key=lambda label: (-support[label], str(label)))
    answered: dict[str, int] = {}
    for answers in confusion.values():
        for answer, count in answers.items():
            answered[answer] = answered.get(answer, 0) + count
    kept_labels = labels[:MOST_CLASSES]
    columns = [label for label in kept_labels if label in answered]
    columns += sorted((a for a in answered if a not in columns), key=lambda a: (-answered[a], str(a)))
    kept_columns = columns[:MOST_CLASSES]
    fold_rows, fold_columns = len(labels) > len(kept_labels), len(columns) > len(kept_columns)
    row_names = kept_labels + ([OTHER] if fold_rows else [])
    column_names = kept_columns + ([OTHER] if fold_columns else [])
    counts = [[0] * len(column_names) for _ in row_names]
    for label, answers in confusion.items():
        row = kept_labels.index(label) if label in kept_labels else len(row_names) - 1
        for answer, count in answers.items():
            column = kept_columns.index(answer) if answer in kept_columns else len(column_names) - 1
            counts[row][column] += count
    return [str(n) for n in row_names], [str(n) for n in column_names], counts


def _reliability_curves(rows: Rows) -> dict[str, tuple[list[float], list[float], list[int]]]:
    """Per curve (raw, and calibrated where rows have calibrated probabilities): each non-empty confidence bin's
    mean confidence, observed accuracy and row count."""
    if rows.labels is None:
        return {}
    raw, calibrated = [], []
    for i in rows.of_kind(CHOICE):
        label = rows.labels[i]
        if label is None:
            continue
        if rows.probs[i]:
            raw.append((max(rows.probs[i].values()), rows.own_answer(i) == label))
        if rows.calibrated and rows.calibrated[i]:
            calibrated.append((max(rows.calibrated[i].values()), rows.answers[i] == label))
    curves = {name: _binned(pairs) for name, pairs in (("raw", raw), ("calibrated", calibrated)) if pairs}
    return curves


def _binned(pairs: list[tuple[float, bool]]) -> tuple[list[float], list[float], list[int]]:
    sums = [[0.0, 0, 0] for _ in range(RELIABILITY_BINS)]  # confidence sum, correct, rows
    for confidence, correct in pairs:
        slot = sums[min(int(confidence * RELIABILITY_BINS), RELIABILITY_BINS - 1)]
        slot[0] += confidence
        slot[1] += correct
        slot[2] += 1
    filled = [s for s in sums if s[2]]
    return [s[0] / s[2] for s in filled], [s[1] / s[2] for s in filled], [s[2] for s in filled]


def _calibration_error(confidence: list[float], accuracy: list[float], rows: list[int]) -> float:
    """Expected calibration error: the rows-weighted mean gap between confidence and accuracy over the bins."""
    total = sum(rows) or 1
    return sum(n * abs(c - a) for c, a, n in zip(confidence, accuracy, rows)) / total
