"""A panel of judges: the mean and majority combinations on hand-made probabilities, and Fleiss' kappa against a
hand-computed table, the textbook example and a reference computed by the formula with exact fractions."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from batchrun.quality import PANEL_METHODS, fleiss_kappa, panel_answer

CHOICES = ("yes", "no", "maybe")


def probs(*values: float) -> dict[str, float]:
    return dict(zip(CHOICES, values))


def test_the_mean_averages_the_judges_probabilities_and_takes_the_most_probable():
    judges = [probs(0.6, 0.3, 0.1), probs(0.1, 0.5, 0.4), probs(0.2, 0.5, 0.3)]
    answer, mean = panel_answer("mean", ["yes", "no", "no"], judges)
    assert mean == pytest.approx(probs(0.3, 1.3 / 3, 0.8 / 3))
    assert answer == "no"
    # one confident judge outweighs two lukewarm ones: the mean follows probability, not votes
    answer, mean = panel_answer("mean", ["yes", "no", "no"], [probs(0.98, 0.01, 0.01), probs(0.3, 0.4, 0.3),
                                                              probs(0.3, 0.4, 0.3)])
    assert answer == "yes" and mean["yes"] == pytest.approx(1.58 / 3)


def test_the_mean_takes_the_first_choice_of_a_tie_as_a_model_does():
    answer, _ = panel_answer("mean", ["no", "yes"], [probs(0.25, 0.5, 0.25), probs(0.5, 0.25, 0.25)])
    assert answer == "yes"


def test_the_majority_counts_votes_whatever_the_probabilities():
    answer, mean = panel_answer("majority", ["yes", "no", "no"], [probs(0.98, 0.01, 0.01), probs(0.3, 0.4, 0.3),
                                                                  probs(0.3, 0.4, 0.3)])
    assert answer == "no" and mean["yes"] > mean["no"]


def test_a_tied_vote_goes_to_the_higher_mean_probability_then_to_the_first_choice():
    tied = ["yes", "no", "maybe", "maybe"]
    answer, _ = panel_answer("majority", ["yes", "no"], [probs(0.4, 0.35, 0.25), probs(0.1, 0.6, 0.3)])
    assert answer == "no"  # one vote each; "no" has the higher mean (0.475 against 0.25)
    answer, _ = panel_answer("majority", tied, [probs(0.5, 0.2, 0.3), probs(0.1, 0.6, 0.3), probs(0.3, 0.2, 0.5),
                                                probs(0.3, 0.2, 0.5)])
    assert answer == "maybe"  # two votes beat one, whatever the mean
    answer, _ = panel_answer("majority", ["no", "yes"], [probs(0.25, 0.5, 0.25), probs(0.5, 0.25, 0.25)])
    assert answer == "yes"  # a tie in votes and in mean: the first choice


@pytest.mark.parametrize("method", PANEL_METHODS)
def test_a_panel_of_one_is_the_judge(method):
    judge = probs(0.2, 0.7, 0.1)
    answer, mean = panel_answer(method, ["no"], [judge])
    assert answer == "no" and mean == judge


def test_a_panel_refuses_what_it_cannot_combine():
    with pytest.raises(ValueError, match="panel 'median': use one of mean, majority"):
        panel_answer("median", ["yes"], [probs(1, 0, 0)])
    with pytest.raises(ValueError, match="one answer and one set of probabilities per judge; got 2 answers and 1"):
        panel_answer("mean", ["yes", "no"], [probs(1, 0, 0)])
    with pytest.raises(ValueError, match="different choices"):
        panel_answer("mean", ["yes", "no"], [probs(1, 0, 0), {"yes": 0.5, "no": 0.5}])
    with pytest.raises(ValueError, match=r"answers not among the row's choices .*\['perhaps'\]"):
        panel_answer("majority", ["perhaps"], [probs(1, 0, 0)])


def reference_fleiss(ratings: list[list[str]]) -> Fraction:
    """Fleiss (1971) with exact fractions, row by row."""
    judges = len(ratings[0])
    categories = sorted({answer for row in ratings for answer in row})
    counts = [[row.count(category) for category in categories] for row in ratings]
    observed = sum(Fraction(sum(n * n for n in row) - judges, judges * (judges - 1)) for row in counts) / len(counts)
    shares = [Fraction(sum(row[j] for row in counts), len(counts) * judges) for j in range(len(categories))]
    chance = sum(share * share for share in shares)
    return (observed - chance) / (1 - chance)


def test_fleiss_kappa_of_a_hand_computed_table():
    # rows agree, disagree, agree, agree: P = 3/4; answers a 3/8, b 5/8: Pe = 34/64; kappa = (48 - 34) / 30 = 7/15
    ratings = [["a", "a"], ["a", "b"], ["b", "b"], ["b", "b"]]
    found = fleiss_kappa(ratings)
    assert found.value == pytest.approx(7 / 15, abs=1e-12) and found.rows == 4
    assert reference_fleiss(ratings) == Fraction(7, 15)


def test_fleiss_kappa_of_the_textbook_table_equals_the_formula():
    # Fleiss (1971) as Wikipedia shows it: 10 rows, 14 judges, 5 categories, kappa 0.210
    table = [[0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1], [7, 7, 0, 0, 0],
             [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7]]
    ratings = [[category for category, count in zip("12345", row) for _ in range(count)] for row in table]
    found = fleiss_kappa(ratings)
    assert found.value == pytest.approx(float(reference_fleiss(ratings)), abs=1e-12)
    assert round(found.value, 3) == 0.210
    low, high = found.interval
    assert low <= found.value <= high


def test_fleiss_kappa_of_random_judges_equals_the_formula():
    rng = np.random.default_rng(4)
    for judges in (2, 3, 5):
        ratings = [list(rng.choice(["x", "y", "z"], size=judges)) for _ in range(40)]
        assert fleiss_kappa(ratings, resamples=0).value == pytest.approx(float(reference_fleiss(ratings)), abs=1e-12)


def test_identical_judges_agree_perfectly_and_one_judge_or_one_answer_has_no_kappa():
    answers = ["yes", "no", "no", "maybe", "yes"]
    found = fleiss_kappa([[answer] * 3 for answer in answers])
    assert found.value == pytest.approx(1.0) and found.interval == (pytest.approx(1.0), pytest.approx(1.0))
    assert fleiss_kappa([[answer] for answer in answers]) is None
    assert fleiss_kappa([["yes", "yes"]] * 4) is None
    assert fleiss_kappa([]) is None
    with pytest.raises(ValueError, match="an answer from each of the 2 judges"):
        fleiss_kappa([["yes", "no"], ["yes"]])
