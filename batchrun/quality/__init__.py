"""Judging answers against gold labels (accuracy, exact match, intervals, per-class precision and recall) and
calibrating choice probabilities. Plain Python: no torch, nothing from the layers above.
"""
from batchrun.quality.calibration import (METHODS, Calibration, ChoiceRow, calibrate, divide_prior, fit_biases,
                                          mean_probs, numeric_score, with_biases)
from batchrun.quality.metrics import LabelMetrics, label_metrics, macro_f1, same_text, wilson_interval

__all__ = ["METHODS", "Calibration", "ChoiceRow", "LabelMetrics", "calibrate", "divide_prior", "fit_biases",
           "label_metrics", "macro_f1", "mean_probs", "numeric_score", "same_text", "wilson_interval", "with_biases"]
