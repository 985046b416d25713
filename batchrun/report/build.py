"""A job's report: one self-contained HTML file (inline style and SVG charts, no script, nothing fetched), written
atomically so a reader never opens half of it."""
from __future__ import annotations

from pathlib import Path

from batchrun.output import atomic_write
from batchrun.report.answers import answers_section
from batchrun.report.data import ReportData, read_job
from batchrun.report.errors import errors_section
from batchrun.report.glance import glance_section
from batchrun.report.labels import labels_section
from batchrun.report.page import GENERATOR_META, page
from batchrun.report.pairs import pair_sections
from batchrun.report.prompts import spec_prompts
from batchrun.report.structured import structured_sections
from batchrun.report.timeline import timeline_section
from batchrun.store import Store


def default_report_path(spec_path: Path | str) -> Path:
    """Beside the spec: docs.jsonl -> docs.report.html."""
    spec_path = Path(spec_path)
    return spec_path.with_name(f"{spec_path.stem}.report.html")


def render_report(data: ReportData) -> str:
    """The report's HTML, top to bottom: the job at a glance, answers, against labels, structured answers and pairs
    (where the job has them), the run, errors."""
    job = data.job

    def prompts(ids):
        return spec_prompts(job["spec_path"], job["created_at"], data.settings, ids)

    sections = [glance_section(data), answers_section(data, prompts), labels_section(data, prompts),
                *structured_sections(data, prompts), *pair_sections(data),
                timeline_section(data), errors_section(data)]
    title = f"batchrun job {job['id']}: {Path(job['spec_path']).name}"
    subtitle = (f"{job['model']} · {job['state']} · {job['rows_done'] + job['rows_errored']:,} of "
                f"{job['rows_total']:,} rows finished · report built {data.built_at:%Y-%m-%d %H:%M:%S} UTC")
    return page(title, subtitle, sections)


def is_report(path: Path) -> bool:
    """True when `path` is a report batchrun wrote (its generator mark near the top), which a run may replace."""
    try:
        with open(path, "rb") as handle:
            return GENERATOR_META.encode() in handle.read(2048)
    except OSError:
        return False


def write_report(store: Store, job_id: str, path: Path | str, *, force: bool = False) -> Path:
    """Read `job_id` from `store` as it stands (also while it runs) and write its report to `path`; an existing file
    is replaced only with `force` (OutputExists otherwise)."""
    html = render_report(read_job(store, job_id))
    return atomic_write(Path(path), lambda temp: Path(temp).write_text(html, encoding="utf-8"), force=force)
