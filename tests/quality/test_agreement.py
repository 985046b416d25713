"""Agreement figures against scikit-learn and scipy (test dependencies only), their bootstrap intervals against
explicit resampling and a simulated coverage, and the rules for when each figure is shown."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import kendalltau, spearmanr
from sklearn.metrics import cohen_kappa_score
from sklearn.metrics import mean_absolute_error as sklearn_mae

from batchrun.quality import (SEED, JudgedRow, agreement_figures, cohen_kappa, describe_agreement, kendall_tau,
                              mean_absolute_error, ordered_scale, spearman)


def test_kappa_and_weighted_kappa_equal_sklearn_on_random_cases():
    rng = np.random.default_rng(1)
    compared = 0
    for _ in range(300):
        rows, count = int(rng.integers(2, 120)), int(rng.integers(2, 7))
        scale = [str(value) for value in sorted(rng.choice(100, count, replace=False))]  # "10" sorts before "9"
        labels = [scale[i] for i in rng.integers(0, count, rows)]
        answers = [scale[i] if rng.random() < 0.6 else scale[j] for i, j in
                   zip(rng.integers(0, count, rows), rng.integers(0, count, rows))]
        for weighted in (False, True):
            found = cohen_kappa(labels, answers, scale if weighted else None, weighted, resamples=0)
            with np.errstate(divide="ignore", invalid="ignore"):
                expected = cohen_kappa_score(labels, answers, labels=scale if weighted else None,
                                             weights="quadratic" if weighted else None)
            if not np.isfinite(expected):
                assert found is None
                continue
            assert found.value == pytest.approx(expected, abs=1e-9) and found.rows == rows
            compared += 1
    assert compared > 500


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")  # the cases it warns of are compared too
@pytest.mark.parametrize("decimals", [0, 1, 6])  # 0: many tied scores, 6: hardly any
def test_spearman_kendall_and_mae_equal_scipy_and_sklearn_on_random_cases(decimals):
    rng = np.random.default_rng(decimals)
    for _ in range(200):
        rows = int(rng.integers(3, 150))
        labels = rng.integers(1, int(rng.integers(2, 8)), rows).astype(float)
        scores = np.round(np.clip(labels + rng.normal(0, 1.5, rows), 1, 7), decimals)
        for ours, theirs in ((spearman, spearmanr(scores, labels).statistic),
                             (kendall_tau, kendalltau(scores, labels).statistic),
                             (mean_absolute_error, sklearn_mae(labels, scores))):
            found = ours(list(scores), list(labels), resamples=0)
            if not np.isfinite(theirs):  # a constant side: no correlation to give
                assert found is None
            else:
                assert found.value == pytest.approx(theirs, abs=1e-9)


def test_intervals_are_the_percentiles_of_the_figure_over_seeded_resamples_of_the_rows():
    """A resample holds rows several times (ties of a row with itself): its figure is scipy's on the rows drawn."""
    rng = np.random.default_rng(5)
    labels = rng.integers(1, 6, 40).astype(float)
    scores = np.round(labels + rng.normal(0, 1, 40), 1)
    drawn = np.random.default_rng(SEED).integers(0, 40, size=(300, 40))
    for ours, theirs in ((spearman, lambda x, y: spearmanr(x, y).statistic),
                         (kendall_tau, lambda x, y: kendalltau(x, y).statistic)):
        again = [theirs(scores[rows], labels[rows]) for rows in drawn]
        assert ours(scores, labels, resamples=300).interval == pytest.approx(tuple(np.percentile(again, [2.5, 97.5])),
                                                                             abs=1e-9)
    text = [str(int(value)) for value in labels]
    said = [str(int(min(5, max(1, round(value))))) for value in scores]
    again = [cohen_kappa_score(np.array(text)[rows], np.array(said)[rows]) for rows in drawn]
    assert cohen_kappa(text, said, resamples=300).interval == pytest.approx(
        tuple(np.percentile(again, [2.5, 97.5])), abs=1e-9)
    assert cohen_kappa(text, said) == cohen_kappa(text, said)  # seeded: the same rows, the same interval


