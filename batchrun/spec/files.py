"""A spec file's rows as Python values: JSONL lines, the items of a JSON array, CSV or TSV records, Parquet rows,
with the file-level refusals. A text spec may be compressed (jobs.jsonl.gz). No torch.

read.py checks what the rows say; this module only reads them, numbered the way messages name them.
"""
from __future__ import annotations

import bz2
import csv
import difflib
import gzip
import hashlib
import io
import json
import lzma
import re
import shlex
import zlib
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


# A spec's format by its name's last suffix (any case). A text spec may be compressed, named by one more suffix
# (jobs.csv.gz); Parquet compresses its own columns.
SPEC_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
                ".parquet": "parquet"}
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".bz2": "bzip2", ".xz": "xz"}
_UTF8_BOM = b"\xef\xbb\xbf"  # as Windows editors and Excel's "CSV UTF-8" write it


def spec_format(path: Path) -> tuple[str, str | None]:
    """(format, compression or None) as the file's name says: jobs.jsonl, jobs.csv.gz, jobs.parquet."""
    suffixes = [suffix.lower() for suffix in path.suffixes]
    compression = COMPRESSED_SUFFIXES.get(suffixes[-1]) if suffixes else None
    named = suffixes[-2:] if compression else suffixes[-1:]
    found = SPEC_FORMATS.get(named[0]) if len(named) == (2 if compression else 1) else None
    if found is None or (found == "parquet" and compression):
        given = "".join(named) or "(no extension)"
        raise SpecError([f"{path}: unsupported spec file type {given!r}; use {', '.join(SPEC_FORMATS)} (all but "
                         f".parquet also compressed: {', '.join(COMPRESSED_SUFFIXES)})"])
    return found, compression


def decompressed(data: bytes, compression: str | None, shown: str) -> bytes:
    """A text spec's bytes, decompressed as its name says (`compression`, or None: the bytes as they are)."""
    if compression is None:
        return data
    magic = next(pattern for pattern, name, _ in _COMPRESSIONS if name == compression)
    if not re.match(magic, data):
        raise SpecError([f"{shown}: not {compression}-compressed, as its name says; name the file for what it "
                         f"holds ({Path(shown).stem} if it is plain text)"])
    try:
        if compression == "zstd":  # the standard library reads zstd only from Python 3.14; pyarrow ships it
            import pyarrow

            return pyarrow.input_stream(pyarrow.py_buffer(data), compression="zstd").read()
        return {"gzip": gzip, "bzip2": bz2, "xz": lzma}[compression].decompress(data)
    except (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error) as error:  # pyarrow's are OSErrors too
        raise SpecError([f"{shown}: cannot decompress the file ({compression}: {error}); is it cut short or "
                         "damaged?"]) from None


def jsonl_rows(data: bytes, shown: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value or RowProblem) for each non-blank line; line numbers count blank lines."""
    _refuse_compressed_or_wide_text(data, shown, ".jsonl")
    data = data.removeprefix(_UTF8_BOM)
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
            yield number, RowProblem(_malformed(text, error, one_per_line=True))
        except RecursionError:
            yield number, RowProblem("malformed JSON: nested too deeply")
        except ValueError as error:  # an integer literal beyond Python's digit limit; drop the sys.* advice
            yield number, RowProblem(f"malformed JSON: {str(error).split(';')[0]}")


_ONE_OBJECT_A_LINE = "each line is one JSON object, with nothing between lines"
_ESCAPES = {"\t": ("a tab", "\\t"), "\n": ("a line break", "\\n"), "\r": ("a carriage return", "\\r")}


def _malformed(text: str, error: json.JSONDecodeError, *, one_per_line: bool) -> str:
    """The reason for a JSON error: json's own words, or what the slip most likely is when it is a common one."""
    hint = _slip(text, error, one_per_line)
    if hint is None:
        return f"malformed JSON: {error.msg} (column {error.colno})"
    return f"malformed JSON (column {error.colno}): {hint}"


def _slip(text: str, error: json.JSONDecodeError, one_per_line: bool) -> str | None:
    """The slips people make writing JSON by hand or with print(): commas between lines or before a closing brace,
    single quotes, Python's True/None, bare keys, raw tabs and backslashes, unescaped quotes."""
    at, before, message = text[error.pos:], text[: error.pos].rstrip(), error.msg
    if message == "Extra data":
        rest = at.strip()
        if rest == ",":
            return f"a comma after the closing brace? {_ONE_OBJECT_A_LINE}"
        if rest.startswith(("{", ",")):
            return f"a second object on the same line? {_ONE_OBJECT_A_LINE}"
        return f"more text after the object ends ({show(rest, 20)})? {_ONE_OBJECT_A_LINE}"
    if message.startswith("Expecting property name") or message == "Expecting value":
        if at.startswith(("}", "]")) and before.endswith(","):
            closing = "brace" if at.startswith("}") else "bracket"
            return f"a comma before the closing {closing}? JSON allows no comma after the last item"
        if at.startswith("'"):
            return "single quotes? JSON strings and keys take double quotes (a Python dict's repr is not JSON)"
        bare_key = re.match(r"(\w+)\s*:", at) if message.startswith("Expecting property name") else None
        if bare_key:
            return f'a key without double quotes? JSON writes "{bare_key[1]}": ...'
        literal = re.match(r"(True|False|None|undefined)\b", at)
        if literal:
            return f"{literal[1]} is not JSON; write true, false or null (lowercase)"
        if one_per_line and not before and at.startswith(("//", "#", "/*")):
            return "a comment? JSON has none; remove the line"
    if message.startswith("Unterminated string") and one_per_line:
        return "the line ends inside a string; a line break inside a text is written \\n (each row is one line)"
    if message.startswith("Invalid control character") and at:
        name, escape = _ESCAPES.get(at[0], (f"control character U+{ord(at[0]):04X}", f"\\u{ord(at[0]):04x}"))
        return f"{name} inside a string; JSON writes it escaped, as {escape}"
    if message.startswith("Invalid \\escape"):
        return "a backslash inside a string starts an escape in JSON; write \\\\ for one backslash"
    if message.startswith("Expecting ',' delimiter") and before.endswith('"') and at[:1].isalnum():
        return 'a double quote inside a string? JSON writes it as \\"'
    return None


