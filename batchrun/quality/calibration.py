"""Calibrating choice probabilities: the model's answers lean on a prior over the labels (zero-shot classifiers
answer the label they like for many inputs); dividing that prior out, or fitting it on gold labels, corrects it.

Three ways to estimate the prior, per choice set (the rows that offer the same choices, in the same order):
  * batch (Zhou et al., "Batch Calibration", ICLR 2024): the mean of p(choice | row) over the job's rows. No extra
    pass; assumes the classes are not wildly imbalanced.
  * content-free (Zhao et al., "Calibrate Before Use", ICML 2021): the mean of p(choice | template with its fields
    "N/A", "" and "[MASK]"), computed by a small side job.
  * labels: one bias per choice, fitted by maximum likelihood on the labelled rows (softmax over log p + bias, a weak
    Gaussian prior on the biases); handles imbalanced corpora. A labelled row's own calibrated answer comes from a
    fit that did not see it (k-fold), so accuracy over labelled rows is held-out, never in-sample. A choice set
    whose labelled rows show a single class is left raw, as auto leaves it.
  * auto (the default): where a choice set has enough labelled rows, the one of none, batch and labels whose
    answers to the labelled rows are right most often (held-out for labels; a tie keeps the model's own answers);
    elsewhere none. Without labels nothing changes: batch calibration alone is what hurts an imbalanced corpus.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

METHODS = ("auto", "none", "batch", "content-free", "labels")
AUTO_MIN_LABELLED = 10  # labelled rows a choice set needs before auto calibration weighs the methods
AUTO_CANDIDATES = ("none", "labels", "batch")  # in order of preference on a tie
FOLDS = 5
BIAS_PRIOR_PRECISION = 0.5  # a N(0, 2) prior per bias: keeps a class no labelled row shows from running to -inf
SMALLEST_PROBABILITY = 1e-300  # a probability that underflowed to 0 still has a logarithm


@dataclass(frozen=True)
class ChoiceRow:
    idx: int
    probs: Mapping[str, float]  # the model's, over the row's choices in their order
    label: str | None = None


@dataclass
class Calibration:
    method: str
    probs: dict[int, dict[str, float]] = field(default_factory=dict)  # idx -> calibrated probabilities
    priors: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)  # what was divided out, per set
    biases: dict[tuple[str, ...], dict[str, float]] = field(default_factory=dict)  # labels: the fit on every label
    rows_used: dict[tuple[str, ...], int] = field(default_factory=dict)  # rows (or labelled rows) each set used
    chosen: dict[tuple[str, ...], str] = field(default_factory=dict)  # auto: the method each choice set took
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        def keyed(found: dict) -> list:
            return [{"choices": list(choices), "values": values} for choices, values in found.items()]
        return {"method": self.method, "priors": keyed(self.priors), "biases": keyed(self.biases),
                "rows_used": keyed(self.rows_used), "chosen": keyed(self.chosen), "notes": self.notes}


def choice_set(probs: Mapping[str, float]) -> tuple[str, ...]:
    return tuple(probs)


def divide_prior(probs: Mapping[str, float], prior: Mapping[str, float]) -> dict[str, float]:
    """q(c) proportional to p(c) / prior(c)."""
    scaled = {c: p / max(prior[c], SMALLEST_PROBABILITY) for c, p in probs.items()}
    total = sum(scaled.values())
    return {c: value / total for c, value in scaled.items()}


def with_biases(probs: Mapping[str, float], biases: Mapping[str, float]) -> dict[str, float]:
    """softmax(log p(c) + bias(c))."""
    logits = {c: math.log(max(p, SMALLEST_PROBABILITY)) + biases[c] for c, p in probs.items()}
    top = max(logits.values())
    weights = {c: math.exp(value - top) for c, value in logits.items()}
    total = sum(weights.values())
    return {c: weight / total for c, weight in weights.items()}


def numeric_score(probs: Mapping[str, float]) -> float | None:
    """The probability-weighted mean when every choice is a number (a 1-5 rating's expected stars)."""
    try:
        values = {c: float(c) for c in probs}
    except ValueError:
        return None
    if not all(math.isfinite(v) for v in values.values()):
        return None
    return sum(values[c] * p for c, p in probs.items())


def mean_probs(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The average distribution over rows with the same choices: the batch (or content-free) prior."""
    choices = tuple(rows[0])
    return {c: sum(row[c] for row in rows) / len(rows) for c in choices}


def calibrate(rows: Sequence[ChoiceRow], method: str,
              content_free: Mapping[tuple[str, ...], Mapping[str, float]] | None = None) -> Calibration:
    """Calibrated probabilities for every row, by `method`. content_free: the prior of each choice set, from the
    content-free side job (required for that method; a set without one stays raw, with a note)."""
    if method not in METHODS:
        raise ValueError(f"calibration {method!r}: use one of {', '.join(METHODS)}")
    found = Calibration(method)
    if method == "none":
        return found
    for choices, members in _by_choice_set(rows).items():
        if method == "batch":
            _divide(found, choices, members, mean_probs([row.probs for row in members]), len(members))
        elif method == "auto":
            _choose(found, choices, members)
        elif method == "content-free":
            prior = (content_free or {}).get(choices)
            if prior is None:
                found.notes.append(f"no content-free prior for choices {list(choices)}: left uncalibrated")
                continue
            _divide(found, choices, members, dict(prior), len(members))
        else:
            _fit_labels(found, choices, members)
    return found


def _by_choice_set(rows: Sequence[ChoiceRow]) -> dict[tuple[str, ...], list[ChoiceRow]]:
    groups: dict[tuple[str, ...], list[ChoiceRow]] = {}
    for row in rows:
        groups.setdefault(choice_set(row.probs), []).append(row)
    return groups


def _divide(found: Calibration, choices, members: Sequence[ChoiceRow], prior: dict[str, float], used: int) -> None:
    found.priors[choices], found.rows_used[choices] = prior, used
    for row in members:
        found.probs[row.idx] = divide_prior(row.probs, prior)


def _fit_labels(found: Calibration, choices: tuple[str, ...], members: Sequence[ChoiceRow]) -> None:
    """Unlabelled rows take the fit on every labelled row; labelled row i takes the fit without its fold."""
    labelled = sorted((row for row in members if row.label is not None), key=lambda row: row.idx)
    classes = sorted({row.label for row in labelled})
    found.rows_used[choices] = len(labelled) if len(classes) > 1 else 0
    if not labelled:
        found.notes.append(f"no labelled row offers choices {list(choices)}: those rows are left uncalibrated")
        return
    if len(classes) < 2:  # the fit would answer that class everywhere: right on every labelled row, saying nothing
        found.notes.append(f"labels calibration: every one of the {len(labelled)} labelled row(s) offering "
                           f"{list(choices)} is labelled {classes[0]!r}, so a fit on them would answer "
                           f"{classes[0]!r} everywhere and their accuracy would say nothing about the choices: those "
                           "rows are left uncalibrated (the model's own answers stand; label rows of two classes)")
        return
    everything = fit_biases(labelled, choices)
    found.biases[choices] = everything
    for row in members:
        if row.label is None:
            found.probs[row.idx] = with_biases(row.probs, everything)
    folds = min(FOLDS, len(labelled))
    for fold in range(folds):
        held_out = labelled[fold::folds]
        biases = fit_biases([row for i, row in enumerate(labelled) if i % folds != fold], choices)
        for row in held_out:
            found.probs[row.idx] = with_biases(row.probs, biases)


def _choose(found: Calibration, choices: tuple[str, ...], members: Sequence[ChoiceRow]) -> None:
    """Auto: each candidate's answers to the labelled rows, the most often right one kept (see the module's doc)."""
    labelled = [row for row in members if row.label is not None]
    distinct = len({row.label for row in labelled})
    if len(labelled) < AUTO_MIN_LABELLED or distinct < 2:
        found.chosen[choices] = "none"
        if labelled:
            found.notes.append(f"auto calibration: {len(labelled)} labelled row(s) offering {list(choices)} with "
                               f"{distinct} distinct label(s) are too few to weigh the methods on (at least "
                               f"{AUTO_MIN_LABELLED} with two labels): the model's own answers stand")
        return
    trials = {}
    for method in AUTO_CANDIDATES:
        trial = Calibration(method)
        if method == "batch":
            _divide(trial, choices, members, mean_probs([row.probs for row in members]), len(members))
        elif method == "labels":
            _fit_labels(trial, choices, members)
        trials[method] = trial
    right = {method: sum(_pick(trial.probs.get(row.idx, row.probs)) == row.label for row in labelled)
             for method, trial in trials.items()}
    best = max(AUTO_CANDIDATES, key=lambda method: (right[method], -AUTO_CANDIDATES.index(method)))
    chosen = trials[best]
    found.chosen[choices] = best
    found.probs.update(chosen.probs)
    found.priors.update(chosen.priors)
    found.biases.update(chosen.biases)
    found.rows_used[choices] = len(labelled)
    found.notes.append(f"auto calibration for {list(choices)}: {best} (right on the {len(labelled)} labelled rows: "
                       + ", ".join(f"{method} {right[method]}" for method in AUTO_CANDIDATES) + "; labels held-out)")


def _pick(probs: Mapping[str, float]) -> str:
    return max(probs, key=probs.__getitem__)


def fit_biases(rows: Sequence[ChoiceRow], choices: tuple[str, ...], precision: float = BIAS_PRIOR_PRECISION,
               iterations: int = 100) -> dict[str, float]:
    """The maximum a-posteriori bias per choice: maximise sum_i log softmax(log p_i + b)[label_i] - precision/2 |b|^2
    by Newton's method (the objective is concave; K is small). No rows: all zero."""
    scores = [[math.log(max(row.probs[c], SMALLEST_PROBABILITY)) for c in choices] for row in rows]
    targets = [choices.index(row.label) for row in rows]
    biases = [0.0] * len(choices)
    objective = _objective(scores, targets, biases, precision)
    for _ in range(iterations):
        gradient, hessian = _derivatives(scores, targets, biases, precision)
        step = _solve(hessian, gradient)
        scale = 1.0
        while True:  # backtracking: a full Newton step can overshoot where the fit is far from quadratic
            trial = [b - scale * s for b, s in zip(biases, step)]
            value = _objective(scores, targets, trial, precision)
            if value >= objective - 1e-12 or scale < 1e-6:
                break
            scale /= 2
        biases, improvement, objective = trial, value - objective, value
        if max(abs(scale * s) for s in step) < 1e-10 or abs(improvement) < 1e-12:
            break
    return dict(zip(choices, biases))


def _log_softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    total = math.log(sum(math.exp(v - top) for v in values)) + top
    return [v - total for v in values]


def _objective(scores, targets, biases, precision) -> float:
    fit = sum(_log_softmax([s + b for s, b in zip(row, biases)])[target] for row, target in zip(scores, targets))
    return fit - precision / 2 * sum(b * b for b in biases)


def _derivatives(scores, targets, biases, precision):
    """Gradient and Hessian of the negative objective."""
    count = len(biases)
    gradient = [precision * b for b in biases]
    hessian = [[precision if i == j else 0.0 for j in range(count)] for i in range(count)]
    for row, target in zip(scores, targets):
        q = [math.exp(v) for v in _log_softmax([s + b for s, b in zip(row, biases)])]
        for i in range(count):
            gradient[i] += q[i] - (i == target)
            for j in range(count):
                hessian[i][j] += q[i] * ((i == j) - q[j])
    return gradient, hessian


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the matrix is positive definite: the prior term sees to it)."""
    size = len(vector)
    rows = [list(matrix[i]) + [vector[i]] for i in range(size)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, size):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, size + 1):
                rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * size
    for r in reversed(range(size)):
        solution[r] = (rows[r][size] - sum(rows[r][c] * solution[c] for c in range(r + 1, size))) / rows[r][r]
    return solution