def test_the_kappa_interval_covers_the_true_kappa_in_at_least_93_percent_of_simulated_samples():
    joint = np.array([[0.25, 0.05, 0.03], [0.04, 0.20, 0.06], [0.02, 0.05, 0.30]])  # label (down) by answer
    chance = joint.sum(axis=1) @ joint.sum(axis=0)
    truth = (np.trace(joint) - chance) / (1 - chance)
    rng = np.random.default_rng(2024)
    covered = 0
    for sample in range(1000):
        cells = rng.choice(9, size=120, p=joint.ravel())
        found = cohen_kappa([str(cell // 3) for cell in cells], [str(cell % 3) for cell in cells], seed=sample)
        covered += found.interval[0] <= truth <= found.interval[1]
    assert covered >= 930, covered


def test_undefined_figures_are_none_and_values_off_the_scale_are_refused():
    assert cohen_kappa(["yes"] * 5, ["yes"] * 5) is None  # one class on both sides: chance agreement is total
    assert cohen_kappa(["yes", "no"], ["yes", "yes"]).value == 0.0  # one side constant: no better than chance
    assert spearman([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]) is None and kendall_tau([1.0], [2.0]) is None
    with pytest.raises(ValueError, match="not on the scale"):
        cohen_kappa(["1", "2"], ["1", "7"], ["1", "2", "3"], weighted=True)


def row(idx: int, answer: str, label: str | None, probs: dict[str, float], score: float | None = None) -> JudgedRow:
    return JudgedRow(f"r{idx}", answer, probs, score, label)


def test_the_ordered_scale_is_every_numeric_choice_and_label_sorted_by_value():
    rows = [row(0, "9", "10", {"1": 0.1, "9": 0.6, "10": 0.3}), row(1, "1", "4.5", {"1": 0.5, "9": 0.3, "10": 0.2})]
    assert ordered_scale(rows) == ["1", "4.5", "9", "10"]
    assert ordered_scale(rows + [row(2, "1", "n/a", {"1": 0.5, "9": 0.3, "10": 0.2})]) is None
    assert ordered_scale([row(0, "yes", "no", {"yes": 0.7, "no": 0.3})]) is None


def ratings(count: int, labelled: int) -> list[JudgedRow]:
    """Rows rated 1-3 whose answer is the label most of the time, the first `labelled` of them labelled."""
    rng = np.random.default_rng(3)
    found = []
    for idx in range(count):
        truth = str(rng.integers(1, 4))
        weights = {c: rng.random() + (0.4 if c == truth else 0.0) for c in ("1", "2", "3")}
        probs = {c: w / sum(weights.values()) for c, w in weights.items()}
        answer = max(probs, key=probs.get)
        found.append(row(idx, answer, truth if idx < labelled else None, probs,
                         sum(float(c) * p for c, p in probs.items())))
    return found


def test_agreement_of_rated_rows_lists_the_surest_disagreements_and_corrects_shares_where_some_rows_are_unlabelled():
    rows = ratings(400, 150)
    found = agreement_figures(rows)
    labelled = rows[:150]
    assert found["rows"] == 150 and found["scale"] == ["1", "2", "3"] and found["seed"] == SEED
    assert found["kappa"]["value"] == pytest.approx(cohen_kappa_score([r.label for r in labelled],
                                                                       [r.answer for r in labelled]), abs=1e-9)
    assert found["spearman"]["rows"] == found["mae"]["rows"] == 150
    wrong = [r for r in labelled if r.answer != r.label]
    assert found["disagreements"] == len(wrong) > 10
    listed = found["most_confident_disagreements"]
    assert len(listed) == 10 and [item["id"] for item in listed] == [
        r.id for r in sorted(wrong, key=lambda r: -r.probs[r.answer])[:10]]
    shares = {share["verdict"]: share for share in found["shares"]}
    assert list(shares) == ["1", "2", "3"]
    assert sum(share["raw"] for share in shares.values()) == pytest.approx(1.0)
    assert all(share["rows"] == 400 and share["labelled"] == 150 and share["corrected"] is not None
               for share in shares.values())
    lines = describe_agreement(found)
    assert len(lines) == 2 and lines[0].startswith("agreement (95% CI): kappa ") and "Rogan-Gladen" in lines[1]


def test_without_unlabelled_rows_or_numeric_labels_those_figures_are_left_out():
    everything = agreement_figures(ratings(60, 60))
    assert everything["shares"] == [] and len(describe_agreement(everything)) == 1
    words = [row(i, "yes" if i % 3 else "no", "yes" if i % 2 else "no", {"yes": 0.6, "no": 0.4}) for i in range(30)]
    found = agreement_figures(words)
    assert found["kappa"] is not None and found["scale"] is None
    assert found["weighted_kappa"] is found["spearman"] is found["kendall"] is found["mae"] is None
    assert agreement_figures([row(0, "yes", None, {"yes": 0.6, "no": 0.4})]) is None


def test_a_judge_that_gives_one_answer_everywhere_is_named_beside_its_kappa():
    constant = [row(i, "yes", "yes" if i % 2 else "no", {"yes": 0.6, "no": 0.4}) for i in range(20)]
    found = agreement_figures(constant)
    assert found["kappa"]["value"] == 0.0 and found["single_answer"] == "yes"
    assert "every labelled row was answered 'yes'" in describe_agreement(found)[0]
    varied = agreement_figures([row(i, "yes" if i % 2 else "no", "yes", {"yes": 0.6, "no": 0.4}) for i in range(20)])
    assert varied["single_answer"] is None and "every labelled row" not in describe_agreement(varied)[0]
