"""A damaged progress database: how much of each job is still readable (`batchrun db check`), and a new database
holding every readable job, row, run, pass and partial-token record (`batchrun db salvage`).

SQLite's own recovery (the shell's `.recover`) is not reachable from Python, so each table is read through its rowid
b-tree range by range: a read that meets a damaged page stops there, the same range is then read from its other end,
and what lies between is split in two until the unreadable part is as small as the damage. One bad page costs the
records on it, not the table. The damaged file is opened read-only and never written.
"""
from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from batchrun.errors import OutputRefused
from batchrun.host import HOST
from batchrun.store.database import Store
from batchrun.store.errors import StoreError
from batchrun.store.files import SQLITE_MAGIC

# Copied in this order: a record of another table is kept only where its job's record was read.
TABLES = ("jobs", "rows", "runs", "partial", "passes")
MIN_ROWID = -(1 << 63)
LARGEST_PROBE = 1 << 62
_AFFINITY_TYPES = {"INTEGER": (int,), "TEXT": (str,), "FLOAT": (float, int), "REAL": (float, int)}


class DatabaseUnreadable(StoreError):
    """Nothing of the database can be read: no such file, not a SQLite file, or its schema page is damaged."""


@dataclass
class TableRead:
    """What reading one table found: records kept, records read but unusable, and rowid spans no read got through."""
    records: int = 0
    rejected: int = 0  # read, but with undecodable text, bad JSON or values of the wrong type
    orphaned: int = 0  # read, but their job's own record was not
    unreadable: list[tuple[int, int]] = field(default_factory=list)  # (first, last) rowid, inclusive
    unreachable_after: int | None = None  # records past this rowid could not be reached at all
    missing: bool = False  # not in this database's schema (made by an older batchrun)

    def unreadable_rowids(self) -> int:
        return sum(last - first + 1 for first, last in self.unreadable)


@dataclass
class JobFound:
    id: str
    spec_path: str
    state: str
    rows_total: int
    rows_readable: int = 0
    rows_finished: int = 0  # answered or errored, among the readable
    partial_rows: int = 0
    runs: int = 0

    @property
    def rows_lost(self) -> int:
        return max(self.rows_total - self.rows_readable, 0)


@dataclass
class DatabaseCheck:
    path: str
    integrity: list[str]  # SQLite's integrity check messages; ["ok"] for a sound file
    integrity_error: str | None  # why SQLite could not finish its check
    jobs: list[JobFound]
    tables: dict[str, TableRead]
    orphaned_jobs: dict[str, int]  # job id -> records found whose job record is unreadable
    output: str | None = None  # the salvaged database, for a salvage

    @property
    def ok(self) -> bool:
        return self.integrity == ["ok"] and not any(
            table.unreadable or table.rejected or table.unreachable_after is not None for table in self.tables.values())

    def to_json(self) -> dict:
        found = asdict(self)
        found["ok"] = self.ok
        found["jobs"] = [{**asdict(job), "rows_lost": job.rows_lost} for job in self.jobs]
        for name, table in self.tables.items():
            found["tables"][name]["unreadable_rowids"] = table.unreadable_rowids()
        return found


def check_database(path: Path, *, quick: bool = False) -> DatabaseCheck:
    """SQLite's integrity check (quick_check with `quick`) and, table by table, what is readable."""
    conn = _open_damaged(path)
    try:
        integrity, error = _integrity(conn, quick)
        return _read_all(conn, path, integrity, error, sink=None)
    finally:
        conn.close()


def salvage_database(path: Path, output: Path) -> DatabaseCheck:
    """Copy every readable record of `path` into a new database at `output` (fresh migrations); `path` is read-only
    to this. The new file appears only once complete."""
    path, output = Path(path), Path(output)
    _check_salvage_output(path, output)
    conn = _open_damaged(path)
    temp = output.with_name(f".{output.name}.salvage-{HOST}-{os.getpid()}")
    try:
        Store(temp).close()  # the schema, by the migrations
        target = sqlite3.connect(str(temp), isolation_level=None)
        try:
            target.execute("BEGIN IMMEDIATE")
            found = _read_all(conn, path, *_integrity(conn, quick=True), sink=_Inserter(target))
            _mark_incomplete_jobs(target, found.jobs)
            target.execute("COMMIT")
            target.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            target.close()
        os.replace(temp, output)
    except (sqlite3.Error, OSError) as error:
        raise StoreError(f"could not write the salvaged database {output}: {error}; {path} is unchanged") from error
    finally:
        conn.close()
        for leftover in (temp, *(temp.with_name(temp.name + suffix) for suffix in ("-wal", "-shm"))):
            leftover.unlink(missing_ok=True)
    found.output = str(output)
    return found


