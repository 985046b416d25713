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
BATCH_CELLS = 1 << 21  # array elements a batch of resamples holds at once (weights, or weights by level)


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
    x, y = _ranker(scores), _ranker(labels)

    def rho(weights: np.ndarray) -> np.ndarray:
        total = weights.sum(axis=1, keepdims=True)
        rank_x, rank_y = x(weights), y(weights)
        centred_x = rank_x - (weights * rank_x).sum(axis=1, keepdims=True) / total
        centred_y = rank_y - (weights * rank_y).sum(axis=1, keepdims=True) / total
        spread = np.sqrt((weights * centred_x ** 2).sum(axis=1) * (weights * centred_y ** 2).sum(axis=1))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(spread > 0, (weights * centred_x * centred_y).sum(axis=1) / spread, np.nan)

    return bootstrap(rho, len(scores), resamples, seed)


def _ranker(values: Sequence[float]) -> Callable[[np.ndarray], np.ndarray]:
    """weights -> each row's mean rank in the weighted sample: a row drawn k times is k tied copies, so its rank is
    the weight of the rows below its value plus half its value's weight (plus one half)."""
    _, group = np.unique(np.asarray(values, dtype=float), return_inverse=True)
    order = np.argsort(group, kind="stable")
    starts = np.searchsorted(group[order], np.arange(group.max() + 1))

    def ranks(weights: np.ndarray) -> np.ndarray:
        of_value = np.add.reduceat(weights[:, order], starts, axis=1)
        below = np.cumsum(of_value, axis=1) - of_value
        return (below + (of_value + 1) / 2)[:, group]

    return ranks


def kendall_tau(scores: Sequence[float], labels: Sequence[float], resamples: int = RESAMPLES,
                seed: int = SEED) -> Estimate | None:
    """Kendall's tau-b: (concordant - discordant pairs) / sqrt((pairs - pairs tied on one side) (pairs - pairs tied
    on the other)). None where either side is constant."""
    x, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float)
    if len(np.unique(x)) < len(np.unique(y)):  # symmetric: count by the side with fewer distinct values
        x, y = y, x
    _, x_group = np.unique(x, return_inverse=True)
    _, level = np.unique(y, return_inverse=True)
    levels = int(level.max()) + 1 if len(level) else 0
    order = np.argsort(x_group, kind="stable")
    starts = np.searchsorted(x_group[order], np.arange(x_group.max() + 1 if len(x_group) else 0))
    of_level = [np.flatnonzero(level[order] == k) for k in range(levels)]

    def tau(weights: np.ndarray) -> np.ndarray:
        per = max(1, BATCH_CELLS // max(1, len(x) * levels))
        return np.concatenate([_tau_b(weights[i:i + per][:, order], starts, level[order], of_level)
                               for i in range(0, len(weights), per)])

    return bootstrap(tau, len(x), resamples, seed)


def _tau_b(weights: np.ndarray, starts: np.ndarray, level: np.ndarray, of_level: list[np.ndarray]) -> np.ndarray:
    """tau-b of weighted rows sorted by x (groups of equal x begin at `starts`), y given as a level per row. A pair
    counts once, from the row of the larger x: rows of a smaller x and a lower level agree with it, of a higher level
    disagree; pairs of equal x count neither."""
    count, levels = weights.shape[0], len(of_level)
    by_level = np.zeros((count, weights.shape[1], levels))
    for k, members in enumerate(of_level):
        by_level[:, members, k] = weights[:, members]
    in_group = np.add.reduceat(by_level, starts, axis=1)  # (resamples, x groups, levels)
    before = np.cumsum(in_group, axis=1) - in_group  # weight of each level at a strictly smaller x
    lower = np.cumsum(before, axis=2) - before
    higher = before.sum(axis=2, keepdims=True) - lower - before
    group = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, weights.shape[1])))
    net = (lower - higher)[:, group, level]  # (resamples, rows): agreeing less disagreeing, per copy of each row
    signed = (weights * net).sum(axis=1)
    total = weights.sum(axis=1)
    pairs = total * (total - 1) / 2
    tied_x = (in_group.sum(axis=2) * (in_group.sum(axis=2) - 1) / 2).sum(axis=1)
    level_weight = in_group.sum(axis=1)
    tied_y = (level_weight * (level_weight - 1) / 2).sum(axis=1)
    denominator = np.sqrt((pairs - tied_x) * (pairs - tied_y))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(denominator > 0, signed / denominator, np.nan)
