"""The tabular spec files: Parquet rows and CSV or TSV records as Python values, their columns chosen alike (the
template's and the id's in corpus mode, else every column a request row may have). No torch.

read.py checks what the rows say; this module only reads them, numbered the way messages name them.
"""
from __future__ import annotations

import csv
import difflib
import io
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from batchrun.spec.files import (UTF8_BOM, DuplicateKey, refuse_compressed_or_wide_text, show, unique_keys,
                                 utf8_text)
from batchrun.spec.template import RowProblem, SpecError, template_columns

_PARQUET_BATCH_ROWS = 8192
_PANDAS_INDEX_NAME = re.compile(r"__index_level_\d+__")


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
        columns = _columns_to_read(schema.names, _pandas_index(schema.metadata), shown, template, id_column,
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


def _columns_to_read(names: list[str], pandas_index: set[str], shown: str, template, id_column: str | None,
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
    if "*" in corpus_settings:  # --keep-columns '*': every column goes to the output
        return None
    columns = template_columns(template)
    if id_column and id_column not in columns:
        columns.append(id_column)
    for name in columns:
        if name not in names:
            named_by = "id_column" if name == id_column else "the template"
            raise SpecError([f"{shown}: no column {show(name)}, which {named_by} names "
                             f"(columns: {', '.join(names) or 'none'})"])
    return columns + [name for name in corpus_settings if name in names and name not in columns]


# A CSV or TSV cell is text. A setting whose value is a list or an object is written in its cell as JSON text (the
# example shown when it is not); a stop cell not starting with "[" is one stop string.
_JSON_CELLS = {"choices": '["yes", "no"]', "stop": '["\\n", "END"]',
               "messages": '[{"role": "user", "content": "Hi"}]', "body": '{"messages": [...]}',
               "metadata": '{"source": "web"}'}
_INTEGER_CELLS = ("max_new_tokens",)
_ID_CELLS = ("id", "custom_id")
# "007" and "+7" stay text (zip codes, account numbers); 19 digits at most, as a 64-bit integer has
_CANONICAL_INTEGER = re.compile(r"-?(0|[1-9][0-9]{0,18})")
_CSV_CELL_LIMIT = 2**31 - 1  # a cell may hold a whole document, past the csv module's default 128 KiB


def csv_rows(data: bytes, shown: str, delimiter: str, template, id_column: str | None, known_keys: Sequence[str], *,
             corpus_settings: Sequence[str] = ()) -> Iterator[tuple[int, object]]:
    """(line number, row dict or RowProblem) for each record of a CSV or TSV file whose first row names the columns.
    The header is line 1 and a record holding a quoted line break is named by its first line. Columns are chosen as
    in a Parquet spec (`template`, `id_column`, `known_keys`, `corpus_settings` as there); an empty cell is None."""
    suffix = ".csv" if delimiter == "," else ".tsv"
    refuse_compressed_or_wide_text(data, shown, suffix)
    records = _csv_records(utf8_text(data.removeprefix(UTF8_BOM), shown), shown, delimiter)
    if not records:
        return
    names = [name.strip() for name in records[0][1]]
    index = {""} if names[0] == "" else set()  # pandas' to_csv writes its index first, in a column without a name
    try:
        columns = _columns_to_read(names, index, shown, template, id_column, known_keys, corpus_settings) or names
    except SpecError:
        _refuse_other_separator(names, f"{shown}:line {records[0][0]}", delimiter)  # the likelier reason
        raise
    positions = [names.index(name) for name in columns]
    ids = _ID_CELLS if template is None else (id_column,) if id_column else ()
    settings = tuple(known_keys if template is None else corpus_settings)
    for line, record in records[1:]:
        if not any(cell.strip() for cell in record):
            continue  # a row of empty cells, as spreadsheets write below the data, is nothing, as a blank line is
        if len(record) != len(names):
            yield line, RowProblem(_cell_count_problem(len(record), len(names), delimiter))
            continue
        try:
            yield line, {name: _cell_value(name, record[at], ids, settings) for name, at in zip(columns, positions)}
        except RowProblem as problem:
            yield line, problem


def _csv_records(text: str, shown: str, delimiter: str) -> list[tuple[int, list[str]]]:
    """(first line, cells) of each non-blank record, quoted as Excel, pandas and Python's csv write: a cell in double
    quotes may hold the separator, line breaks and doubled quotes. Malformed quoting refuses the file, naming the line
    its record starts on (the records after it cannot be told apart)."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
    records, line = [], 1
    limit = csv.field_size_limit(_CSV_CELL_LIMIT)
    try:
        for cells in reader:
            if cells:
                records.append((line, cells))
            line = reader.line_num + 1
    except csv.Error as error:
        if "unexpected end of data" in str(error):
            reason = "a quoted cell opens here and never closes (a double quote without its closing one)"
        elif "expected after" in str(error):
            reason = ("text follows a quoted cell's closing quote; inside a quoted cell, write a double quote "
                      "twice (\"\")")
        else:
            reason = f"not readable as {'CSV' if delimiter == ',' else 'TSV'} ({error})"
        raise SpecError([f"{shown}:line {line}: {reason}"]) from None
    finally:
        csv.field_size_limit(limit)
    return records


def _cell_value(name: str, text: str, ids: Sequence[str], settings: Sequence[str]) -> object:
    """A cell as the value a JSONL row would hold: None when empty, an id that spells an integer as that integer,
    a number setting as a number, a list or object setting from its JSON text; anything else as its text."""
    if text == "":
        return None
    if name in ids:
        number = int(text) if _CANONICAL_INTEGER.fullmatch(text) else None
        return number if number is not None and -(2**63) <= number < 2**63 else text
    if name not in settings:
        return text
    if name in _INTEGER_CELLS:
        if re.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*", text):
            return int(text)
        raise RowProblem(f"{name} must be a positive integer, got {show(text)}")
    if name in _JSON_CELLS and (name != "stop" or text.lstrip().startswith("[")):
        try:
            return json.loads(text, object_pairs_hook=unique_keys)
        except DuplicateKey as duplicate:
            raise RowProblem(f"{name}: key {show(duplicate.args[0])} appears twice") from None
        except (ValueError, RecursionError) as error:
            why = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply or too long a number"
            raise RowProblem(f"{name} is not JSON text ({why}); in a cell it is written as JSON, "
                             f"e.g. {_JSON_CELLS[name]}") from None
    return text


def _cell_count_problem(count: int, expected: int, delimiter: str) -> str:
    separator = "comma" if delimiter == "," else "tab"
    hint = f" (a {separator} inside a cell needs the cell in double quotes)" if count > expected else ""
    return f"{count} cell{'' if count == 1 else 's'} where the header names {expected} columns{hint}"


def _refuse_other_separator(names: list[str], where: str, delimiter: str) -> None:
    """A header read as one column that another separator would split: semicolons (Excel in many locales), or a
    tab-separated file named .csv (or the other way round)."""
    if len(names) != 1:
        return
    expected = "commas (.csv)" if delimiter == "," else "tabs (.tsv)"
    for separator, what in ((";", "semicolons"), ("\t", "tabs"), (",", "commas"), ("|", "vertical bars")):
        if separator != delimiter and separator in names[0]:
            raise SpecError([f"{where}: the header is one column holding {what}; this file type separates "
                             f"cells with {expected}"])
