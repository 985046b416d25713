"""The inputs people have: CSV and TSV specs, compressed files, a JSON array, a spec piped to stdin; and the hints a
broken JSONL line gets. Each format reads to the same requests as its JSONL equivalent."""
from __future__ import annotations

import bz2
import csv
import gzip
import hashlib
import io
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner, Result

from batchrun.cli import cli
from batchrun.spec import read_spec
from tests.support import only_problem, problems_of, write_jsonl

ROWS = [
    {"id": 1, "prompt": "Review: Great, would buy again.\nSentiment?", "choices": ["positive", "negative"]},
    {"id": "007", "prompt": 'He said "stop", then left.', "max_new_tokens": 5, "stop": ["\n", "END"]},
    {"id": "r3", "prompt": "Ünïcode, tabs\tand a long line " + "x" * 300, "system": "Answer briefly."},
    {"id": 4, "messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 3},
]
COLUMNS = ["id", "prompt", "messages", "system", "choices", "max_new_tokens", "stop"]
COMPRESSIONS = {"": lambda data: data, ".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress,
                ".zst": lambda data: pa.compress(data, codec="zstd", asbytes=True)}


def delimited(rows: list[dict], delimiter: str = ",", header: list[str] = COLUMNS) -> bytes:
    """`rows` as a CSV (or TSV) file: lists and objects as JSON text, a missing key as an empty cell."""
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, delimiter=delimiter, lineterminator="\r\n")
    writer.writerow(header)
    for row in rows:
        writer.writerow([json.dumps(row[key]) if isinstance(row.get(key), (list, dict)) else row.get(key, "")
                         for key in header])
    return buffer.getvalue().encode("utf-8")


def spec_bytes(rows: list[dict], file_format: str) -> bytes:
    if file_format == "jsonl":
        return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    return delimited(rows, "\t" if file_format == "tsv" else ",")


def requests_of(path: Path, **options) -> list[tuple]:
    """What each request runs, without where it came from."""
    return [(r.index, r.id, r.messages, r.prompt, r.choices, r.max_new_tokens, r.stop)
            for r in read_spec(path, **options).requests]


# ------------------------------------------------------------------------------------- formats, compressions


@pytest.mark.parametrize("compression", list(COMPRESSIONS))
@pytest.mark.parametrize("file_format", ["jsonl", "csv", "tsv"])
def test_every_format_and_compression_reads_as_its_jsonl_equivalent(tmp_path, file_format, compression):
    plain = write_jsonl(tmp_path / "plain.jsonl", ROWS)
    path = tmp_path / f"jobs.{file_format}{compression}"
    path.write_bytes(COMPRESSIONS[compression](spec_bytes(ROWS, file_format)))
    assert requests_of(path, system="Job system") == requests_of(plain, system="Job system")
    # the job is the file as given: its own bytes' hash, compressed or not
    assert read_spec(path).content_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_compressed_and_delimited_files_name_rows_by_their_line(tmp_path):
    rows = [{"id": "a", "prompt": "one\ntwo\nthree"}, {"id": "b", "prompt": "x", "max_new_tokens": 0}]
    csv_path = tmp_path / "jobs.csv.gz"
    csv_path.write_bytes(gzip.compress(b"\n" + delimited(rows)))  # a blank line first: the header is line 2
    # a quoted cell's line breaks count: row b starts on line 6
    assert only_problem(csv_path) == f"{csv_path}:line 6: max_new_tokens must be a positive integer, got 0"
    jsonl_path = tmp_path / "jobs.jsonl.xz"
    jsonl_path.write_bytes(lzma.compress(b'{"prompt": "a"}\n\n{"prompt": 3}\n'))
    assert only_problem(jsonl_path) == f"{jsonl_path}:line 3: prompt must be a string, got an integer (3)"


