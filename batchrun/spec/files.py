"""A spec file's rows as Python values: JSONL lines or Parquet rows, with the file-level refusals. No torch.

spec.py checks what the rows say; this module only reads them, numbered the way messages name them.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path

from batchrun.spec.template import RowProblem, SpecError, template_columns

_PARQUET_BATCH_ROWS = 8192
_PANDAS_INDEX_NAME = re.compile(r"__index_level_\d+__")


def show(value: object, limit: int = 60) -> str:
    """A value as messages quote it: its repr, cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # integers beyond Python's str() digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind(value: object) -> str:
    """A value's JSON kind as messages name it ("an integer (5)", "a list")."""
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    described = names.get(type(value), f"a {type(value).__name__} value")
    return f"{described} ({show(value)})" if isinstance(value, (int, float)) else described


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads keeps the last of doubled keys silently; a doubled field is an error here."""
    row = dict(pairs)
    if len(row) != len(pairs):
        keys = [key for key, _ in pairs]
        raise _DuplicateKey(next(key for key in keys if keys.count(key) > 1))
    return row


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def jsonl_rows(data: bytes, shown: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value or RowProblem) for each non-blank line; line numbers count blank lines."""
    _refuse_compressed_or_wide_text(data, shown)
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as Windows editors write
    if re.match(rb"\s*\[", data):
        raise SpecError([f"{shown}: the file holds a JSON array; write one JSON object per line (JSONL)"])
    if _one_object_over_several_lines(data):
        raise SpecError([f"{shown}: the file holds JSON objects spread over several lines (pretty-printed); "
                         "write one JSON object per line (JSONL)"])
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            bad_byte = f"byte 0x{raw[error.start]:02x} at column {error.start + 1}"
            yield number, RowProblem(f"not valid UTF-8 ({bad_byte})")
            continue
        try:
            yield number, json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as duplicate:
            yield number, RowProblem(f"key {show(duplicate.args[0])} appears twice")
        except json.JSONDecodeError as error:
            yield number, RowProblem(f"malformed JSON: {error.msg} (column {error.colno})")
        except RecursionError:
            yield number, RowProblem("malformed JSON: nested too deeply")
        except ValueError as error:  # an integer literal beyond Python's digit limit; drop the sys.* advice
            yield number, RowProblem(f"malformed JSON: {str(error).split(';')[0]}")