def holds_json_array(data: bytes) -> bool:
    """Whether a JSON spec is one JSON array (as json.dump of a list, or pandas' to_json, writes it)."""
    return re.match(rb"\s*\[", data.removeprefix(_UTF8_BOM)) is not None


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def json_array_rows(data: bytes, shown: str) -> Iterator[tuple[int, object]]:
    """(1-based item number, parsed value or RowProblem) for each item of a file holding one JSON array. A malformed
    item ends the reading (the items after it cannot be told apart): one message, naming its line."""
    text = _utf8_text(data.removeprefix(_UTF8_BOM), shown)
    doubled: list[str] = []
    decoder = json.JSONDecoder(object_pairs_hook=lambda pairs: _noting_doubled_keys(pairs, doubled))
    position, number = text.index("[") + 1, 0
    while True:
        position = _JSON_SPACE.match(text, position).end()
        if number == 0 and text.startswith("]", position):
            break  # the empty array
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as error:
            reason = _malformed(text, error, one_per_line=False)
            raise SpecError([f"{shown}:line {error.lineno}: item {number + 1} of the JSON array: {reason}"]) from None
        except (RecursionError, ValueError) as error:  # nested too deeply; an integer beyond Python's digit limit
            why = "nested too deeply" if isinstance(error, RecursionError) else str(error).split(";")[0]
            raise SpecError([f"{shown}: item {number + 1} of the JSON array: malformed JSON: {why}"]) from None
        number += 1
        yield number, RowProblem(f"key {show(doubled[0])} appears twice") if doubled else value
        doubled.clear()
        position = _JSON_SPACE.match(text, position).end()
        if text.startswith("]", position):
            break
        if not text.startswith(",", position):
            found = "the file ends" if position == len(text) else f"{show(text[position:position + 20])} follows"
            raise SpecError([f"{shown}:line {_line_at(text, position)}: {found} after item {number} of the JSON "
                             "array, where a comma or ']' belongs"])
        position += 1
    after = _JSON_SPACE.match(text, position + 1).end()
    if after < len(text):
        raise SpecError([f"{shown}:line {_line_at(text, after)}: more data after the JSON array ends; a JSON spec is "
                         "one array of objects, or one object a line (JSONL)"])


def _line_at(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _noting_doubled_keys(pairs: list[tuple[str, object]], doubled: list[str]) -> dict:
    """As _unique_keys, but noting the doubled key: raising inside raw_decode would lose where the item ends."""
    row = dict(pairs)
    if len(row) != len(pairs):
        keys = [key for key, _ in pairs]
        doubled.append(next(key for key in keys if keys.count(key) > 1))
    return row


def _utf8_text(data: bytes, shown: str) -> str:
    """A whole file's text; bytes that are not UTF-8 refuse it, naming the first one's line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise SpecError([f"{shown}:line {line}: not valid UTF-8 (byte 0x{data[error.start]:02x}); re-save the file "
                         "as UTF-8"]) from None


# Magic bytes of compressed files and the command that writes them out as text (gzip files need not end in .gz).
_COMPRESSIONS = ((rb"\x1f\x8b", "gzip", "gunzip -c"), (rb"\x28\xb5\x2f\xfd", "zstd", "zstd -dc"),
                 (rb"\xfd7zXZ\x00", "xz", "xz -dc"), (rb"BZh[1-9]1AY&SY", "bzip2", "bzip2 -dc"))
# Byte-order marks of wide encodings, the four-byte UTF-32 ones before the UTF-16 ones they begin with.
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
              (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)"))


def _refuse_compressed_or_wide_text(data: bytes, shown: str, suffix: str) -> None:
    """One message for the whole file: read as UTF-8 lines, such a file fails on every line, naming a byte.
    `suffix`: the plain file's, for the command that writes one."""
    for magic, name, command in _COMPRESSIONS:
        if re.match(magic, data):
            raise SpecError([f"{shown}: the file is {name}-compressed; decompress it first "
                             f"({command} {shlex.quote(shown)} > plain{suffix})"])
    for mark, encoding in _WIDE_BOMS:
        if data.startswith(mark):
            convert = f"iconv -f {encoding.split()[0]} -t UTF-8 {shlex.quote(shown)} > utf8{suffix}"
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
    _refuse_compressed_or_wide_text(data, shown, suffix)
    records = _csv_records(_utf8_text(data.removeprefix(_UTF8_BOM), shown), shown, delimiter)
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
            return json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as duplicate:
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