def test_csv_cells_are_text_but_ids_that_spell_integers_and_token_limits(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("id,prompt,max_new_tokens,stop,system\n"
                    "12,1.50,4,END,\n"
                    "012,0xFF, 7 ,\"[\"\"\\n\"\"]\",\"\"\n"
                    "99999999999999999999,True,,,\n")
    requests = read_spec(path, system="Job").requests
    assert [(r.id, r.prompt, r.max_new_tokens, r.stop) for r in requests] == [
        (12, "1.50", 4, ("END",)), ("012", "0xFF", 7, ("\n",)), ("99999999999999999999", "True", 16, ())]
    assert [r.messages[0] for r in requests] == [("system", "Job")] * 3  # an empty cell, quoted or not, is not set


def test_csv_corpus_mode_reads_columns_as_text_and_its_settings_as_values(tmp_path):
    path = tmp_path / "corpus.csv"
    path.write_bytes(delimited([{"doc": "17", "text": "007", "choices": ["yes", "no"], "stop": "x", "n": "2.50"},
                                {"doc": "a-1", "text": "1.50", "choices": "", "stop": '["z"]', "n": ""},
                                {"doc": "18", "text": "t", "choices": "", "stop": "", "n": ""}],
                               header=["doc", "text", "choices", "stop", "n"]))
    spec = read_spec(path, template="{text} costs {stop}", id_column="doc", max_new_tokens=3, skip_invalid=True)
    # stop is data here (the template reads it), kept as text; choices is the row's setting; n is ignored
    assert [(r.id, r.prompt, r.choices, r.max_new_tokens) for r in spec.requests] == [
        (17, "007 costs x", ("yes", "no"), 0), ("a-1", '1.50 costs ["z"]', None, 3)]
    assert [(bad.location, bad.reason) for bad in spec.invalid] == [(f"{path}:4", "column 'stop' is null")]


def test_csv_as_spreadsheets_and_pandas_write_it(tmp_path):
    """A byte-order mark (Excel's CSV UTF-8), pandas' unnamed index column, rows of empty cells below the data and
    spaces around header names are read as meant."""
    path = tmp_path / "jobs.csv"
    path.write_bytes(b"\xef\xbb\xbf,id , prompt\r\n0,a,first\r\n1,b,second\r\n,,\r\n,,\r\n")
    assert [(r.id, r.prompt) for r in read_spec(path).requests] == [("a", "first"), ("b", "second")]


# ------------------------------------------------------------------------------------------ CSV refusals


@pytest.mark.parametrize(("text", "line", "reason"), [
    ("id,prompt\na,x\nb,Hello, world\n", 3,
     "3 cells where the header names 2 columns (a comma inside a cell needs the cell in double quotes)"),
    ("id,prompt\na\n", 2, "1 cell where the header names 2 columns"),
    ("prompt,max_new_tokens\nx,12.5\n", 2, "max_new_tokens must be a positive integer, got '12.5'"),
    ("prompt,choices\nx,\"yes, no\"\n", 2,
     'choices is not JSON text (Expecting value); in a cell it is written as JSON, e.g. ["yes", "no"]'),
    ("prompt,stop\nx,\"[\"\"a\"\"\"\n", 2,
     "stop is not JSON text (Expecting ',' delimiter); in a cell it is written as JSON, e.g. [\"\\n\", \"END\"]"),
])
def test_bad_csv_rows_name_the_file_and_line(tmp_path, text, line, reason):
    path = tmp_path / "jobs.csv"
    path.write_text(text)
    assert only_problem(path) == f"{path}:line {line}: {reason}"


@pytest.mark.parametrize(("data", "reason"), [
    (b'id,prompt\na,x\nb,"never closed\nc,y\n', "line 3: a quoted cell opens here and never closes"),
    (b'id,prompt\na,"quoted" then text\n', "line 2: text follows a quoted cell's closing quote"),
    (b"id,prompt\na,ok\nb,caf\xe9\n", "line 3: not valid UTF-8 (byte 0xe9); re-save the file as UTF-8"),
    (b"id;prompt\na;x\n", "line 1: the header is one column holding semicolons; this file type separates cells "
                          "with commas (.csv)"),
])
def test_unreadable_csv_is_refused_once_naming_the_line(tmp_path, data, reason):
    path = tmp_path / "jobs.csv"
    path.write_bytes(data)
    assert only_problem(path).startswith(f"{path}:{reason}")


def test_csv_columns_are_checked_as_parquet_columns_are(tmp_path):
    path = tmp_path / "jobs.csv"
    path.write_text("id,promt\na,x\n")
    assert only_problem(path) == f"{path}: unknown column 'promt' (did you mean 'prompt'?)"
    assert only_problem(path, template="{text}") == (f"{path}: no column 'text', which the template names "
                                                     "(columns: id, promt)")


# --------------------------------------------------------------------------------------- compressed files


def test_compressed_file_types_say_what_is_wrong_with_the_file(tmp_path):
    plain = tmp_path / "jobs.jsonl.gz"
    plain.write_bytes(b'{"prompt": "x"}\n')
    assert only_problem(plain) == (f"{plain}: not gzip-compressed, as its name says; name the file for what it "
                                   "holds (jobs.jsonl if it is plain text)")
    cut = tmp_path / "cut.csv.bz2"
    cut.write_bytes(bz2.compress(delimited(ROWS))[:-20])
    assert only_problem(cut).startswith(f"{cut}: cannot decompress the file (bzip2: ")
    hidden = tmp_path / "jobs.tsv"
    hidden.write_bytes(gzip.compress(delimited(ROWS, "\t")))
    assert only_problem(hidden) == f"{hidden}: the file is gzip-compressed; decompress it first " \
                                   f"(gunzip -c {hidden} > {tmp_path / 'jobs.plain.tsv'})"


def test_a_damaged_gzip_file_is_refused_as_one(tmp_path):
    """One byte flipped inside the deflate stream: zlib's own error, which is neither an OSError nor an EOFError."""
    data = bytearray(gzip.compress(delimited(ROWS * 20)))
    data[len(data) // 2] ^= 0x10
    damaged = tmp_path / "jobs.csv.gz"
    damaged.write_bytes(bytes(data))
    problem = only_problem(damaged)
    assert problem.startswith(f"{damaged}: cannot decompress the file (gzip: ") and "cut short or damaged?" in problem


@pytest.mark.parametrize(("name", "given"), [("jobs.txt", "'.txt'"), ("jobs.parquet.gz", "'.parquet.gz'"),
                                             ("jobs.gz", "'.gz'"), ("jobs", "'(no extension)'")])
def test_unsupported_file_types_list_the_supported_ones(tmp_path, name, given):
    path = tmp_path / name
    path.write_text("prompt\nx\n")
    assert only_problem(path) == (f"{path}: unsupported spec file type {given}; use .jsonl, .json, .ndjson, .csv, "
                                  ".tsv, .parquet (all but .parquet also compressed: .gz, .zst, .bz2, .xz)")


# ------------------------------------------------------------------------------------- JSON slips, arrays


@pytest.mark.parametrize(("line", "reason"), [
    ('{"prompt": "x"},', "malformed JSON (column 16): a comma after the closing brace? each line is one JSON "
                         "object, with nothing between lines"),
    ('{"prompt": "x"} {"prompt": "y"}', "malformed JSON (column 17): a second object on the same line? each line "
                                        "is one JSON object, with nothing between lines"),
    ('{"prompt": "x",}', "malformed JSON (column 16): a comma before the closing brace? JSON allows no comma after "
                         "the last item"),
    ("{'prompt': 'x'}", "malformed JSON (column 2): single quotes? JSON strings and keys take double quotes (a "
                        "Python dict's repr is not JSON)"),
    ('{prompt: "x"}', 'malformed JSON (column 2): a key without double quotes? JSON writes "prompt": ...'),
    ('{"prompt": "x", "raw": True}', "malformed JSON (column 24): True is not JSON; write true, false or null "
                                     "(lowercase)"),
    ('{"prompt": "a\tb"}', "malformed JSON (column 14): a tab inside a string; JSON writes it escaped, as \\t"),
    ('{"prompt": "C:\\Data"}', "malformed JSON (column 15): a backslash inside a string starts an escape in "
                                    "JSON; write \\\\ for one backslash"),
    ('{"prompt": "He said "hi""}', 'malformed JSON (column 22): a double quote inside a string? JSON writes it as '
                                   '\\"'),
    ('{"prompt": "first line', "malformed JSON (column 12): the line ends inside a string; a line break inside a "
                               "text is written \\n (each row is one line)"),
    ("// the reviews", "malformed JSON (column 1): a comment? JSON has none; remove the line"),
])
def test_common_json_slips_get_a_hint(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "fine"}, line])
    assert only_problem(path) == f"{path}:line 2: {reason}"


