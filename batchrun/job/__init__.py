"""A job from spec to answers: options, identity (fingerprint, row keys), preparation and planning, and the
resumable executor (`submit`, which needs torch and so is loaded on first use: `batchrun plan` stays light).
"""
from batchrun.job.calibration import calibration_settings
from batchrun.job.compare import DEFAULT_SAMPLE, Comparison, refuse_one_model_twice
from batchrun.job.compare import compare as compare_models
from batchrun.job.compare import describe as describe_comparison
from batchrun.job.identity import model_identity_parts, one_row_per_key
from batchrun.job.models import keep_models_open
from batchrun.job.options import CALIBRATION_METHODS, DEFAULT_CALIBRATION, DEFAULT_PASS_MINUTES, JobOptions
from batchrun.job.prepare import (DEFAULT_MODEL_LABEL, PreparedJob, model_label, names_default_model, nothing_runs,
                                  plan_report, plan_rows, prepare_job, resolve_model)

__all__ = ["CALIBRATION_METHODS", "Comparison", "DEFAULT_CALIBRATION", "DEFAULT_MODEL_LABEL", "DEFAULT_PASS_MINUTES",
           "DEFAULT_SAMPLE", "JobOptions", "PreparedJob", "calibration_settings", "compare_models",
           "describe_comparison", "keep_models_open", "model_identity_parts", "model_label", "names_default_model",
           "nothing_runs", "one_row_per_key", "plan_report", "plan_rows", "prepare_job", "refuse_one_model_twice",
           "resolve_model", "submit"]


def __getattr__(name: str):
    if name == "submit":
        from batchrun.job.execute import submit

        return submit
    raise AttributeError(f"module 'batchrun.job' has no attribute {name!r}")
