"""Accuracy, intervals and per-class figures over labelled rows, against values worked out by hand."""
from __future__ import annotations

import pytest

from batchrun.quality import label_metrics, macro_f1, same_text, wilson_interval


def test_wilson_interval_matches_the_formula_worked_by_hand():
    # 47/60: p = 0.78333, z^2/n = 0.064025; centre 0.766287, half-width 0.102487
    low, high = wilson_interval(47, 60)
    assert low == pytest.approx(0.663800, abs=1e-5) and high == pytest.approx(0.868774, abs=1e-5)
    # 0/10 stays inside [0, 1] (the normal approximation would give 0 +- 0): centre = half = 0.138767
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.722467, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) is None


def test_wilson_interval_holds_its_rate_exactly_at_none_and_all_right():
    """An error bar drawn from the interval is never negative: 0/n starts at 0.0 and n/n ends at 1.0 exactly, where
    rounding once left 0/12's bound 2.8e-17 above the rate and 10/10's just below it."""
    for total in range(1, 301):
        for correct in range(total + 1):
            low, high = wilson_interval(correct, total)
            assert 0.0 <= low <= correct / total <= high <= 1.0, (correct, total)
        assert wilson_interval(0, total)[0] == 0.0 and wilson_interval(total, total)[1] == 1.0


def test_accuracy_per_class_and_confusion():
    labels = ["pos", "pos", "pos", "neg", "neg", "neg", "neg"]
    answers = ["pos", "neg", "neg", "neg", "neg", "neg", "pos"]
    metrics = label_metrics(labels, answers)
    assert (metrics.labelled, metrics.correct) == (7, 4) and metrics.rate == pytest.approx(4 / 7)
    assert metrics.confusion == {"pos": {"pos": 1, "neg": 2}, "neg": {"neg": 3, "pos": 1}}
    # pos: answered pos twice, right once (precision 1/2); 3 labelled pos, 1 found (recall 1/3)
    assert metrics.per_class["pos"] == {"precision": 0.5, "recall": pytest.approx(1 / 3), "support": 3}
    assert metrics.per_class["neg"] == {"precision": 0.6, "recall": 0.75, "support": 4}
    # F1: pos 2*(0.5*1/3)/(0.5+1/3) = 0.4, neg 2*0.45/1.35 = 2/3
    assert macro_f1(metrics) == pytest.approx((0.4 + 2 / 3) / 2)
    assert metrics.describe() == "accuracy 4/7 = 57.1% (95% CI 25.0%-84.2%)"


def test_a_class_never_answered_has_no_precision_and_counts_zero_in_macro_f1():
    metrics = label_metrics(["yes", "no", "no", "no"], ["no", "no", "no", "no"])
    assert metrics.per_class["yes"] == {"precision": None, "recall": 0.0, "support": 1}
    assert metrics.rate == 0.75 and macro_f1(metrics) == pytest.approx((0 + 2 * 0.75 / 1.75) / 2)


def test_exact_match_trims_and_case_folds_only():
    assert same_text("  Paris\n", "paris") and not same_text("Paris.", "paris") and not same_text(None, "x")
    metrics = label_metrics(["58213", "Reset the password"], ["58213 ", "reset the password."], kind="exact_match")
    assert (metrics.correct, metrics.per_class, metrics.confusion) == (1, {}, {})


def test_the_summary_quotes_a_choice_that_spaces_begin_or_end():
    """Choices such as " positive" (a leading space, as tokenizers like them) are shown quoted in the per-class and
    confusion lines, where the lines' own spacing would hide the space; plain choices stay bare."""
    from batchrun.output import describe_quality

    metrics = label_metrics([" positive", " negative", "neutral"], [" positive", "neutral", "neutral"])
    lines = describe_quality({"choice": metrics.to_json(), "calibration": {"method": "none"}})
    per_class = next(line for line in lines if line.startswith("  per class"))
    assert "' positive' 1.00 / 1.00 / 1" in per_class and "; neutral 0.50 / 1.00 / 1" in per_class
    confusion = next(line for line in lines if line.startswith("  confusion"))
    assert "' negative': neutral 1" in confusion and "  " not in confusion.strip()
