"""A verdict's share corrected for the answers' errors (Rogan-Gladen): the formula worked by hand, when it is not
given, and the coverage of its interval in simulated corpora whose labelled rows are a sample."""
from __future__ import annotations

import numpy as np
import pytest

from batchrun.quality import SHARE_MIN_LABELLED, corrected_share


def test_the_corrected_share_follows_the_formula_worked_by_hand():
    answers = ["yes"] * 40 + ["no"] * 60  # raw share 0.4
    # labelled: 10 "yes" (8 answered yes: sensitivity 0.8) and 20 "no" (2 answered yes: specificity 0.9)
    labels = ["yes"] * 10 + ["no"] * 20
    said = ["yes"] * 8 + ["no"] * 2 + ["yes"] * 2 + ["no"] * 18
    found = corrected_share("yes", answers, labels, said)
    assert (found.rows, found.labelled, found.raw) == (100, 30, 0.4)
    assert (found.sensitivity, found.specificity) == pytest.approx((0.8, 0.9))
    assert found.corrected == pytest.approx((0.4 + 0.9 - 1) / (0.8 + 0.9 - 1))  # 0.428571
    low, high = found.interval
    assert low < found.corrected < high and found.why_not is None
    assert corrected_share("yes", answers, labels, said) == found  # seeded
    assert corrected_share("yes", ["no"] * 100, labels, said).corrected == 0.0  # below the false-positive rate: clipped


def test_no_corrected_share_without_enough_labelled_rows_or_better_than_chance_answers():
    few = corrected_share("yes", ["yes", "no"] * 50, ["yes"] * 4 + ["no"] * 30, ["yes"] * 4 + ["no"] * 30)
    assert few.corrected is None and few.interval is None and few.raw == 0.5
    assert f"needs {SHARE_MIN_LABELLED} labelled rows" in few.why_not and "(has 4 and 30)" in few.why_not
    # answered "yes" as often whatever the label: sensitivity 0.5, specificity 0.5
    chance = corrected_share("yes", ["yes", "no"] * 50, ["yes", "yes", "no", "no"] * 5, ["yes", "no"] * 10)
    assert (chance.sensitivity, chance.specificity) == (0.5, 0.5)
    assert chance.corrected is None and "at most 1" in chance.why_not
    assert chance.to_json()["interval"] is None


@pytest.mark.parametrize("prevalence, corpus, labelled", [(0.3, 2000, 200), (0.1, 1000, 300)])
def test_the_interval_covers_the_true_prevalence_in_at_least_93_percent_of_500_simulations(prevalence, corpus,
                                                                                           labelled):
    """Corpora drawn with the verdict at `prevalence`, judged with sensitivity 0.8 and specificity 0.9, and a random
    sample of their rows labelled."""
    rng = np.random.default_rng(66)
    covered = 0
    for simulation in range(500):
        truth = rng.random(corpus) < prevalence
        said = np.where(truth, rng.random(corpus) < 0.8, rng.random(corpus) < 0.1)
        answers, labels = np.where(said, "yes", "no"), np.where(truth, "yes", "no")
        sample = rng.choice(corpus, labelled, replace=False)
        found = corrected_share("yes", answers, labels[sample], answers[sample], seed=simulation)
        covered += found.interval[0] <= prevalence <= found.interval[1]
    assert covered >= 465, covered
