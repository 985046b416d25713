"""A job from spec to answers: options, identity (fingerprint, row keys), preparation and planning, and the
resumable executor (`submit`, and `run_prepared` for a job already prepared, which need torch and so are loaded on
first use: `batchrun plan` stays light). A run's rows are computed by this machine's model unless it is given another
Computation (the Ray driver's).
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
from batchrun.job.running import Computation, JobRun, RunSetup, RunSummary, release_run, reused_note

__all__ = ["CALIBRATION_METHODS", "Comparison", "Computation", "DEFAULT_CALIBRATION", "DEFAULT_MODEL_LABEL",
           "DEFAULT_PASS_MINUTES", "DEFAULT_SAMPLE", "JobOptions", "JobRun", "PreparedJob", "RunSetup", "RunSummary",
           "calibration_settings", "compare_models", "describe_comparison", "keep_models_open",
           "model_identity_parts", "model_label", "names_default_model", "nothing_runs", "one_row_per_key",
           "plan_report", "plan_rows", "prepare_job", "refuse_one_model_twice", "release_run", "resolve_model",
           "reused_note", "run_prepared", "submit"]


def __getattr__(name: str):
    if name in ("submit", "run_prepared"):
        from batchrun.job import execute

        return getattr(execute, name)
    raise AttributeError(f"module 'batchrun.job' has no attribute {name!r}")
