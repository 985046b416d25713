"""Job spec files and templates that are refused: empty, missing, corrupt or of an unknown kind, bad job
settings, and templates that cannot be parsed or name a column a row lacks."""
from __future__ import annotations


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec import SpecError, read_spec
from batchrun.spec.template import Field, parse_template
from tests.support import only_problem, problems_of, write_jsonl


def test_empty_file(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b"")
    assert only_problem(path) == f"{path}: the file is empty (no requests)"


def test_file_of_blank_lines_is_empty(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_text("\n  \n\r\n")
    assert only_problem(path) == f"{path}: the file is empty (no requests)"


def test_parquet_without_rows_is_empty(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    assert only_problem(path) == f"{path}: the file is empty (no requests)"


def test_unsupported_extension_names_the_file(tmp_path):
    path = tmp_path / "jobs.xlsx"
    path.write_text("prompt\nx\n")
    assert only_problem(path) == (f"{path}: unsupported spec file type '.xlsx'; use .jsonl, .json, .ndjson, .csv, "
                                  ".tsv, .parquet (all but .parquet also compressed: .gz, .zst, .bz2, .xz)")


def test_missing_file(tmp_path):
    assert only_problem(tmp_path / "nowhere.jsonl") == f"{tmp_path / 'nowhere.jsonl'}: no such file"


def test_directory_instead_of_file(tmp_path):
    folder = tmp_path / "jobs.jsonl"
    folder.mkdir()
    assert only_problem(folder) == f"{folder}: not a regular file"


def test_corrupt_parquet_file(tmp_path):
    path = tmp_path / "jobs.parquet"
    path.write_bytes(b"not parquet at all")
    assert only_problem(path).startswith(f"{path}: not a readable Parquet file")


def test_parquet_unknown_column_is_reported_once(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"promt": ["a", "b", "c"]}), path)
    assert only_problem(path) == f"{path}: unknown column 'promt' (did you mean 'prompt'?)"


def test_parquet_row_problems_use_one_based_row_numbers(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": ["fine", "also fine"], "max_new_tokens": [4, -1]}), path)
    assert problems_of(path) == [f"{path}: row 2: max_new_tokens must be a positive integer, got -1"]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"choices": []}, "job setting: choices is empty; give at least one choice"),
        ({"choices": "yes"}, "job setting: choices must be a list of strings, got a string"),
        ({"max_new_tokens": 0}, "job setting: max_new_tokens must be a positive integer, got 0"),
        ({"stop": [""]}, "job setting: each of stop is empty"),
        ({"id_column": "doc"}, "job setting: id_column only applies with a template (corpus mode)"),
    ],
)
def test_bad_job_settings(tmp_path, options, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x"}])
    assert only_problem(path, **options) == reason


# --- templates --------------------------------------------------------------------------------------------------------


def test_parse_template_splits_text_and_placeholders():
    assert parse_template("Review: {text}\nIs it {{positive}}? {text}") == [
        "Review: ", Field("text"), "\nIs it {positive}? ", Field("text")]


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{a.__class__}", "placeholder {a.__class__} at character 1 uses attribute access"),
        ("{a[0]}", "placeholder {a[0]} at character 1 uses indexing"),
        ("x {a!r}", "placeholder {a!r} at character 3 uses a conversion"),
        ("{a:>10}", "placeholder {a:>10} at character 1 uses a format spec"),
        ("{}", "empty placeholder {} at character 1"),
        ("{text", "'{' at character 1 is never closed"),
        ("text}", "single '}' at character 5"),
        ("{ text }", "placeholder { text } at character 1 has spaces around the column name"),
        ("no placeholders {{here}}", "no {column} placeholders"),
    ],
)
def test_bad_templates_are_refused_when_parsed(template, reason):
    with pytest.raises(SpecError) as caught:
        parse_template(template)
    assert str(caught.value).startswith(f"template: {reason}")


def test_bad_template_is_refused_before_the_file_is_read(tmp_path):
    with pytest.raises(SpecError, match=r"^template: placeholder \{text\.upper\} .* attribute access"):
        read_spec(tmp_path / "never-read.jsonl", template="{text.upper}")


def test_dunder_placeholder_is_only_a_column_name(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"text": "x"}, {"text": "y", "__class__": "a column"}])
    with pytest.raises(SpecError) as caught:
        read_spec(path, template="{__class__}")
    assert caught.value.problems == [f"{path}:line 1: column '__class__' (named in the template) is missing"]
    kept = read_spec(path, template="{__class__}", skip_invalid=True)
    assert [request.prompt for request in kept.requests] == ["a column"]


def test_template_column_absent_from_a_row(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"doc": "d1", "text": "good"}, {"doc": "d2", "body": "bad"}])
    assert only_problem(path, template="Review: {text}", id_column="doc") == (
        f"{path}:line 2: column 'text' (named in the template) is missing")


def test_template_column_that_is_null(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"text": None}])
    assert only_problem(path, template="Review: {text}") == f"{path}:line 1: column 'text' is null"


def test_id_column_missing_from_a_row(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"text": "x"}])
    assert only_problem(path, template="{text}", id_column="doc") == f"{path}:line 1: id column 'doc' is missing"


def test_parquet_without_the_template_column_is_a_file_problem(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"doc": ["a"], "body": ["x"]}), path)
    assert only_problem(path, template="{text}", id_column="doc") == (
        f"{path}: no column 'text', which the template names (columns: doc, body)")
