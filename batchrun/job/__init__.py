"""A job from spec to answers: options, identity (fingerprint, row keys), preparation and planning, and the
resumable executor (`submit`, which needs torch and so is loaded on first use: `batchrun plan` stays light).
"""
from batchrun.job.options import JobOptions
from batchrun.job.prepare import plan_report, resolve_model

__all__ = ["JobOptions", "plan_report", "resolve_model", "submit"]


def __getattr__(name: str):
    if name == "submit":
        from batchrun.job.execute import submit

        return submit
    raise AttributeError(f"module 'batchrun.job' has no attribute {name!r}")