def test_a_json_array_of_objects_is_read_with_items_numbered_as_rows(tmp_path):
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(ROWS, indent=2))
    assert requests_of(path) == requests_of(write_jsonl(tmp_path / "plain.jsonl", ROWS))
    one_line = tmp_path / "pandas.json"  # pandas' to_json(orient="records") writes the array on one line
    one_line.write_text(json.dumps([{"prompt": "x"}, {"prompt": ""}, {"prompt": "y", "prompt2": 1}]))
    assert problems_of(one_line) == [f"{one_line}: row 2: prompt is empty",
                                     f"{one_line}: row 3: unknown key 'prompt2' (did you mean 'prompt'?)"]
    spec = read_spec(one_line, skip_invalid=True)
    assert [(r.id, r.location) for r in spec.requests] == [(1, f"{one_line}: row 1")]


@pytest.mark.parametrize(("text", "reason"), [
    ('[{"prompt": "x"},\n {"prompt": "y"},\n]', ":line 3: item 3 of the JSON array: malformed JSON (column 1): a "
                                                "comma before the closing bracket? JSON allows no comma after the "
                                                "last item"),
    ('[{"prompt": "x"}]\n[{"prompt": "y"}]', ":line 2: more data after the JSON array ends; a JSON spec is one array "
                                             "of objects, or one object a line (JSONL)"),
    ('[{"prompt": "x"} {"prompt": "y"}]', ":line 1: '{\"prompt\": \"y\"}]' follows after item 1 of the JSON array, "
                                          "where a comma or ']' belongs"),
    ('[{"prompt": "x"},\n', ":line 2: item 2 of the JSON array: malformed JSON: Expecting value (column 1)"),
])
def test_a_broken_json_array_is_refused_once_naming_the_line(tmp_path, text, reason):
    path = tmp_path / "jobs.json"
    path.write_text(text)
    assert only_problem(path) == f"{path}{reason}"


