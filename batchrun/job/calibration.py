"""What a job's calibration needs before it runs: a check that the method can apply to the job's rows, and for
content-free calibration its side job (the content-free inputs, run through the same model and settings)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable

from batchrun.errors import SettingRefused
from batchrun.host import stored_spec
from batchrun.job.prepare import PreparedJob
from batchrun.spec import Request, content_free_rows


def calibration_refusal(prepared: PreparedJob) -> str | None:
    """Why the job's calibration cannot apply to its rows, or None."""
    method = prepared.options.calibrate
    if method in ("none", "auto"):  # auto is none where no labelled choice row exists (prepare_job)
        return None
    choice_rows = [row.request for row in prepared.rows if row.request.choices is not None]
    if not choice_rows:
        return f"calibrate {method}: calibration applies to choice rows, and this job has none"
    if method == "labels":
        return _labels_refusal(choice_rows)
    return None


def _labels_refusal(choice_rows: list[Request]) -> str | None:
    """Why a fit on the job's labels cannot calibrate any choice set: no label, or a single class in every set
    (the fit would answer that class everywhere, right on every labelled row and telling nothing)."""
    classes: dict[tuple[str, ...], set[str]] = {}
    for request in choice_rows:
        if request.label is not None:
            classes.setdefault(request.choices, set()).add(request.label)
    if not classes:
        return ("calibrate labels: it fits one bias per choice on labelled rows, and no choice row of this job has "
                "a label (give rows a label, or --label-column in corpus mode)")
    if all(len(labels) < 2 for labels in classes.values()):
        shown = ", ".join(sorted(repr(label) for labels in classes.values() for label in labels))
        return (f"calibrate labels: every labelled choice row of this job is labelled {shown}"
                + (" (one class per choice set)" if len(classes) > 1 else "")
                + "; a fit on one class answers it everywhere, and accuracy would then say nothing about the "
                "choices. Label rows of two classes or more, or use --calibrate auto (the model's own answers)")
    return None


def calibration_settings(prepared: PreparedJob, run_side_job: Callable[[Path, object], str]) -> dict:
    """The settings the job records about its calibration: the method, and for content-free the id of the side job
    whose answers are the prior. `run_side_job(spec_path, options)` runs a job to its end and returns its id."""
    refusal = calibration_refusal(prepared)
    if refusal:
        raise SettingRefused(refusal)
    if prepared.options.calibrate != "content-free":
        return {}
    rows = content_free_rows(prepared.options.template, [row.request for row in prepared.rows])
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    # The content-free prompts are plain prompt rows, encoded as the job's rows are (same model, dtype, --raw).
    options = replace(prepared.options, template=None, id_column=None, label_column=None, keep_columns=None,
                      pair_columns=None, json_schema=None, choices=None, system=None, calibrate="none",
                      skip_invalid=False)
    return {"content_free_job": run_side_job(stored_spec(data, "content-free", ".jsonl"), options)}
