"""The files a run writes besides its database: the answers file, checked before any work and never replaced
unasked, and the report beside it."""
from __future__ import annotations

import logging
from pathlib import Path

from batchrun.errors import OutputRefused
from batchrun.host import default_db_path
from batchrun.job.running import AnswersFile
from batchrun.output import check_output_writable, default_output_path, output_format
from batchrun.report import is_report, write_report
from batchrun.store import Store

log = logging.getLogger("batchrun")


def answers_file(spec_path: Path, output: str | Path | None, db_path: Path, force: bool) -> AnswersFile:
    """The run's answers file (default: beside the spec), checked now: before any work, not after the night's run,
    and before the spec is read, since encoding a large one takes minutes."""
    path = Path(output) if output else default_output_path(spec_path)
    check_output_writable(path, spec_path, db_path)
    found = AnswersFile(path, output_format(path), force)
    if path.exists() and not force:
        _refuse_existing_output(db_path, spec_path, path)
    return found


def export_command(store: Store, job_id: str) -> str:
    """The command that writes a job's answers, naming the database unless it is the default one."""
    db = "" if store.path.resolve() == default_db_path().resolve() else f" --db {store.path}"
    return f"`batchrun results {job_id}{db} -o FILE`"


def _refuse_existing_output(db_path: Path, spec_path: Path, output_path: Path) -> None:
    """Refuse to overwrite, naming the job last made from this spec where the database holds one (the spec is not
    read yet, so its job is found by the spec's path): its answers stay exportable."""
    refusal = f"{output_path} exists; pass --force to overwrite it, or -o another file"
    with Store(db_path) as store:
        job = next((job for job in store.jobs() if job["spec_path"] == str(spec_path.resolve())), None)
        if job is None:  # nothing recorded for this spec, nothing to point at
            raise OutputRefused(refusal)
        export = export_command(store, job["id"])
    if job["rows_pending"] == 0:
        raise OutputRefused(f"job {job['id']} (the last made from {spec_path.name}) is complete and {output_path} "
                            f"already exists, left untouched; pass --force to rewrite it, or export with {export}")
    raise OutputRefused(f"{refusal} (answers so far are kept in the database: {export})")


def report_path(output_path: Path) -> Path:
    """Beside the answers: docs.answers.parquet -> docs.report.html, mine.jsonl -> mine.report.html."""
    return output_path.with_name(f"{output_path.stem.removesuffix('.answers')}.report.html")


def write_run_report(store: Store, job_id: str, path: Path) -> None:
    """The job's report after a run that finished or was stopped (what is done so far). A file there that is
    not a batchrun report is the user's and stays; a report that cannot be written costs the run nothing."""
    if path.exists() and not is_report(path):
        log.warning("the report is not written: %s exists and is not a batchrun report (batchrun report -o FILE "
                    "writes one elsewhere)", path)
        return
    try:
        write_report(store, job_id, path, force=True)
    except Exception as error:  # noqa: BLE001 - the answers are in; a report is a view of them
        log.warning("could not write the report %s: %s (batchrun report %s writes it)", path, error, job_id)