def test_a_doubled_key_in_an_array_item_is_that_rows_problem(tmp_path):
    path = tmp_path / "jobs.json"
    path.write_text('[{"prompt": "x"}, {"prompt": "y", "prompt": "z"}]')
    assert only_problem(path) == f"{path}: row 2: key 'prompt' appears twice"


# ------------------------------------------------------------------------------------------------- stdin


def piped(data: bytes, *args) -> Result:
    return CliRunner().invoke(cli, [str(arg) for arg in args], input=data)


def test_plan_reads_a_spec_from_stdin_and_keeps_it_by_its_hash(tmp_path, tiny_checkpoint, isolated_state):
    model = tiny_checkpoint("llama")
    data = spec_bytes(ROWS, "jsonl")
    first = piped(data, "plan", "-", "--model", model, "--json")
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    stored = Path(report["spec"])
    assert report["rows"] == len(ROWS) and stored.parent == isolated_state / "specs"
    assert stored.name == f"stdin-{hashlib.sha256(data).hexdigest()[:16]}.jsonl" and stored.read_bytes() == data
    again = json.loads(piped(data, "plan", "-", "--model", model, "--json").stdout)
    assert again["spec"] == report["spec"]  # the same input is the same file, so the same job
    as_csv = piped(gzip.compress(delimited(ROWS)), "plan", "-", "--spec-format", "csv", "--model", model, "--json")
    assert as_csv.exit_code == 0, as_csv.output
    assert json.loads(as_csv.stdout)["spec"].endswith(".csv.gz")  # compressed input is recognised


def test_broken_stdin_rows_are_named_by_the_stored_file_and_line(tmp_path, tiny_checkpoint):
    result = piped(b'{"prompt": "x"},\n', "plan", "-", "--model", tiny_checkpoint("llama"))
    assert result.exit_code == 1
    assert ".jsonl:line 1: malformed JSON (column 16): a comma after the closing brace?" in result.stderr


def test_submit_from_stdin_needs_an_output_name_and_resumes_the_same_job(tmp_path, tiny_checkpoint):
    rows = [{"id": i, "prompt": f"Say {i}.", "max_new_tokens": 2} for i in range(3)]
    data = spec_bytes(rows, "jsonl")
    refused = piped(data, "submit", "-", "--model", tiny_checkpoint("llama"))
    assert refused.exit_code == 2 and "name the answers file with -o" in refused.stderr
    args = ["submit", "-", "--model", tiny_checkpoint("llama"), "--db", tmp_path / "j.db", "--json"]
    first = piped(data, *args, "-o", tmp_path / "a.parquet")
    assert first.exit_code == 0, first.output
    second = piped(data, *args, "-o", tmp_path / "b.parquet")
    assert second.exit_code == 0, second.output
    before, after = json.loads(first.stdout), json.loads(second.stdout)
    assert after["job_id"] == before["job_id"] and before["rows_computed_now"] == 3 and after["rows_computed_now"] == 0


def test_spec_format_applies_to_stdin_only(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", ROWS)
    result = CliRunner().invoke(cli, ["plan", str(path), "--spec-format", "csv"])
    assert result.exit_code == 2 and "applies to a spec read from stdin" in result.stderr
