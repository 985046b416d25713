"""batchrun: run large language models over big batches of documents overnight.

    >>> import batchrun
    >>> answers = batchrun.submit("jobs/review-sentiment.jsonl")  # a pyarrow Table, one row per spec row

The public API (docs/python-api.md) is imported lazily, so `import batchrun` stays cheap: spec parsing and
planning work without torch, which loads when a model runs.
"""
from __future__ import annotations

import time

__version__ = "0.1.0"
# When this process began importing batchrun: a command's own start-up (torch, transformers, the executor), which
# `submit` records as the start its next ETAs count (measure.record_runtime_import).
IMPORT_STARTED = time.monotonic()

from batchrun.host import apply_native_defaults  # noqa: E402 - before torch loads anywhere: MKL reads them then

apply_native_defaults()

_EXPORTS = {
    # Run or plan a spec: a path, a list of dicts or a pyarrow Table (docs/python-api.md).
    "submit": "batchrun.api",
    "plan_job": "batchrun.api",  # not `plan`: importing the batchrun.plan subpackage would take that name
    "JobOptions": "batchrun.job",
    # A model to call yourself: decoder layers streamed from the checkpoint's safetensors or GGUF file.
    "StreamedModel": "batchrun.runtime",
    "default_model": "batchrun.checkpoint",
    # What a script may catch: `except batchrun.BatchrunError as error` catches every failure the CLI prints as
    # one `Error:` line; each class is also here by name.
    "BatchrunError": "batchrun.errors",
    "user_errors": "batchrun.errors",
    "SpecError": "batchrun.spec",
    "CheckpointError": "batchrun.checkpoint",
    "DefaultModelError": "batchrun.checkpoint",
    "PlanRefused": "batchrun.errors",
    "SettingRefused": "batchrun.errors",
    "OutputRefused": "batchrun.errors",
    "OutputExists": "batchrun.output",
    "OutputError": "batchrun.output",
    "OutputFormatUnknown": "batchrun.output",
    "JobLocked": "batchrun.store",
    "JobNotFound": "batchrun.store",
    "StoreError": "batchrun.store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'batchrun' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The lazy names too, for tab completion in a notebook."""
    return sorted(set(globals()) | set(__all__))