def _check_salvage_output(path: Path, output: Path) -> None:
    if not path.is_file():
        raise DatabaseUnreadable(f"no database at {path}")
    siblings = [output.with_name(output.name + suffix) for suffix in ("", "-wal", "-shm")]
    if output.resolve() in [path.resolve().with_name(path.name + s) for s in ("", "-wal", "-shm", "-journal")]:
        raise OutputRefused(f"{output} is the damaged database itself; name a new file for the salvaged copy")
    existing = [str(sibling) for sibling in siblings if sibling.exists()]
    if existing:
        raise OutputRefused(f"{', '.join(existing)} already exists; name a new file for the salvaged copy "
                            "(nothing is overwritten)")


def _open_damaged(path: Path) -> sqlite3.Connection:
    """A read-only connection that tolerates a truncated file (writable_schema lets SQLite read past a page count
    larger than the file) and hands text back as bytes, decoded by the reader so undecodable text rejects one record
    instead of stopping the read."""
    path = Path(path)
    if not path.is_file():
        raise DatabaseUnreadable(f"no database at {path}")
    with open(path, "rb") as handle:
        if handle.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            raise DatabaseUnreadable(f"{path} is not a SQLite database: it does not begin as one does (a database "
                                     "whose first bytes were overwritten has nothing left that finds its tables); "
                                     "pass the progress database as --db")
    uri = path.resolve().as_uri()
    conn = sqlite3.connect(f"{uri}?mode=ro", uri=True, isolation_level=None)
    try:
        conn.execute("PRAGMA writable_schema=ON")
        conn.execute("select count(*) from sqlite_master").fetchone()
    except sqlite3.OperationalError as error:
        if getattr(error, "sqlite_errorname", None) not in ("SQLITE_CANTOPEN", "SQLITE_READONLY"):
            raise DatabaseUnreadable(f"could not read {path}: {error}") from error
        # A read-only directory without the -shm file SQLite needs for WAL: read the main file alone.
        conn.close()
        conn = sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)
        conn.execute("PRAGMA writable_schema=ON")
    except sqlite3.DatabaseError:
        pass  # a damaged schema page: said by _table_columns, which needs it
    conn.text_factory = bytes
    return conn


def _sqlite3_recover(path: Path) -> str:
    return (f"The sqlite3 shell may still recover rows: `sqlite3 {path} .recover | sqlite3 "
            f"{path.with_name(path.stem + '.recovered.db')}`")


def _integrity(conn: sqlite3.Connection, quick: bool) -> tuple[list[str], str | None]:
    pragma = "quick_check(100)" if quick else "integrity_check(100)"
    try:
        messages = [_text(message) for (message,) in conn.execute(f"PRAGMA {pragma}")]
    except sqlite3.DatabaseError as error:
        return [], str(error)
    return messages, None


def _read_all(conn: sqlite3.Connection, path: Path, integrity: list[str], integrity_error: str | None,
              sink: _Inserter | None) -> DatabaseCheck:
    columns = _table_columns(conn, path)
    tables = {name: TableRead(missing=name not in columns) for name in TABLES}
    jobs: dict[str, JobFound] = {}
    orphans: dict[str, int] = {}
    for name in TABLES:
        if name not in columns:
            continue
        keep = _record_filter(name, columns[name], tables[name], jobs, orphans)
        read_table(conn, name, list(columns[name]), tables[name],
                   lambda record, name=name, keep=keep: _take(record, name, keep, sink, tables[name]))
    return DatabaseCheck(str(path), integrity, integrity_error, list(jobs.values()), tables, orphans)