# Magic bytes of compressed files and the command that writes them out as text (gzip files need not end in .gz).
_COMPRESSIONS = ((rb"\x1f\x8b", "gzip", "gunzip -c"), (rb"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
                 (rb"\xfd7zXZ\x00", "xz", "xz -dc"), (rb"BZh[1-9]1AY&SY", "bzip2", "bzip2 -dc"))
# Byte-order marks of wide encodings, the four-byte UTF-32 ones before the UTF-16 ones they begin with.
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
              (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)"))


def _refuse_compressed_or_wide_text(data: bytes, shown: str) -> None:
    """One message for the whole file: read as UTF-8 lines, such a file fails on every line, naming a byte."""
    for magic, name, command in _COMPRESSIONS:
        if re.match(magic, data):
            raise SpecError([f"{shown}: the file is {name}-compressed; decompress it first "
                             f"({command} {shlex.quote(shown)} > plain.jsonl)"])
    for mark, encoding in _WIDE_BOMS:
        if data.startswith(mark):
            convert = f"iconv -f {encoding.split()[0]} -t UTF-8 {shlex.quote(shown)} > utf8.jsonl"
            raise SpecError([f"{shown}: the file is {encoding} text (it starts with that byte-order mark); re-save "
                             f"it as UTF-8 ({convert})"])


def _one_object_over_several_lines(data: bytes) -> bool:
    """Pretty-printed JSON: the file's first value is an object that spans several lines (one or many objects)."""
    first = next((line for line in data.split(b"\n", 64) if line.strip()), b"")
    try:
        json.loads(first)
        return False  # a JSONL file: its first line is a value of its own
    except (ValueError, RecursionError):
        pass
    try:
        text = data.decode("utf-8")
        start = len(text) - len(text.lstrip())
        value, end = json.JSONDecoder().raw_decode(text, start)  # reads the first value only, not the whole file
    except (ValueError, RecursionError):  # also UnicodeDecodeError
        return False
    return isinstance(value, dict) and "\n" in text[start:end]


def parquet_rows(path: Path, shown: str, template, id_column: str | None, known_keys: Sequence[str], *,
                 corpus_settings: Sequence[str] = (), nan_is_null: Sequence[str] = ()) -> Iterator[tuple[int, object]]:
    """(1-based row number, row dict) for each Parquet row. In corpus mode (a parsed `template`) only the columns
    it needs, plus those of `corpus_settings` the file has; else every column, each one of `known_keys`, but
    pandas' index. A NaN in a float column of `nan_is_null` is None: Polars and pandas write a missing number so."""
    import pyarrow  # imported here so reading a JSONL spec does not pay for pyarrow's import
    import pyarrow.parquet as parquet

    try:
        reader = parquet.ParquetFile(path)
        schema = reader.schema_arrow
    except (pyarrow.ArrowException, OSError, ValueError) as error:
        raise SpecError([f"{shown}: not a readable Parquet file ({error})"]) from None
    number = 0
    try:
        columns = _parquet_columns(schema.names, _pandas_index(schema.metadata), shown, template, id_column,
                                   known_keys, corpus_settings)
        nan_columns = [field.name for field in schema if field.name in nan_is_null
                       and pyarrow.types.is_floating(field.type) and (columns is None or field.name in columns)]
        for batch in reader.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
            for row in batch.to_pylist():
                number += 1
                for name in nan_columns:
                    if row[name] != row[name]:  # only NaN differs from itself
                        row[name] = None
                yield number, row
    except SpecError:  # a ValueError too, but already worded for the user
        raise
    except (pyarrow.ArrowException, OSError, ValueError, OverflowError) as error:
        raise SpecError([f"{shown}: cannot read Parquet data after row {number} ({error})"]) from None
    finally:
        reader.close()


def _pandas_index(metadata: dict | None) -> set[str]:
    """The columns pandas' to_parquet stored its index in: named in its metadata, or `__index_level_N__`."""
    names = set()
    try:
        listed = json.loads(metadata[b"pandas"])["index_columns"]
        names = {name for name in listed if isinstance(name, str)}  # a RangeIndex is a dict, stored as no column
    except (TypeError, KeyError, ValueError, RecursionError):
        pass  # no pandas metadata (or not as pandas writes it): only the names tell
    return names


def _parquet_columns(names: list[str], pandas_index: set[str], shown: str, template, id_column: str | None,
                     known_keys: Sequence[str], corpus_settings: Sequence[str]) -> list[str] | None:
    """The columns to read (None: all), after the checks that would otherwise fail every row alike."""
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise SpecError([f"{shown}: column {show(doubled[0])} appears more than once"])
    if template is None:
        # An index the spec names (pandas' set_index("id")) is the user's column; any other is pandas' bookkeeping.
        index = {name for name in names if (name in pandas_index or _PANDAS_INDEX_NAME.fullmatch(name))
                 and name not in known_keys}
        wanted = [name for name in names if name not in index]
        unknown = [name for name in wanted if name not in known_keys]
        if unknown:
            guess = difflib.get_close_matches(unknown[0], known_keys, n=1)
            hint = f" (did you mean {guess[0]!r}?)" if guess else " (for a corpus, give a template)"
            raise SpecError([f"{shown}: unknown column {show(unknown[0])}{hint}"])
        return wanted if index else None
    columns = template_columns(template)
    if id_column and id_column not in columns:
        columns.append(id_column)
    for name in columns:
        if name not in names:
            named_by = "id_column" if name == id_column else "the template"
            raise SpecError([f"{shown}: no column {show(name)}, which {named_by} names "
                             f"(columns: {', '.join(names) or 'none'})"])
    return columns + [name for name in corpus_settings if name in names and name not in columns]
