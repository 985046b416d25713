"""The share of a verdict in a whole corpus, corrected for the judge's errors as a labelled sample of it shows them
(Rogan and Gladen, 1978): a judge that says "yes" to 10% of the "no" rows inflates a rare "yes", and its raw share
says nothing of how much.

    corrected = (raw + specificity - 1) / (sensitivity + specificity - 1), clipped to [0, 1]

with sensitivity (of the rows labelled with the verdict, the share answered it) and specificity (of the other
labelled rows, the share answered something else) counted on the labelled rows. Its 95% interval is a percentile
bootstrap over both samples: the verdict's count among the corpus rows and the labelled rows' four cells (verdict or
not, by label and by answer) are each drawn again, which is what resampling those rows with replacement gives.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence

import numpy as np

from batchrun.quality.agreement import RESAMPLES, SEED

SHARE_MIN_LABELLED = 5  # labelled rows with the verdict, and without it, before sensitivity and specificity say much


@dataclass(frozen=True)
class CorrectedShare:
    verdict: str
    rows: int  # the corpus rows the raw share is over
    raw: float  # the share of them answered with the verdict
    labelled: int
    sensitivity: float | None
    specificity: float | None
    corrected: float | None  # None where it cannot be computed: `why_not` says why
    interval: tuple[float, float] | None
    why_not: str | None = None

    def to_json(self) -> dict:
        found = asdict(self)
        found["interval"] = list(self.interval) if self.interval else None
        return found


def corrected_share(verdict: str, answers: Sequence[str], labels: Sequence[str], labelled_answers: Sequence[str],
                    resamples: int = RESAMPLES, seed: int = SEED) -> CorrectedShare:
    """The share of `answers` (every answered row of the corpus) that are `verdict`, raw and corrected by the
    sensitivity and specificity of `labelled_answers` against `labels` (the labelled rows, answered as in the
    corpus)."""
    rows, said = len(answers), int(np.count_nonzero(np.asarray(answers, dtype=object) == verdict))
    is_label = np.asarray(labels, dtype=object) == verdict
    is_answer = np.asarray(labelled_answers, dtype=object) == verdict
    # [label is the verdict, or not][answer is the verdict, or not]
    cells = np.array([[np.count_nonzero(is_label & is_answer), np.count_nonzero(is_label & ~is_answer)],
                      [np.count_nonzero(~is_label & is_answer), np.count_nonzero(~is_label & ~is_answer)]])
    raw = said / rows if rows else 0.0
    found = CorrectedShare(verdict, rows, raw, len(labels), None, None, None, None)
    positives, negatives = cells.sum(axis=1)
    if min(positives, negatives) < SHARE_MIN_LABELLED:
        return replace(found, why_not=f"needs {SHARE_MIN_LABELLED} labelled rows with the verdict and as many without "
                                     f"(has {positives} and {negatives})")
    sensitivity, specificity = cells[0, 0] / positives, cells[1, 1] / negatives
    found = replace(found, sensitivity=float(sensitivity), specificity=float(specificity))
    corrected = _rogan_gladen(np.array([raw]), np.array([sensitivity]), np.array([specificity]))[0]
    if not np.isfinite(corrected):
        return replace(found, why_not="the answers say no more about the verdict than chance: sensitivity + "
                                     "specificity is at most 1")
    interval = None
    if resamples > 0:
        rng = np.random.default_rng(seed)
        raw_again = rng.binomial(rows, raw, size=resamples) / rows
        drawn = rng.multinomial(len(labels), cells.ravel() / len(labels), size=resamples).reshape(-1, 2, 2)
        with np.errstate(divide="ignore", invalid="ignore"):
            again = _rogan_gladen(raw_again, drawn[:, 0, 0] / drawn[:, 0].sum(axis=1),
                                  drawn[:, 1, 1] / drawn[:, 1].sum(axis=1))
        again = again[np.isfinite(again)]
        if len(again):
            low, high = np.percentile(again, [2.5, 97.5])
            interval = (float(low), float(high))
    return replace(found, corrected=float(corrected), interval=interval)


def _rogan_gladen(raw: np.ndarray, sensitivity: np.ndarray, specificity: np.ndarray) -> np.ndarray:
    """The corrected share, clipped to [0, 1]; NaN where sensitivity + specificity - 1 <= 0 (or undefined), where
    the answers do not separate the verdict from the rest."""
    informedness = sensitivity + specificity - 1
    with np.errstate(divide="ignore", invalid="ignore"):
        corrected = np.clip((raw + specificity - 1) / informedness, 0.0, 1.0)
    return np.where(informedness > 0, corrected, np.nan)