def _table_columns(conn: sqlite3.Connection, path: Path) -> dict[str, dict[str, str]]:
    """Table -> {column: declared type} of the tables this module copies, from the damaged file's schema."""
    try:
        names = {_text(name) for (name,) in conn.execute("select name from sqlite_master where type = 'table'")}
        return {table: {_text(row[1]): _text(row[2]).upper() for row in conn.execute(f"PRAGMA table_info([{table}])")}
                for table in TABLES if table in names}
    except sqlite3.DatabaseError as error:
        raise DatabaseUnreadable(f"{path}: SQLite cannot read the schema (the list of tables on its first page): "
                                 f"{error}. Nothing can be found without it. {_sqlite3_recover(path)}") from error


def read_table(conn: sqlite3.Connection, table: str, columns: list[str], found: TableRead,
               take: Callable[[dict], None]) -> None:
    """Hand every readable record of `table` (a dict with its rowid) to `take`, recording the unreadable spans."""
    last, reached_end = _last_rowid(conn, table)
    if not reached_end:
        found.unreachable_after = last or 0
    if last is None:
        return
    select = f"select rowid, {', '.join(f'[{c}]' for c in columns)} from [{table}] where "
    names = ["rowid", *columns]
    spans = [(MIN_ROWID, last)]  # first and last rowid, inclusive
    while spans:
        low, high = spans.pop()
        if low == high:  # a point lookup: no step to a neighbouring page that may be the damaged one
            try:
                record = conn.execute(select + "rowid = ?", (low,)).fetchone()
            except sqlite3.DatabaseError:
                found.unreadable.append((low, low))
                continue
            if record is not None:
                take(dict(zip(names, record)))
            continue
        between = select + "rowid >= ? and rowid <= ? order by rowid"
        first_bad = _scan(conn, between, (low, high), names, take, ascending=True)
        if first_bad is None:
            continue
        last_bad = _scan(conn, between + " desc", (first_bad, high), names, take, ascending=False)
        if last_bad is None or last_bad < first_bad:
            continue
        middle = (first_bad + last_bad) // 2
        spans += [(first_bad, middle), (middle + 1, last_bad)]
    found.unreadable = _merged(found.unreadable)


def _scan(conn: sqlite3.Connection, sql: str, span: tuple[int, int], names: list[str], take: Callable[[dict], None],
          *, ascending: bool) -> int | None:
    """Read `span` (first and last rowid) one way until a damaged page stops the read: the first rowid, counting
    from where the read began, that it did not hand over; None when it read the span to its end. Python's cursor
    steps one record ahead, so the record before the damage is not handed over either: the caller reads it again."""
    low, high = span
    reached = low - 1 if ascending else high + 1
    try:
        for record in conn.execute(sql, span):
            reached = record[0]
            take(dict(zip(names, record)))
    except sqlite3.DatabaseError:
        return reached + 1 if ascending else reached - 1
    return None


def _last_rowid(conn: sqlite3.Connection, table: str) -> tuple[int | None, bool]:
    """(the largest rowid to read up to, whether that is the table's end): max(rowid) where the b-tree's right edge
    reads; else probed at doubling rowids up to the first probe that reads past the end. Where every probe past some
    rowid fails, the records beyond the last one seen cannot be reached."""
    try:
        return conn.execute(f"select max(rowid) from [{table}]").fetchone()[0], True
    except sqlite3.DatabaseError:
        pass
    probe, seen = 1, None
    while probe <= LARGEST_PROBE:
        try:
            found = conn.execute(f"select rowid from [{table}] where rowid >= ? order by rowid limit 1",
                                 (probe,)).fetchone()
        except sqlite3.DatabaseError:
            found = ()
        if found is None:  # a read past the end, through pages that read
            return probe, True
        if found:
            seen = found[0]
        probe *= 2
    return seen, False


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    return merged


