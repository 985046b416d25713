"""Agreement between answers and labels beyond accuracy: Cohen's kappa (agreement corrected for chance), its
quadratic-weighted form for ordered choices, Spearman and Kendall (tau-b) rank correlations and the mean absolute
error between a numeric score and numeric labels, each with a seeded percentile bootstrap 95% interval.

Every figure is computed from per-row weights: the point estimate weighs each row 1, a bootstrap resample weighs it
by the number of times it was drawn. One piece of code computes both, and a batch of resamples is one numpy
computation rather than a loop over resamples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

RESAMPLES = 1000  # bootstrap resamples behind each interval
SEED = 66  # fixed, so the same rows give the same intervals on every run
BATCH_CELLS = 1 << 19  # elements of one batch of resamples' weights: bounds the memory of the temporaries beside them


@dataclass(frozen=True)
class Estimate:
    """A figure over `rows` rows, with its percentile bootstrap 95% interval (None without resamples, or where no
    resample defines the figure)."""

    value: float
    interval: tuple[float, float] | None
    rows: int

    def to_json(self) -> dict:
        return {"value": self.value, "interval": list(self.interval) if self.interval else None, "rows": self.rows}


Statistic = Callable[[np.ndarray], np.ndarray]  # weights (resamples, rows) -> the figure per resample


def bootstrap(statistic: Statistic, rows: int, resamples: int = RESAMPLES, seed: int = SEED) -> Estimate | None:
    """The statistic at unit weights, and the 2.5th and 97.5th percentiles of its value over `resamples` draws of
    `rows` rows with replacement. A resample where the figure is undefined (a kappa whose resample shows a single
    class) is left out of the percentiles. None where the figure itself is undefined."""
    if rows < 1:
        return None
    value = float(statistic(np.ones((1, rows)))[0])
    if not math.isfinite(value):
        return None
    if resamples < 1:
        return Estimate(value, None, rows)
    rng = np.random.default_rng(seed)
    per_batch = max(1, BATCH_CELLS // rows)
    found = []
    for start in range(0, resamples, per_batch):
        size = min(per_batch, resamples - start)
        drawn = rng.integers(0, rows, size=(size, rows)) + rows * np.arange(size)[:, None]
        weights = np.bincount(drawn.ravel(), minlength=size * rows).reshape(size, rows).astype(float)
        found.append(statistic(weights))
    values = np.concatenate(found)
    values = values[np.isfinite(values)]
    if not len(values):
        return Estimate(value, None, rows)
    low, high = np.percentile(values, [2.5, 97.5])
    return Estimate(value, (float(low), float(high)), rows)


def cohen_kappa(labels: Sequence[str], answers: Sequence[str], scale: Sequence[str] | None = None,
                weighted: bool = False, resamples: int = RESAMPLES, seed: int = SEED) -> Estimate | None:
    """Cohen's kappa between labels and answers: 1 - sum(w * observed) / sum(w * expected by chance), the expected
    table being the product of the two marginals. Unweighted, w is 1 off the diagonal; weighted, w = (i - j)^2 over
    the positions i, j of the two values on `scale` (the ordered categories: every label and answer must be on it).
    None where undefined (both sides one and the same class)."""
    classes = list(scale) if scale is not None else sorted(set(labels) | set(answers))
    position = {name: i for i, name in enumerate(classes)}
    missing = (set(labels) | set(answers)) - set(position)
    if missing:
        raise ValueError(f"values not on the scale: {sorted(missing)}")
    count = len(classes)
    index = np.arange(count)
    penalty = (index[:, None] - index[None, :]) ** 2.0 if weighted else 1.0 - np.eye(count)
    cells = np.array([position[label] * count + position[answer] for label, answer in zip(labels, answers)])
    present, where = np.unique(cells, return_inverse=True)
    order = np.argsort(where, kind="stable")
    starts = np.searchsorted(where[order], np.arange(len(present)))
    label_of, answer_of = np.eye(count)[present // count], np.eye(count)[present % count]

    def kappa(weights: np.ndarray) -> np.ndarray:
        observed = np.add.reduceat(weights[:, order], starts, axis=1)  # (resamples, cells present)
        by_label, by_answer = observed @ label_of, observed @ answer_of
        total = observed.sum(axis=1)
        disagreed = observed @ penalty[present // count, present % count]
        expected = np.einsum("bi,ij,bj->b", by_label, penalty, by_answer) / total
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(expected > 0, 1.0 - disagreed / expected, np.nan)

    return bootstrap(kappa, len(cells), resamples, seed)


def mean_absolute_error(scores: Sequence[float], labels: Sequence[float], resamples: int = RESAMPLES,
                        seed: int = SEED) -> Estimate | None:
    """The mean of |score - label|, in the labels' units."""
    gaps = np.abs(np.asarray(scores, dtype=float) - np.asarray(labels, dtype=float))
    return bootstrap(lambda weights: weights @ gaps / weights.sum(axis=1), len(gaps), resamples, seed)


