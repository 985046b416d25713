"""`batchrun db`: check the progress database, or salvage what is readable of a damaged one."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from batchrun.host import default_db_path
from batchrun.store import check_database, describe_check, salvage_database


@click.group()
def db():
    """Check the progress database, or copy what is readable of a damaged one into a new one."""


def _database_path(db_path: Path | None) -> Path:
    return Path(db_path or default_db_path(create=False))


@db.command("check")
@click.option("--db", "db_path", type=click.Path(path_type=Path),
              help="Progress database (default: $BATCHRUN_HOME/batchrun.db).")
@click.option("--quick", is_flag=True, help="SQLite's quick_check instead of the full integrity_check.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def db_check(db_path, quick, as_json):
    """SQLite's integrity check, and how many rows of each job are readable. Reads only; exit code 1 when damaged."""
    path = _database_path(db_path)
    found = check_database(path, quick=quick)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
    else:
        click.echo(f"{path}: {'sound' if found.ok else 'DAMAGED'}")
        for line in describe_check(found):
            click.echo(f"  {line}")
        if not found.ok:
            salvaged = path.with_name(f"{path.stem}.salvaged{path.suffix or '.db'}")
            click.echo(f"copy what is readable into a new database: batchrun db salvage --db {path} -o {salvaged}")
    if not found.ok:
        sys.exit(1)  # scripts tell a damaged database from a sound one by the exit code


@db.command("salvage")
@click.option("--db", "db_path", type=click.Path(path_type=Path),
              help="The damaged database (default: $BATCHRUN_HOME/batchrun.db); only read.")
@click.option("--output", "-o", type=click.Path(path_type=Path), required=True,
              help="The new database to write; must not exist.")
@click.option("--json", "as_json", is_flag=True, help="Print what was kept and lost as JSON.")
def db_salvage(db_path, output, as_json):
    """Copy every readable job, row, run, pass and partial-token record into a new database, saying what each job
    lost. The damaged file is left as it is."""
    path = _database_path(db_path)
    found = salvage_database(path, output)
    if as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
        return
    kept = sum(job.rows_readable for job in found.jobs)
    lost = sum(job.rows_lost for job in found.jobs)
    click.echo(f"{len(found.jobs)} job(s), {kept} rows salvaged into {output}; {lost} rows lost")
    for line in describe_check(found):
        click.echo(f"  {line}")
    moves = [f"mv {path} {path}.damaged"] + [f"mv {path}{suffix} {path}.damaged{suffix}" for suffix in ("-wal", "-shm")
                                              if Path(f"{path}{suffix}").exists()]
    click.echo(f"{path} is unchanged. To use the salvaged copy in its place: {' && '.join(moves)} && mv {output} "
               f"{path}  (or pass --db {output}). A job that lost rows computes them when its spec is submitted "
               "again.")
