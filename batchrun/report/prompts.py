"""The prompts of a few rows, read back from the job's spec file when it is still there and unchanged since the job
was recorded (the database keeps answers, not prompts)."""
from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

from batchrun.spec import SpecError, SpecSettings, read_spec


def spec_prompts(spec_path: str, created_at: str, settings: dict, ids: Sequence[object]
                 ) -> tuple[dict[str, str], str | None]:
    """({str(id): prompt text} for `ids`, None), or ({}, why the prompts cannot be shown)."""
    if not ids:
        return {}, None
    path = Path(spec_path)
    try:
        modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError as error:
        return {}, f"the spec file {spec_path} cannot be read ({error.strerror or error})"
    # to the millisecond, as created_at is kept: a spec written in the same millisecond is not "changed after"
    if modified.replace(microsecond=modified.microsecond // 1000 * 1000) > datetime.fromisoformat(created_at):
        return {}, f"the spec file {spec_path} changed after the job was recorded"
    accepted = {field.name for field in dataclasses.fields(SpecSettings)}  # settings that shape how a spec reads
    options = {key: value for key, value in settings.items()
               if key in accepted and key not in ("path", "skip_invalid") and value is not None}
    try:
        spec = read_spec(path, **options, skip_invalid=True)
    except (SpecError, OSError, ValueError, TypeError) as error:
        return {}, f"the spec file {spec_path} no longer reads as it did ({error})"
    wanted = {str(row_id) for row_id in ids}
    found = {}
    for request in spec.requests:
        if str(request.id) in wanted:
            found[str(request.id)] = request.prompt if request.prompt is not None else _last_user_message(request)
    return found, None


def _last_user_message(request) -> str:
    users = [content for role, content in request.messages if role == "user"]
    return users[-1] if users else ""
