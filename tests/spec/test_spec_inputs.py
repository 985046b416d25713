"""Inputs as other tools write them: --choices typed for raw prompts, corpus rows carrying their own settings,
OpenAI batch bodies with parameters batchrun cannot honour, pandas/Polars Parquet, compressed or UTF-16 files,
and non-text values in a template."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import shlex
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.spec import read_spec
from tests.support import only_problem, openai_line, write_jsonl

# ------------------------------------------------------------------------------------------ --choices


def choices_from_command_line(monkeypatch, value: str):
    """The choices `batchrun plan --choices VALUE` hands the library, or the usage error it prints."""
    handed = []

    def capture(spec, models, options):
        handed.append(options.choices)
        raise SystemExit(0)  # the plan ends here; any other exception would be reported as batchrun's fault

    monkeypatch.setattr("batchrun.cli.plan_report", capture)
    result = CliRunner().invoke(cli, ["plan", "never-read.jsonl", "--choices", value])
    if handed:
        return handed[0]
    assert result.exit_code == 2, result.output  # a usage error, before any file is read
    return result.output


@pytest.mark.parametrize(
    ("value", "choices"),
    [
        ("yes, no", ("yes", "no")),  # the comma form strips, as people typing labels expect
        ('[" positive", " negative"]', (" positive", " negative")),  # raw prompts need the leading space
        ('["1,000", "2,000"]', ("1,000", "2,000")),
        (' ["a b", "c"] ', ("a b", "c")),
    ],
)
def test_choices_option_takes_a_json_array_for_exact_strings(monkeypatch, value, choices):
    assert choices_from_command_line(monkeypatch, value) == choices


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('[" positive", " negative"', "not a valid JSON array"),
        ('[" positive", 3]', "item 2 is an integer (3), not a string"),
        ('[["a"]]', "item 1 is a list, not a string"),
        ("[]", "the array is empty"),
        ('["a", ""]', "item 2 is empty"),
        ("a,,b", "has an empty item"),
    ],
)
def test_bad_choices_option_is_a_usage_error_saying_why(monkeypatch, value, reason):
    output = choices_from_command_line(monkeypatch, value)
    assert "--choices" in output and reason in output, output


# ------------------------------------------------------------------------------ corpus rows' settings


def test_corpus_rows_use_their_own_settings_with_the_options_as_defaults(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [
        {"doc": "a", "text": "t1", "choices": ["pos", "neg"]},
        {"doc": "b", "text": "t2", "max_new_tokens": 5, "stop": "\n"},
        {"doc": "c", "text": "t3", "system": "Mine"},
        {"doc": "d", "text": "t4", "system": ""},
        {"doc": "e", "text": "t5", "choices": None, "max_new_tokens": None},
    ])
    spec = read_spec(path, template="Review: {text}", id_column="doc", max_new_tokens=3, system="Job")
    by_id = {request.id: request for request in spec.requests}
    assert (by_id["a"].choices, by_id["a"].max_new_tokens) == (("pos", "neg"), 0)
    assert (by_id["b"].choices, by_id["b"].max_new_tokens, by_id["b"].stop) == (None, 5, ("\n",))
    assert by_id["c"].messages == (("system", "Mine"), ("user", "Review: t3"))
    assert by_id["d"].messages == (("user", "Review: t4"),)
    assert (by_id["e"].choices, by_id["e"].max_new_tokens) == (None, 3)
    assert by_id["e"].messages == (("system", "Job"), ("user", "Review: t5"))


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "t", "choices": "pos,neg"}, "choices must be a list of strings, got a string"),
        ({"text": "t", "max_new_tokens": 0}, "max_new_tokens must be a positive integer, got 0"),
        ({"text": "t", "stop": [""]}, "each of stop is empty"),
        ({"text": "t", "system": 3}, "system must be a string, got an integer (3)"),
        ({"text": "t", "choices": ["a"], "max_new_tokens": 4}, "a row is either a choice row (choices) or a "
                                                               "generation row"),
    ],
)
def test_corpus_row_settings_are_checked_as_in_request_mode(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [row])
    assert only_problem(path, template="{text}").startswith(f"{path}:line 1: {reason}")


def test_columns_the_template_reads_stay_data(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"system": "Linux", "choices": ["x", "y"], "stop": "end"}])
    (request,) = read_spec(path, template="{system} {choices} {stop}", choices=["yes", "no"]).requests
    assert request.messages == (("user", 'Linux ["x", "y"] end'),)
    assert (request.choices, request.stop) == (("yes", "no"), ())


def test_parquet_corpus_reads_the_setting_columns_too(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"], "choices": [["p", "n"], None, None],
                             "max_new_tokens": pa.array([None, 7, None], pa.int64()), "other": [1, 2, 3]}), path)
    spec = read_spec(path, template="{text}", max_new_tokens=2)
    assert [(r.choices, r.max_new_tokens) for r in spec.requests] == [(("p", "n"), 0), (None, 7), (None, 2)]


# ------------------------------------------------------------------------------------ OpenAI bodies


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"max_output_tokens": 50}, "unknown key 'max_output_tokens' in body (did you mean 'max_tokens'?)"),
        ({"max_token": 50}, "unknown key 'max_token' in body (did you mean 'max_tokens'?)"),
        ({"stops": ["\n"]}, "unknown key 'stops' in body (did you mean 'stop'?)"),
        ({"zzz": 1}, "unknown key 'zzz' in body (not a /v1/chat/completions parameter)"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "body.tools asks for tools"),
        ({"functions": [{"name": "f"}]}, "body.functions asks for tools"),
        ({"tool_choice": "required"}, "body.tool_choice 'required' forces a tool call"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "body.tool_choice {'type': "),
        ({"function_call": {"name": "f"}}, "body.function_call {'name': 'f'} forces a tool call"),
        ({"web_search_options": {}}, "body.web_search_options asks for a web search"),
    ],
)
def test_openai_body_keys_batchrun_cannot_honour_are_refused_per_row(tmp_path, body, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [openai_line("good"), openai_line("bad", **body)])
    spec = read_spec(path, skip_invalid=True)
    assert [r.id for r in spec.requests] == ["good"]
    assert spec.invalid[0].id == "bad" and spec.invalid[0].reason.startswith(reason), spec.invalid[0].reason


def test_openai_sampling_and_bookkeeping_parameters_are_ignored(tmp_path):
    ignored = {"temperature": 0.2, "top_p": 0.9, "seed": 1, "response_format": {"type": "text"},
               "presence_penalty": 0.1, "frequency_penalty": 0.1, "logit_bias": {"50256": -100}, "user": "u",
               "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "stream": False,
               "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
               "parallel_tool_calls": False, "reasoning_effort": "low", "prediction": {"type": "content"},
               "modalities": ["text"], "audio": None, "verbosity": "low", "prompt_cache_key": "k",
               "prompt_cache_retention": "24h", "safety_identifier": "s", "tools": [], "functions": [],
               "tool_choice": "auto", "function_call": "none"}
    (request,) = read_spec(write_jsonl(tmp_path / "jobs.jsonl", [openai_line("r", max_tokens=3, **ignored)])).requests
    assert (request.messages, request.max_new_tokens, request.structure) == ((("user", "hi"),), 3, None)
    allowed = {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", [openai_line("r", **allowed)]))
    assert spec.requests[0].max_new_tokens == 16


# ---------------------------------------------------------------------------------- Parquet as written


def pandas_table(columns: dict, index_columns: list) -> pa.Table:
    """A table with the schema metadata pandas' to_parquet writes (pandas itself is not a dependency)."""
    metadata = {"index_columns": index_columns, "column_indexes": [], "pandas_version": "2.2.3",
                "columns": [{"name": name, "field_name": name} for name in columns]}
    return pa.table(columns).replace_schema_metadata({b"pandas": json.dumps(metadata).encode()})