def spearman(scores: Sequence[float], labels: Sequence[float], resamples: int = RESAMPLES,
             seed: int = SEED) -> Estimate | None:
    """Spearman's rho: the Pearson correlation of the two sides' ranks, tied values sharing their mean rank. None
    where either side is constant."""
    if len(scores) < 2:
        return None
    x, y = _ranker(np.asarray(scores, dtype=float)), _ranker(np.asarray(labels, dtype=float))

    def rho(weights: np.ndarray) -> np.ndarray:
        total = weights.sum(axis=1, keepdims=True)
        (rank_x, varied_x), (rank_y, varied_y) = x(weights), y(weights)
        centred_x = rank_x - (weights * rank_x).sum(axis=1, keepdims=True) / total
        centred_y = rank_y - (weights * rank_y).sum(axis=1, keepdims=True) / total
        spread = np.sqrt((weights * centred_x ** 2).sum(axis=1) * (weights * centred_y ** 2).sum(axis=1))
        # a constant side is told by its values, not by a spread that rounding leaves a hair above zero
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(varied_x & varied_y, (weights * centred_x * centred_y).sum(axis=1) / spread, np.nan)

    return bootstrap(rho, len(scores), resamples, seed)


def _ranker(values: np.ndarray) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """weights -> each row's mean rank in the weighted sample, and whether the sample holds two values or more. A
    row drawn k times is k tied copies, so its rank is the weight of the rows below its value plus half its value's
    weight (plus one half)."""
    group, order, starts = _tie_groups(values)

    def ranks(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        of_value = np.add.reduceat(weights[:, order], starts, axis=1)
        below = np.cumsum(of_value, axis=1) - of_value
        return (below + (of_value + 1) / 2)[:, group], (of_value > 0).sum(axis=1) >= 2

    return ranks


def _tie_groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's run of equal values (numbered in order of value), the rows in that order, and where each run
    begins in it."""
    _, group = np.unique(values, return_inverse=True)
    order = np.argsort(group, kind="stable")
    return group, order, np.searchsorted(group[order], np.arange(group.max() + 1))


def kendall_tau(scores: Sequence[float], labels: Sequence[float], resamples: int = RESAMPLES,
                seed: int = SEED) -> Estimate | None:
    """Kendall's tau-b: (concordant - discordant pairs) / sqrt((pairs - pairs tied on one side) (pairs - pairs tied
    on the other)). None where either side is constant."""
    if len(scores) < 2:
        return None
    x, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float)
    if len(np.unique(x)) < len(np.unique(y)):  # symmetric: count by the side with fewer distinct values
        x, y = y, x
    _, level = np.unique(y, return_inverse=True)
    # each level's rows by x, and where every row of a higher level falls among them (before its ties, after them)
    members = [np.flatnonzero(level == k)[np.argsort(x[level == k], kind="stable")] for k in range(level.max() + 1)]
    places = {(low, high): (np.searchsorted(x[members[low]], x[members[high]], "left"),
                            np.searchsorted(x[members[low]], x[members[high]], "right"))
              for high in range(len(members)) for low in range(high)}
    x_tied = _tie_groups(x)[1:]

    def tau(weights: np.ndarray) -> np.ndarray:
        per = max(1, BATCH_CELLS // max(1, len(x)))
        return np.concatenate([_tau_b(weights[i:i + per], members, places, x_tied)
                               for i in range(0, len(weights), per)])

    return bootstrap(tau, len(x), resamples, seed)


def _tau_b(weights: np.ndarray, members: list[np.ndarray], places: dict, x_tied: tuple) -> np.ndarray:
    """tau-b of weighted rows, y given as levels. A pair of rows of two levels counts from the higher level's row:
    the weight of the lower level's rows at a smaller x agrees with it, at a larger x disagrees; pairs of equal x or
    equal level count neither way."""
    count = len(weights)
    before = [np.concatenate([np.zeros((count, 1)), np.cumsum(weights[:, rows], axis=1)], axis=1) for rows in members]
    signed = np.zeros(count)
    for (low, high), (left, right) in places.items():
        # smaller x less larger x: C(< x) - (W - C(<= x))
        net = before[low][:, left] + before[low][:, right] - before[low][:, -1:]
        signed += (weights[:, members[high]] * net).sum(axis=1)
    total = weights.sum(axis=1)
    pairs = total * (total - 1) / 2
    order, starts = x_tied
    of_x = np.add.reduceat(weights[:, order], starts, axis=1)
    tied_x = (of_x * (of_x - 1) / 2).sum(axis=1)
    of_level = np.stack([cumulative[:, -1] for cumulative in before], axis=1)
    tied_y = (of_level * (of_level - 1) / 2).sum(axis=1)
    denominator = np.sqrt((pairs - tied_x) * (pairs - tied_y))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, signed / denominator, np.nan)
