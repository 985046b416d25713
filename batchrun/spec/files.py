"""A spec file's rows as Python values: JSONL lines and the items of a JSON array here, CSV or TSV records and
Parquet rows in tables.py; the file's format, its compression (jobs.jsonl.gz) and the file-level refusals. No torch.

read.py checks what the rows say; this module only reads them, numbered the way messages name them.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import re
import shlex
import zlib
from collections.abc import Iterator
from pathlib import Path

from batchrun.spec.template import RowProblem, SpecError


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


class DuplicateKey(Exception):
    pass


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads keeps the last of doubled keys silently; a doubled field is an error here."""
    row = dict(pairs)
    if len(row) != len(pairs):
        keys = [key for key, _ in pairs]
        raise DuplicateKey(next(key for key in keys if keys.count(key) > 1))
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
UTF8_BOM = b"\xef\xbb\xbf"  # as Windows editors and Excel's "CSV UTF-8" write it


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
    refuse_compressed_or_wide_text(data, shown, ".jsonl")
    data = data.removeprefix(UTF8_BOM)
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
            yield number, json.loads(text, object_pairs_hook=unique_keys)
        except DuplicateKey as duplicate:
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
    return re.match(rb"\s*\[", data.removeprefix(UTF8_BOM)) is not None


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def json_array_rows(data: bytes, shown: str) -> Iterator[tuple[int, object]]:
    """(1-based item number, parsed value or RowProblem) for each item of a file holding one JSON array. A malformed
    item ends the reading (the items after it cannot be told apart): one message, naming its line."""
    text = utf8_text(data.removeprefix(UTF8_BOM), shown)
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
    """As unique_keys, but noting the doubled key: raising inside raw_decode would lose where the item ends."""
    row = dict(pairs)
    if len(row) != len(pairs):
        keys = [key for key, _ in pairs]
        doubled.append(next(key for key in keys if keys.count(key) > 1))
    return row


def utf8_text(data: bytes, shown: str) -> str:
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


def refuse_compressed_or_wide_text(data: bytes, shown: str, suffix: str) -> None:
    """One message for the whole file: read as UTF-8 lines, such a file fails on every line, naming a byte.
    `suffix`: the plain file's, for the command that writes one."""
    for magic, name, command in _COMPRESSIONS:
        if re.match(magic, data):
            raise SpecError([f"{shown}: the file is {name}-compressed; decompress it first "
                             f"({command} {shlex.quote(shown)} > {_copy_beside(shown, 'plain', suffix)})"])
    for mark, encoding in _WIDE_BOMS:
        if data.startswith(mark):
            convert = (f"iconv -f {encoding.split()[0]} -t UTF-8 {shlex.quote(shown)} > "
                       f"{_copy_beside(shown, 'utf8', suffix)}")
            raise SpecError([f"{shown}: the file is {encoding} text (it starts with that byte-order mark); re-save "
                             f"it as UTF-8 ({convert})"])


def _copy_beside(shown: str, tag: str, suffix: str) -> str:
    """The file a suggested command writes the text to: beside the spec, named after it with `tag` inserted, so
    never the spec itself (the shell empties a redirect's target before the command reads its input)."""
    path = Path(shown)
    stem = path.name[: -len(suffix)] if path.name.lower().endswith(suffix) else path.stem
    return shlex.quote(str(path.with_name(f"{stem}.{tag}{suffix}")))


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
