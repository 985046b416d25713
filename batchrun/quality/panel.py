"""A panel of judges: several models' answers to one choice row combined into the panel's answer (the mean of their
probabilities, or a majority vote), and Fleiss' kappa, the agreement between the judges beyond chance.

PoLL (Verga et al. 2024) found three small judges agree with people better than one large one; UMBRELA and
inspect_ai combine their judges by majority vote.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping, Sequence

import numpy as np

from batchrun.quality.agreement import RESAMPLES, SEED, Estimate, bootstrap
from batchrun.quality.calibration import mean_probs

PANEL_METHODS = ("mean", "majority")


def panel_answer(method: str, answers: Sequence[str],
                 probs: Sequence[Mapping[str, float]]) -> tuple[str, dict[str, float]]:
    """The panel's answer to one row and its probabilities (the mean of the judges', in either method).

    `answers[i]` and `probs[i]` are judge i's answer and probabilities over the row's choices (calibrated where its
    job calibrates). `mean`: the most probable choice of the mean, the first of a tie, as a model's own pick is.
    `majority`: the answer most judges gave, a tie broken by the mean probability, then by choice order."""
    if method not in PANEL_METHODS:
        raise ValueError(f"panel {method!r}: use one of {', '.join(PANEL_METHODS)}")
    if not answers or len(answers) != len(probs):
        raise ValueError(f"a panel row needs one answer and one set of probabilities per judge; got "
                         f"{len(answers)} answers and {len(probs)} sets")
    choices = set(probs[0])
    if any(set(judge) != choices for judge in probs):
        raise ValueError(f"the judges' probabilities cover different choices: {[sorted(p) for p in probs]}")
    mean = mean_probs(probs)
    if method == "mean":
        return max(mean, key=mean.__getitem__), mean
    votes = Counter(answers)
    strays = set(votes) - choices
    if strays:
        raise ValueError(f"answers not among the row's choices {sorted(choices)}: {sorted(strays)}")
    most = max(votes.values())
    tied = [choice for choice in mean if votes[choice] == most]
    return max(tied, key=mean.__getitem__), mean


def fleiss_kappa(ratings: Sequence[Sequence[str]], resamples: int = RESAMPLES, seed: int = SEED) -> Estimate | None:
    """Fleiss' kappa of n judges over N rows, each row's n answers in `ratings[row]`: (P - Pe) / (1 - Pe), P the mean
    over rows of the share of judge pairs that agree on the row, Pe the sum over answers of the squared share of all
    answers given. None with fewer than two judges, or where undefined (every judge gave one and the same answer
    throughout)."""
    if not ratings:
        return None
    judges = len(ratings[0])
    if any(len(row) != judges for row in ratings):
        raise ValueError(f"every row needs an answer from each of the {judges} judges; row lengths "
                         f"{sorted({len(row) for row in ratings})}")
    if judges < 2:
        return None
    categories = sorted({answer for row in ratings for answer in row})
    position = {name: i for i, name in enumerate(categories)}
    counts = np.zeros((len(ratings), len(categories)))
    for i, row in enumerate(ratings):
        for answer in row:
            counts[i, position[answer]] += 1
    agreed = ((counts ** 2).sum(axis=1) - judges) / (judges * (judges - 1))  # per row: share of agreeing pairs

    def kappa(weights: np.ndarray) -> np.ndarray:
        total = weights.sum(axis=1)
        observed = weights @ agreed / total
        shares = weights @ counts / (total * judges)[:, None]
        chance = (shares ** 2).sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(chance < 1, (observed - chance) / (1 - chance), np.nan)

    return bootstrap(kappa, len(ratings), resamples, seed)
