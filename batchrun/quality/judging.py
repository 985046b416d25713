"""The agreement figures of a job's choice rows, from the same answers accuracy judges: kappa, weighted kappa where
the choices are ordered, the rank correlations and mean absolute error of the score against numeric labels, the
most confident disagreements, and, where the labelled rows are a sample of the job, each verdict's share corrected
for the judge's errors. What each is, and when it is shown: docs/calibration.md#agreement-beyond-accuracy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from batchrun.quality.agreement import (RESAMPLES, SEED, Estimate, cohen_kappa, kendall_tau, mean_absolute_error,
                                        spearman)
from batchrun.quality.prevalence import corrected_share

DISAGREEMENTS_KEPT = 10


@dataclass(frozen=True)
class JudgedRow:
    """An answered choice row: `probs` are those its answer was picked by (calibrated where the job calibrates), and
    `score` their probability-weighted mean where the choices are numbers."""

    id: object
    answer: str
    probs: Mapping[str, float]
    score: float | None = None
    label: str | None = None


def number(text: str) -> float | None:
    """The value of a choice or label that reads as a finite number, else None."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def ordered_scale(rows: Sequence[JudgedRow]) -> list[str] | None:
    """The ordered categories where every labelled row's choices and label are numbers: all of them, sorted by value
    (a category's place on that scale is what weighted kappa weighs). None where any is not a number."""
    values: set[str] = set()
    for row in rows:
        values.update(row.probs)
        values.add(row.label)
    if not values or any(number(value) is None for value in values):
        return None
    return sorted(values, key=lambda value: (number(value), value))


def agreement_figures(rows: Sequence[JudgedRow], resamples: int = RESAMPLES, seed: int = SEED) -> dict | None:
    """The figures as `status --json`, the summary and the report show them; None without a labelled row. Each
    figure is None where it is undefined, or where no row has what it needs."""
    labelled = [row for row in rows if row.label is not None]
    if not labelled:
        return None
    labels, answers = [row.label for row in labelled], [row.answer for row in labelled]
    scale = ordered_scale(labelled)
    numeric = [(row.score, number(row.label)) for row in labelled
               if row.score is not None and number(row.label) is not None]
    scores, values = [pair[0] for pair in numeric], [pair[1] for pair in numeric]

    def on_numbers(figure):
        return figure(scores, values, resamples, seed) if len(numeric) >= 2 else None

    figures = {"kappa": cohen_kappa(labels, answers, resamples=resamples, seed=seed),
               "weighted_kappa": cohen_kappa(labels, answers, scale, True, resamples, seed) if scale else None,
               "spearman": on_numbers(spearman), "kendall": on_numbers(kendall_tau),
               "mae": on_numbers(mean_absolute_error)}
    found = {"rows": len(labelled), "resamples": resamples, "seed": seed, "scale": scale,
             **{name: _json(estimate) for name, estimate in figures.items()},
             # a judge that gives one answer to every row agrees by chance alone: kappa 0 in every resample
             "single_answer": answers[0] if len(labelled) > 1 and len(set(answers)) == 1 else None}
    found.update(_disagreements(labelled))
    found["shares"] = _shares(rows, labelled, resamples, seed)
    return found


def _json(estimate: Estimate | None) -> dict | None:
    return estimate.to_json() if estimate is not None else None


def _disagreements(labelled: Sequence[JudgedRow]) -> dict:
    """The labelled rows answered otherwise, the surest answers first: where the judge is most wrong, or the label
    is."""
    wrong = [row for row in labelled if row.answer != row.label]
    wrong.sort(key=lambda row: -row.probs.get(row.answer, 0.0))
    return {"disagreements": len(wrong),
            "most_confident_disagreements": [{"id": row.id, "label": row.label, "answer": row.answer,
                                              "confidence": row.probs.get(row.answer)}
                                             for row in wrong[:DISAGREEMENTS_KEPT]]}


def _shares(rows: Sequence[JudgedRow], labelled: Sequence[JudgedRow], resamples: int, seed: int) -> list[dict]:
    """Each choice offered (one against the rest), where some answered rows carry no label: labelled rows that
    are every row measure the verdicts' shares themselves."""
    if len(labelled) == len(rows):
        return []
    verdicts = list(dict.fromkeys(choice for row in rows for choice in row.probs))
    answers = np.array([row.answer for row in rows], dtype=object)
    labels = np.array([row.label for row in labelled], dtype=object)
    labelled_answers = np.array([row.answer for row in labelled], dtype=object)
    return [corrected_share(verdict, answers, labels, labelled_answers, resamples, seed).to_json()
            for verdict in verdicts]


def describe_agreement(found: dict) -> list[str]:
    """At most two terminal lines: the agreement figures with their intervals, and the corrected shares that could
    be computed. 'agreement (95% CI): kappa 0.62 (0.48 to 0.75), weighted 0.81 (0.70 to 0.88), ...'."""
    names = (("kappa", "kappa"), ("weighted_kappa", "weighted"), ("spearman", "Spearman"), ("kendall", "Kendall"),
             ("mae", "MAE"))
    shown = [f"{name} {_figure(found[key])}" for key, name in names if found.get(key)]
    lines = ["agreement (95% CI): " + ", ".join(shown)] if shown else []
    if lines and found.get("single_answer") is not None:
        lines[0] += (f"; every labelled row was answered {found['single_answer']!r}, so kappa is 0 whatever the "
                     "labels and its interval says nothing of the judge")
    shares = [share for share in found.get("shares") or [] if share["corrected"] is not None]
    if shares:
        lines.append("share corrected for the answers' errors (Rogan-Gladen, 95% CI): " + "; ".join(
            f"{share['verdict']} {share['corrected']:.1%} ({_span(share['interval'], '.1%')}, raw {share['raw']:.1%})"
            for share in shares))
    return lines


def _figure(estimate: dict) -> str:
    return f"{estimate['value']:.2f}" + (f" ({_span(estimate['interval'], '.2f')})" if estimate["interval"] else "")


def _span(interval, spec: str) -> str:
    return "no interval" if not interval else f"{interval[0]:{spec}} to {interval[1]:{spec}}"
