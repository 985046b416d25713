"""Calibration arithmetic for each method, against values worked out by hand."""
from __future__ import annotations

import math
import random

import pytest

from batchrun.quality import ChoiceRow, calibrate, divide_prior, fit_biases, with_biases
from batchrun.quality.calibration import AUTO_MIN_LABELLED, FOLDS


def test_batch_divides_the_mean_over_the_choice_set_out():
    rows = [ChoiceRow(0, {"a": 0.8, "b": 0.2}), ChoiceRow(1, {"a": 0.6, "b": 0.4}),
            ChoiceRow(2, {"x": 0.5, "y": 0.5})]
    found = calibrate(rows, "batch")
    assert found.priors[("a", "b")] == pytest.approx({"a": 0.7, "b": 0.3})
    # row 0: 0.8/0.7 = 1.142857, 0.2/0.3 = 0.666667 -> a = 1.142857 / 1.809524 = 0.631579
    assert found.probs[0]["a"] == pytest.approx(0.631579, abs=1e-6)
    # row 1 flips: 0.6/0.7 = 0.857143, 0.4/0.3 = 1.333333 -> a = 0.391304
    assert found.probs[1]["a"] == pytest.approx(0.391304, abs=1e-6)
    assert found.probs[2] == pytest.approx({"x": 0.5, "y": 0.5})  # its own set: its own prior
    assert found.rows_used == {("a", "b"): 2, ("x", "y"): 1}


def test_content_free_divides_the_given_prior_out_and_leaves_a_set_without_one_raw():
    rows = [ChoiceRow(0, {"a": 0.8, "b": 0.2}), ChoiceRow(1, {"x": 0.3, "y": 0.7})]
    found = calibrate(rows, "content-free", {("a", "b"): {"a": 0.9, "b": 0.1}})
    # 0.8/0.9 = 0.888889, 0.2/0.1 = 2 -> a = 0.307692
    assert found.probs[0]["a"] == pytest.approx(0.307692, abs=1e-6)
    assert 1 not in found.probs and "no content-free prior for choices ['x', 'y']" in found.notes[0]


def test_none_changes_nothing():
    assert calibrate([ChoiceRow(0, {"a": 0.8, "b": 0.2}, "b")], "none").probs == {}


def test_biases_are_added_to_log_probabilities():
    assert with_biases({"a": 0.5, "b": 0.5}, {"a": math.log(3), "b": 0.0}) == pytest.approx({"a": 0.75, "b": 0.25})
    assert divide_prior({"a": 0.5, "b": 0.5}, {"a": 0.25, "b": 0.75})["a"] == pytest.approx(0.75)


def synthetic_rows(count: int, model_bias: dict[str, float], seed: int = 1) -> list[ChoiceRow]:
    """Rows whose labels follow softmax(true scores) while the model adds `model_bias` to its log-likelihoods."""
    rng = random.Random(seed)
    choices = tuple(model_bias)
    rows = []
    for idx in range(count):
        true = [rng.gauss(0, 2) for _ in choices]
        label = rng.choices(choices, weights=[math.exp(score) for score in true])[0]
        leaning = [math.exp(score + model_bias[c]) for score, c in zip(true, choices)]
        rows.append(ChoiceRow(idx, {c: w / sum(leaning) for c, w in zip(choices, leaning)}, label))
    return rows


def test_the_fitted_bias_recovers_a_known_prior():
    model_bias = {"a": 1.5, "b": 0.0, "c": -1.0}
    biases = fit_biases(synthetic_rows(3000, model_bias), ("a", "b", "c"))
    # softmax ignores a shared shift: compare differences, which must undo the model's bias
    assert biases["a"] - biases["b"] == pytest.approx(-1.5, abs=0.15)
    assert biases["c"] - biases["b"] == pytest.approx(1.0, abs=0.15)


def test_labelled_rows_are_calibrated_by_a_fit_that_did_not_see_them():
    rows = synthetic_rows(40, {"a": 1.0, "b": 0.0}, seed=3)
    rows += [ChoiceRow(100, {"a": 0.6, "b": 0.4})]  # unlabelled: takes the fit on every label
    found = calibrate(rows, "labels")
    labelled = [row for row in rows if row.label is not None]
    assert found.probs[100] == pytest.approx(with_biases(rows[-1].probs, fit_biases(labelled, ("a", "b"))))
    for fold in range(FOLDS):
        trained = fit_biases([row for i, row in enumerate(labelled) if i % FOLDS != fold], ("a", "b"))
        for row in labelled[fold::FOLDS]:
            assert found.probs[row.idx] == pytest.approx(with_biases(row.probs, trained))


def test_labels_without_any_labelled_row_leave_the_rows_raw_with_a_note():
    found = calibrate([ChoiceRow(0, {"a": 0.8, "b": 0.2})], "labels")
    assert found.probs == {} and "no labelled row" in found.notes[0]


def test_labels_of_one_class_leave_the_rows_raw_with_a_note():
    rows = [ChoiceRow(i, {"a": 0.3, "b": 0.7}, "a") for i in range(10)] + [ChoiceRow(10, {"a": 0.3, "b": 0.7})]
    rows += [ChoiceRow(11 + i, {"x": 0.6, "y": 0.4}, "y" if i % 2 else "x") for i in range(6)]
    found = calibrate(rows, "labels")
    assert set(found.probs) == {row.idx for row in rows[11:]}  # the set with two classes is fitted
    assert found.rows_used == {("a", "b"): 0, ("x", "y"): 6} and set(found.biases) == {("x", "y")}
    (note,) = found.notes
    assert note.startswith("labels calibration: every one of the 10 labelled row(s) offering ['a', 'b'] is "
                           "labelled 'a', so a fit on them would answer 'a' everywhere")


def test_auto_keeps_the_model_answers_without_enough_labels():
    rows = [ChoiceRow(i, {"a": 0.9, "b": 0.1}, "b" if i % 2 else "a") for i in range(AUTO_MIN_LABELLED - 1)]
    found = calibrate(rows, "auto")
    assert found.probs == {} and found.chosen == {("a", "b"): "none"} and "too few" in found.notes[0]


def test_auto_takes_the_method_right_most_often_and_keeps_the_model_on_a_tie():
    # the model leans to a: every row it scores a 0.6 or more, half of them are b
    leaning = [ChoiceRow(i, {"a": 0.9 if i % 2 == 0 else 0.6, "b": 0.1 if i % 2 == 0 else 0.4}, "a" if i % 2 == 0
                         else "b") for i in range(20)]
    found = calibrate(leaning, "auto")
    assert found.chosen[("a", "b")] in ("batch", "labels")
    assert all(max(found.probs[row.idx], key=found.probs[row.idx].get) == row.label for row in leaning)
    right_already = [ChoiceRow(i, {"a": 0.9, "b": 0.1} if i % 2 == 0 else {"a": 0.2, "b": 0.8},
                               "a" if i % 2 == 0 else "b") for i in range(20)]
    found = calibrate(right_already, "auto")
    assert found.chosen[("a", "b")] == "none" and found.probs == {}
