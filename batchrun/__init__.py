"""batchrun: run large language models over big batches of documents overnight.

The public API is imported lazily, so `import batchrun` stays cheap and spec parsing and planning
work without torch.
"""
from __future__ import annotations

__version__ = "0.1.0"

from batchrun.host import native_env  # noqa: E402 - before torch loads anywhere: MKL reads its settings then

native_env.apply()

_EXPORTS = {
    "StreamedModel": "batchrun.runtime.stream",
    "ResidentModel": "batchrun.runtime.resident",
    "default_device": "batchrun.runtime",
    "default_dtype": "batchrun.runtime",
    "resolve_checkpoint": "batchrun.checkpoint",
    "tensor_index": "batchrun.checkpoint",
    "checkpoint_sizes": "batchrun.checkpoint",
    "default_model": "batchrun.checkpoint",
    "read_spec": "batchrun.spec",
    "make_plan": "batchrun.plan",
    "plan_report": "batchrun.job",
    "JobOptions": "batchrun.job",
    "submit": "batchrun.job",
    "Store": "batchrun.store",
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
