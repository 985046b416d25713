"""Failures a user can act on: the CLI prints their message, never a traceback. No torch."""
from __future__ import annotations


class PlanRefused(RuntimeError):
    """The plan says the job cannot run as asked (does not fit, streaming refused, ...)."""


class SettingRefused(ValueError):
    """An option or environment variable holds a value batchrun cannot use here."""


class OutputRefused(FileExistsError):
    """The output file exists and --force was not given."""


def user_errors() -> tuple[type[BaseException], ...]:
    from batchrun.checkpoint import CheckpointError
    from batchrun.default import DefaultModelError
    from batchrun.output import OutputError, OutputExists, OutputFormatUnknown
    from batchrun.spec import SpecError
    from batchrun.store import JobLocked, JobNotFound, StoreError

    return (SpecError, CheckpointError, DefaultModelError, PlanRefused, OutputRefused, OutputExists,
            OutputError, OutputFormatUnknown, JobLocked, JobNotFound, StoreError, SettingRefused)
