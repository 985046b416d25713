"""Failures a user can act on: the CLI prints their message as one `Error:` line, never a traceback.

Every such failure derives from BatchrunError, so this module imports nothing of batchrun's and a script catches
them all with `except batchrun.BatchrunError`. Each keeps the built-in base it had (ValueError for bad input,
FileExistsError for an existing output, ...), so code that catches those still does.
"""
from __future__ import annotations


class BatchrunError(Exception):
    """A failure the user can act on; the message says what failed, where, and what to do.

    >>> import batchrun
    >>> try:
    ...     batchrun.submit([{"id": "a", "prompt": 5}])
    ... except batchrun.BatchrunError as error:  # here a SpecError, naming the row
    ...     print(type(error).__name__, str(error).endswith(":line 1: prompt must be a string, got an integer (5)"))
    SpecError True
    """


class PlanRefused(BatchrunError, RuntimeError):
    """The plan says the job cannot run as asked (does not fit, streaming refused, ...)."""


class SettingRefused(BatchrunError, ValueError):
    """An option or environment variable holds a value batchrun cannot use here."""


class OutputRefused(BatchrunError, FileExistsError):
    """The output file exists and --force was not given."""


def user_errors() -> tuple[type[BaseException], ...]:
    """What the CLI prints as one line: for `except batchrun.user_errors() as error` in scripts."""
    return (BatchrunError,)
