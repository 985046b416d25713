"""How right the answers are, over the rows that carry a gold label: accuracy (choice rows) or exact match
(generation rows) with a 95% Wilson interval, per-class precision and recall, and the confusion counts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson_interval(successes: int, total: int, z: float = Z_95) -> tuple[float, float] | None:
    """The Wilson score interval for a proportion: unlike the normal approximation it stays inside [0, 1] and is
    honest at 0/n and n/n, which small labelled samples hit often. None without any trial."""
    if total <= 0:
        return None
    rate = successes / total
    z2 = z * z
    centre = (rate + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(rate * (1 - rate) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    # At 0/n and n/n the bound equals the rate, but rounding lands it a hair beyond (2.8e-17 above 0 at 0/12): the
    # interval always holds its rate, so error bars drawn from it are never negative.
    return min(rate, max(0.0, centre - half)), max(rate, min(1.0, centre + half))


def same_text(answer: str | None, label: str) -> bool:
    """A generated answer matches its label after trimming and case-folding ("Paris." is not "paris")."""
    return answer is not None and answer.strip().casefold() == label.strip().casefold()


@dataclass
class LabelMetrics:
    """Over the labelled rows that were answered (an errored row has no answer to judge)."""

    kind: str  # "accuracy" (choice rows) or "exact_match" (generation rows)
    labelled: int
    correct: int
    rate: float | None
    interval: tuple[float, float] | None
    per_class: dict[str, dict]  # label -> {"precision", "recall", "support"}; choice rows only
    confusion: dict[str, dict[str, int]]  # label -> answer -> count; choice rows only

    def to_json(self) -> dict:
        found = asdict(self)
        found["interval"] = list(self.interval) if self.interval else None
        return found

    def describe(self) -> str:
        """'accuracy 56/60 = 93.3% (95% CI 84.1-97.4%)'."""
        name = "accuracy" if self.kind == "accuracy" else "exact match"
        if not self.labelled:
            return f"{name}: no labelled row answered"
        low, high = self.interval
        return f"{name} {self.correct}/{self.labelled} = {self.rate:.1%} (95% CI {low:.1%}-{high:.1%})"


def label_metrics(labels: Sequence[str], answers: Sequence[str], kind: str = "accuracy") -> LabelMetrics:
    """Metrics of answered labelled rows: labels[i] is the gold answer of the row answered answers[i]."""
    if kind == "exact_match":
        correct = sum(same_text(answer, label) for label, answer in zip(labels, answers))
        return LabelMetrics(kind, len(labels), correct, _rate(correct, len(labels)),
                            wilson_interval(correct, len(labels)), {}, {})
    confusion: dict[str, dict[str, int]] = {}
    for label, answer in zip(labels, answers):
        row = confusion.setdefault(label, {})
        row[answer] = row.get(answer, 0) + 1
    correct = sum(row.get(label, 0) for label, row in confusion.items())
    return LabelMetrics(kind, len(labels), correct, _rate(correct, len(labels)),
                        wilson_interval(correct, len(labels)), per_class(confusion), confusion)


def per_class(confusion: dict[str, dict[str, int]]) -> dict[str, dict]:
    """Precision (of the rows answered c, how many are c) and recall (of the rows labelled c, how many were answered
    c) for every class seen as a label or an answer; None where nothing was counted."""
    classes = sorted(set(confusion) | {answer for row in confusion.values() for answer in row})
    found = {}
    for name in classes:
        hits = confusion.get(name, {}).get(name, 0)
        support = sum(confusion.get(name, {}).values())
        answered = sum(row.get(name, 0) for row in confusion.values())
        found[name] = {"precision": _rate(hits, answered), "recall": _rate(hits, support), "support": support}
    return found


def macro_f1(metrics: LabelMetrics) -> float | None:
    """The mean over labelled classes of F1 (a class never predicted or never right counts 0): what accuracy hides
    on an imbalanced corpus, where answering the majority class everywhere scores high."""
    scores = []
    for name, found in metrics.per_class.items():
        if not found["support"]:
            continue
        precision, recall = found["precision"] or 0.0, found["recall"] or 0.0
        scores.append(0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall))
    return sum(scores) / len(scores) if scores else None


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None
