"""Judging answers against gold labels (accuracy, exact match, intervals, per-class precision and recall, agreement
beyond chance, shares corrected for the judge's errors), calibrating choice probabilities, and a panel of judges'
combined answers and their agreement among themselves. Plain Python and numpy: no torch, nothing from the layers
above.
"""
from batchrun.quality.agreement import (RESAMPLES, SEED, Estimate, bootstrap, cohen_kappa, kendall_tau,
                                        mean_absolute_error, spearman)
from batchrun.quality.calibration import (METHODS, Calibration, ChoiceRow, calibrate, divide_prior, fit_biases,
                                          mean_probs, numeric_score, with_biases)
from batchrun.quality.judging import (DISAGREEMENTS_KEPT, JudgedRow, agreement_figures, describe_agreement,
                                      number, ordered_scale)
from batchrun.quality.metrics import LabelMetrics, label_metrics, macro_f1, same_text, wilson_interval
from batchrun.quality.panel import PANEL_METHODS, fleiss_kappa, panel_answer
from batchrun.quality.prevalence import SHARE_MIN_LABELLED, CorrectedShare, corrected_share
from batchrun.quality.fields import enum_pointers, field_accuracy
from batchrun.quality.structured import INCOMPLETE, SchemaCheck, check_answer, check_regex_answer, schema_problem

__all__ = ["DISAGREEMENTS_KEPT", "INCOMPLETE", "SchemaCheck", "check_answer", "check_regex_answer", "schema_problem",
           "enum_pointers", "field_accuracy", "METHODS", "PANEL_METHODS", "RESAMPLES", "SEED", "SHARE_MIN_LABELLED",
           "Calibration",
           "ChoiceRow", "CorrectedShare", "Estimate", "JudgedRow", "LabelMetrics", "agreement_figures", "bootstrap",
           "calibrate", "cohen_kappa", "corrected_share", "describe_agreement", "divide_prior", "fit_biases",
           "fleiss_kappa", "kendall_tau", "label_metrics", "macro_f1", "mean_absolute_error", "mean_probs", "number",
           "numeric_score", "ordered_scale", "panel_answer", "same_text", "spearman", "wilson_interval", "with_biases"]