def test_pandas_index_columns_are_ignored(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pandas_table({"prompt": ["a", "b"], "__index_level_0__": [7, 9]}, ["__index_level_0__"]), path)
    assert [(r.id, r.prompt) for r in read_spec(path).requests] == [(1, "a"), (2, "b")]
    pq.write_table(pandas_table({"prompt": ["a"], "row": [3]}, ["row"]), path)  # a named index
    assert read_spec(path).requests[0].prompt == "a"
    pq.write_table(pa.table({"prompt": ["a"], "__index_level_1__": [3]}), path)  # metadata lost, name kept
    assert read_spec(path).requests[0].prompt == "a"


def test_a_pandas_index_the_spec_names_is_kept(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pandas_table({"prompt": ["a", "b"], "id": ["x", "y"]}, ["id"]), path)
    assert [r.id for r in read_spec(path).requests] == ["x", "y"]
    pq.write_table(pandas_table({"text": ["a"], "doc": ["d1"]}, ["doc"]), path)
    assert read_spec(path, template="{text}", id_column="doc").requests[0].id == "d1"
    pq.write_table(pandas_table({"prompt": ["a"], "promt": ["b"]}, []), path)  # not an index: still refused
    assert only_problem(path) == f"{path}: unknown column 'promt' (did you mean 'prompt'?)"