def _record_filter(table: str, columns: dict[str, str], read: TableRead, jobs: dict[str, JobFound],
                   orphans: dict[str, int]) -> Callable[[dict], bool]:
    """Whether a record read from `table` is kept, counting it into its job's figures."""

    def keep(record: dict) -> bool:
        if not _well_formed(record, columns):
            read.rejected += 1
            return False
        if table == "jobs":
            jobs[record["id"]] = JobFound(record["id"], record.get("spec_path") or "", record.get("state") or "",
                                          record.get("total_rows") or 0)
            return True
        job = jobs.get(record.get("job_id"))
        if job is None:
            read.orphaned += 1
            orphans[str(record.get("job_id"))] = orphans.get(str(record.get("job_id")), 0) + 1
            return False
        if table == "rows":
            job.rows_readable += 1
            job.rows_finished += record.get("state") != "pending"
        elif table == "partial":
            job.partial_rows += 1
        elif table == "runs":
            job.runs += 1
        return True

    return keep


def _well_formed(record: dict, columns: dict[str, str]) -> bool:
    """Text decodes as UTF-8 (in place), JSON columns parse, and each value fits its column's declared type."""
    for name, value in record.items():
        if isinstance(value, bytes):
            try:
                value = record[name] = value.decode("utf-8")
            except UnicodeDecodeError:
                return False
        if value is None or name == "rowid":
            continue
        if not isinstance(value, _AFFINITY_TYPES.get(columns.get(name, ""), (object,))):
            return False
        if name.endswith("_json"):
            try:
                json.loads(value)
            except ValueError:
                return False
    return True


def _take(record: dict, table: str, keep: Callable[[dict], bool], sink: _Inserter | None, read: TableRead) -> None:
    if not keep(record):
        return
    if sink is not None and not sink.insert(table, record):
        read.rejected += 1
        return
    read.records += 1


class _Inserter:
    """Records into the new database's tables, the columns both schemas have, each record's rowid kept (the order
    `jobs` lists by)."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.columns = {table: {row[1] for row in conn.execute(f"PRAGMA table_info([{table}])")} for table in TABLES}

    def insert(self, table: str, record: dict) -> bool:
        names = ["rowid", *(name for name in record if name in self.columns[table])]
        try:
            self.conn.execute(f"insert into [{table}] ({', '.join(f'[{n}]' for n in names)}) "
                              f"values ({', '.join('?' for _ in names)})", [record[name] for name in names])
        except sqlite3.IntegrityError:  # a NOT NULL column read empty, a key read twice
            return False
        return True


def _mark_incomplete_jobs(conn: sqlite3.Connection, jobs: list[JobFound]) -> None:
    """A job that lost rows is no longer done: its next run records them again and computes them."""
    for job in jobs:
        if job.rows_lost and job.state == "done":
            conn.execute("update jobs set state = 'interrupted' where id = ?", (job.id,))


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def describe_check(found: DatabaseCheck) -> Iterator[str]:
    """The check (or salvage) as lines a person reads: SQLite's verdict, then each job, then each table's losses."""
    if found.integrity_error:
        yield f"integrity  SQLite could not finish its check: {found.integrity_error}"
    elif found.integrity:
        shown = found.integrity[:5]
        more = len(found.integrity) - len(shown)
        yield "integrity  " + "; ".join(shown) + (f" (and {more} more)" if more > 0 else "")
    for job in found.jobs:
        lost = f", {job.rows_lost} lost" if job.rows_lost else ""
        yield (f"job {job.id}  {job.rows_readable} of {job.rows_total} rows readable{lost} ({job.rows_finished} "
               f"finished); {job.partial_rows} partial, {job.runs} runs  {job.spec_path}")
    for job_id, count in found.orphaned_jobs.items():
        yield f"job {job_id}  its own record is unreadable: {count} of its records skipped"
    for name, table in found.tables.items():
        if table.missing:
            continue
        losses = []
        if table.unreadable:
            losses.append(f"{table.unreadable_rowids()} rowids unreadable ({_spans(table.unreadable)})")
        if table.unreachable_after is not None:
            losses.append(f"records past rowid {table.unreachable_after} unreachable")
        if table.rejected:
            losses.append(f"{table.rejected} records read but unusable")
        yield f"table {name}: {table.records} records readable" + ("; " + ", ".join(losses) if losses else "")


def _spans(spans: list[tuple[int, int]]) -> str:
    shown = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans[:4])
    return shown + (f", and {len(spans) - 4} more spans" if len(spans) > 4 else "")
