"""Content-free inputs for contextual calibration (Zhao et al., "Calibrate Before Use", ICML 2021): the job's
template with every field set to a value that says nothing ("N/A", "", "[MASK]"), asked with each choice set the
job's rows offer. The model's mean answer to them is its prior over the choices, which calibration divides out.
"""
from __future__ import annotations

from typing import Sequence

from batchrun.spec.read import Request
from batchrun.spec.template import SpecError, parse_template, render_template, template_columns

CONTENT_FREE_VALUES = ("N/A", "", "[MASK]")


def content_free_rows(template: str | None, requests: Sequence[Request]) -> list[dict]:
    """Native request rows (prompt, choices, system) for each choice set among `requests`' choice rows. Refused
    without a template (prompt rows have no fields to empty) or where rows sharing a choice set differ in system
    message (one prior per choice set needs one frame around the fields)."""
    if template is None:
        raise SpecError(["calibrate content-free: it fills the template's fields with content-free values, so it "
                         "needs corpus mode (--template); for request rows use batch or labels"])
    parts = parse_template(template)
    systems: dict[tuple[str, ...], str | None] = {}
    for request in requests:
        if request.choices is None:
            continue
        system = request.messages[0][1] if request.messages[0][0] == "system" else None
        if systems.setdefault(request.choices, system) != system:
            raise SpecError([f"calibrate content-free: rows offering choices {list(request.choices)} have different "
                             f"system messages ({request.location} among them); use batch or labels"])
    rows = []
    for choices, system in systems.items():
        for value in CONTENT_FREE_VALUES:
            prompt = render_template(parts, dict.fromkeys(template_columns(parts), value))
            row = {"id": f"content-free-{len(rows) + 1}", "prompt": prompt, "choices": list(choices)}
            rows.append(row if system is None else {**row, "system": system})
    return rows