def test_parquet_nan_in_optional_numbers_means_not_set(tmp_path):
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"id": [1.0, float("nan")], "prompt": ["a", "b"],
                             "max_new_tokens": [4.0, float("nan")]}), path)
    assert [(r.id, r.max_new_tokens) for r in read_spec(path, max_new_tokens=9).requests] == [(1, 4), (2, 9)]
    pq.write_table(pa.table({"doc": [1.0, float("nan")], "text": ["a", "b"], "max_new_tokens": [float("nan"), 2.0]}),
                   path)
    assert only_problem(path, template="{text}", id_column="doc") == f"{path}: row 2: id column 'doc' is null"
    spec = read_spec(path, template="{text}", id_column="doc", max_new_tokens=9, skip_invalid=True)
    assert [(r.id, r.max_new_tokens) for r in spec.requests] == [(1, 9)]


def test_jsonl_nan_stays_refused(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", ['{"prompt": "x", "max_new_tokens": NaN}'])
    assert only_problem(path) == f"{path}:line 1: max_new_tokens must be a positive integer, got a number (nan)"


# ------------------------------------------------------------------------------- encodings, compression


@pytest.mark.parametrize(("compress", "name", "command"),
                         [(gzip.compress, "gzip", "gunzip -c"), (bz2.compress, "bzip2", "bzip2 -dc"),
                          (lzma.compress, "xz", "xz -dc")])
def test_compressed_file_named_jsonl_is_refused_once(tmp_path, compress, name, command):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(compress(b'{"prompt": "a"}\n{"prompt": "b"}\n'))
    assert only_problem(path) == (f"{path}: the file is {name}-compressed; decompress it first "
                                  f"({command} {path} > {tmp_path / 'jobs.plain.jsonl'})")


@pytest.mark.parametrize("name", ["plain.jsonl", "jobs.plain.jsonl", "utf8.jsonl", "my jobs.json"])
def test_the_command_a_refused_file_suggests_writes_a_readable_copy_and_leaves_the_file(tmp_path, name):
    """The suggested command, run as a user pastes it, writes the text beside the spec under another name: its
    redirect never names the spec itself, which the shell would empty before the command reads it."""
    text = b'{"prompt": "a"}\n{"prompt": "b"}\n'
    for data in (gzip.compress(text), "\ufeff".encode("utf-16-be") + text.decode().encode("utf-16-be")):
        path = tmp_path / name
        path.write_bytes(data)
        command = re.search(r"\((gunzip .*|iconv .*)\)$", only_problem(path)).group(1)
        subprocess.run(command, shell=True, check=True, cwd=tmp_path)
        assert path.read_bytes() == data
        copy = Path(shlex.split(command)[-1])
        assert copy != path and copy.parent == tmp_path
        assert [r.prompt for r in read_spec(copy).requests] == ["a", "b"]


@pytest.mark.parametrize(
    ("encoding", "named"),
    [("utf-16", "UTF-16"), ("utf-16-be", "UTF-16 (big-endian)"), ("utf-32", "UTF-32")],
)
def test_utf16_and_utf32_files_are_refused_once(tmp_path, encoding, named):
    path = tmp_path / "jobs.jsonl"
    text = '{"prompt": "a"}\n{"prompt": "b"}\n'
    path.write_bytes(("\ufeff" + text).encode(encoding) if encoding.endswith("be") else text.encode(encoding))
    reason = only_problem(path)
    assert reason.startswith(f"{path}: the file is {named}") and "re-save it as UTF-8" in reason


# ---------------------------------------------------------------------------------- template values


def test_template_writes_nested_values_and_booleans_as_json(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl",
                       [{"tags": ["a", "é"], "meta": {"k": 1}, "ok": False, "n": 3, "x": 0.5, "s": "t"}])
    (request,) = read_spec(path, template="{tags} {meta} {ok} {n} {x} {s}").requests
    assert request.prompt == '["a", "é"] {"k": 1} false 3 0.5 t'


def test_template_writes_parquet_lists_and_structs_as_json(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"tags": [["a", "b"]], "meta": [{"k": 1, "on": True}], "ok": [True]}), path)
    assert read_spec(path, template="{tags}|{meta}|{ok}").requests[0].prompt == '["a", "b"]|{"k": 1, "on": true}|true'

