"""Job spec reading: every bad input is refused with a message naming where and why; valid specs of every
supported shape (native JSONL, Parquet, OpenAI batch lines, template corpus mode) become Requests."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec.read import Field, InvalidRow, Request, SpecError, parse_template, read_spec


def write_jsonl(directory: Path, rows: list, name: str = "jobs.jsonl") -> Path:
    """Rows are dicts (dumped as JSON) or raw strings (written verbatim, for malformed lines)."""
    path = directory / name
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return path


def problems_of(path: Path, **options) -> list[str]:
    with pytest.raises(SpecError) as caught:
        read_spec(path, **options)
    return caught.value.problems


def only_problem(path: Path, **options) -> str:
    problems = problems_of(path, **options)
    assert len(problems) == 1, problems
    return problems[0]


def openai_line(custom_id: str, content: str = "hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


# ------------------------------------------------------------------------------------------ bad rows


def test_malformed_json_names_the_line(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "fine"}, '{"prompt": "broken"'])
    assert only_problem(path).startswith(f"{path}:line 2: malformed JSON")


def test_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "fine"}, '"just a string"'])
    assert only_problem(path) == f"{path}:line 2: expected a JSON object, got a string"


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": 5}, "prompt must be a string, got an integer (5)"),
        ({"prompt": ""}, "prompt is empty"),
        ({"messages": "hi"}, "messages must be a list of {role, content} objects, got a string"),
        ({"messages": []}, "messages is empty"),
        ({"messages": ["hi"]}, "messages[0] must be an object with role and content, got a string"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role is 'bot'; use one of system, user"),
        ({"messages": [{"content": "x"}]}, "messages[0].role is missing"),
        ({"messages": [{"role": "user"}]}, "messages[0].content is missing"),
        ({"messages": [{"role": "user", "content": ["x"]}]},
         "messages[0].content[0] must be a content part object, got a string"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string, got an integer"),
        ({"messages": [{"role": "user", "content": "x", "nmae": "n"}]}, "unknown key 'nmae' in messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "s"}]},
         "messages[1]: a system message may only come first"),
        ({"prompt": "x", "system": 3}, "system must be a string, got an integer (3)"),
        ({"prompt": "x", "choices": "yes"}, "choices must be a list of strings, got a string"),
        ({"prompt": "x", "choices": ["yes", 1]}, "each of choices must be a string, got an integer (1)"),
        ({"prompt": "x", "choices": ["yes", ""]}, "each of choices is empty"),
        ({"prompt": "x", "choices": ["yes", "yes"]}, "choices has 'yes' twice"),
        ({"prompt": "x", "max_new_tokens": "5"}, "max_new_tokens must be a positive integer, got a string"),
        ({"prompt": "x", "max_new_tokens": 2.5}, "max_new_tokens must be a positive integer, got a number (2.5)"),
        ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens must be a positive integer, got a boolean"),
        ({"prompt": "x", "stop": 5}, "stop must be a string or a list of strings, got an integer (5)"),
        ({"prompt": "x", "stop": ["\n", ""]}, "each of stop is empty"),
        ({"id": 1.5, "prompt": "x"}, "id must be a string or an integer, got a number (1.5)"),
        ({"id": True, "prompt": "x"}, "id must be a string or an integer, got a boolean"),
        ({"id": "", "prompt": "x"}, "id is empty"),
        ({"custom_id": ["a"], "prompt": "x"}, "custom_id must be a string or an integer, got a list"),
        ({"id": 2**64, "prompt": "x"}, "id 18446744073709551616 does not fit in a 64-bit integer"),
    ],
)
def test_wrong_type_for_a_field(tmp_path, row, reason):
    path = write_jsonl(tmp_path, [row])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")


def test_missing_prompt_and_messages(tmp_path):
    path = write_jsonl(tmp_path, [{"id": "a", "choices": ["yes", "no"]}])
    assert only_problem(path) == f"{path}:line 1: missing prompt (or messages)"


def test_both_prompt_and_messages(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}])
    assert only_problem(path) == f"{path}:line 1: a row has either prompt or messages, not both"


def test_id_and_custom_id_that_differ(tmp_path):
    path = write_jsonl(tmp_path, [{"id": "a", "custom_id": "b", "prompt": "x"}])
    assert only_problem(path) == f"{path}:line 1: id 'a' and custom_id 'b' differ; give one of them"


def test_id_and_custom_id_that_agree_are_one_id(tmp_path):
    path = write_jsonl(tmp_path, [{"id": "a", "custom_id": "a", "prompt": "x"}])
    assert read_spec(path).requests[0].id == "a"


def test_key_given_twice_in_one_line(tmp_path):
    path = write_jsonl(tmp_path, ['{"prompt": "x", "prompt": "y"}'])
    assert only_problem(path) == f"{path}:line 1: key 'prompt' appears twice"


def test_duplicate_ids_name_both_rows(tmp_path):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    path = write_jsonl(tmp_path, rows)
    assert only_problem(path) == f"{path}:line 3: duplicate id 'a': line 1 has the same id"


def test_default_id_colliding_with_an_explicit_one_explains_defaults(tmp_path):
    # Line 1 has no id, so its id is 1; the integer id 1 and the string "1" are the same id in the outputs.
    path = write_jsonl(tmp_path, [{"prompt": "x"}, {"id": "1", "prompt": "y"}])
    assert only_problem(path) == (f"{path}:line 2: duplicate id '1': line 1 has the same id "
                                  "(a row without an id gets its line number)")


def test_unknown_key_suggests_the_known_one(tmp_path):
    path = write_jsonl(tmp_path, [{"promt": "x"}])
    assert only_problem(path) == f"{path}:line 1: unknown key 'promt' (did you mean 'prompt'?)"


def test_unknown_key_without_a_close_match_lists_known_keys(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "x", "temperature": 0.2}])
    assert "unknown key 'temperature' (known keys: id, custom_id, prompt, messages," in only_problem(path)


def test_empty_choices(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "x", "choices": []}])
    assert only_problem(path) == f"{path}:line 1: choices is empty; give at least one choice"


@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_max_new_tokens(tmp_path, value):
    path = write_jsonl(tmp_path, [{"prompt": "x", "max_new_tokens": value}])
    assert only_problem(path) == f"{path}:line 1: max_new_tokens must be a positive integer, got {value}"


def test_whole_numbers_written_as_floats_are_token_limits(tmp_path):
    """A Parquet column with nulls comes back as doubles (5.0), and JSON may write 1e2: both spell an integer."""
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "max_new_tokens": pa.array([5.0, None, 1e2])}), path)
    spec = read_spec(path, max_new_tokens=7)
    assert [r.max_new_tokens for r in spec.requests] == [5, 7, 100]
    assert all(type(r.max_new_tokens) is int for r in spec.requests)


def test_row_with_choices_and_generation_settings_is_refused(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "x", "choices": ["a", "b"], "max_new_tokens": 4}])
    assert "a row is either a choice row (choices) or a generation row" in only_problem(path)


def test_system_key_on_a_messages_row_is_refused(tmp_path):
    path = write_jsonl(tmp_path, [{"system": "s", "messages": [{"role": "user", "content": "x"}]}])
    assert "system applies to prompt rows; put a system message first in messages" in only_problem(path)


def test_invalid_utf8_reports_the_line_number(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    assert only_problem(path) == f"{path}:line 3: not valid UTF-8 (byte 0xe9 at column 16)"


def test_lone_surrogate_escape_is_refused(tmp_path):
    path = write_jsonl(tmp_path, ['{"prompt": "bad \\ud800 text"}'])
    assert "prompt contains an unpaired surrogate escape" in only_problem(path)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "malformed JSON: nested too deeply"),
        ('{"prompt": ' + "1" * 5000 + "}", "malformed JSON: Exceeds the limit (4300 digits) for integer string"),
    ],
)
def test_pathological_json_is_a_row_problem(tmp_path, line, reason):
    path = write_jsonl(tmp_path, [line])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")


def test_every_bad_row_is_listed_and_the_message_is_capped(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "good"}] + ["{oops"] * 60)
    with pytest.raises(SpecError) as caught:
        read_spec(path)
    assert len(caught.value.problems) == 60
    message = str(caught.value)
    assert message.startswith("60 problems:\n")
    assert f"{path}:line 51: malformed JSON" in message
    assert f"{path}:line 52:" not in message
    assert message.endswith("... and 10 more")


# ------------------------------------------------------------------------------------- bad files


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
    path = tmp_path / "jobs.csv"
    path.write_text("prompt\nx\n")
    assert only_problem(path) == (f"{path}: unsupported spec file type '.csv'; use .jsonl, .json, .ndjson, "
                                  ".parquet")


def test_missing_file(tmp_path):
    assert only_problem(tmp_path / "nowhere.jsonl") == f"{tmp_path / 'nowhere.jsonl'}: no such file"


def test_directory_instead_of_file(tmp_path):
    folder = tmp_path / "jobs.jsonl"
    folder.mkdir()
    assert only_problem(folder) == f"{folder}: not a regular file"


def test_json_array_file_gets_a_jsonl_hint(tmp_path):
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps([{"prompt": "x"}], indent=2))
    assert only_problem(path) == f"{path}: the file holds a JSON array; write one JSON object per line (JSONL)"


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
    path = write_jsonl(tmp_path, [{"prompt": "x"}])
    assert only_problem(path, **options) == reason


# ------------------------------------------------------------------------------------- templates


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
    path = write_jsonl(tmp_path, [{"text": "x"}, {"text": "y", "__class__": "a column"}])
    with pytest.raises(SpecError) as caught:
        read_spec(path, template="{__class__}")
    assert caught.value.problems == [f"{path}:line 1: column '__class__' (named in the template) is missing"]
    kept = read_spec(path, template="{__class__}", skip_invalid=True)
    assert [request.prompt for request in kept.requests] == ["a column"]


def test_template_column_absent_from_a_row(tmp_path):
    path = write_jsonl(tmp_path, [{"doc": "d1", "text": "good"}, {"doc": "d2", "body": "bad"}])
    assert only_problem(path, template="Review: {text}", id_column="doc") == (
        f"{path}:line 2: column 'text' (named in the template) is missing")


def test_template_column_that_is_null(tmp_path):
    path = write_jsonl(tmp_path, [{"text": None}])
    assert only_problem(path, template="Review: {text}") == f"{path}:line 1: column 'text' is null"


def test_id_column_missing_from_a_row(tmp_path):
    path = write_jsonl(tmp_path, [{"text": "x"}])
    assert only_problem(path, template="{text}", id_column="doc") == f"{path}:line 1: id column 'doc' is missing"


def test_parquet_without_the_template_column_is_a_file_problem(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"doc": ["a"], "body": ["x"]}), path)
    assert only_problem(path, template="{text}", id_column="doc") == (
        f"{path}: no column 'text', which the template names (columns: doc, body)")


# ------------------------------------------------------------------------------------- happy paths


def test_jsonl_rows_become_requests(tmp_path):
    path = write_jsonl(tmp_path, [
        {"id": "a", "prompt": "Hello"},
        "",
        {"prompt": "Sorted?", "system": "Be terse.", "max_new_tokens": 3, "stop": "\n"},
        {"id": 7, "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                               {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q2"}]},
    ])
    spec = read_spec(path)
    assert spec.invalid == [] and spec.total_rows == 3
    first, second, third = spec.requests
    assert first == Request(index=0, id="a", location=f"{path}:1", messages=(("user", "Hello"),), prompt="Hello",
                            choices=None, max_new_tokens=16, stop=())
    # The blank line is not a row (index 1) but still counts for the line number, which is the default id.
    assert (second.index, second.id, second.location) == (1, 3, f"{path}:3")
    assert second.messages == (("system", "Be terse."), ("user", "Sorted?"))
    assert (second.prompt, second.max_new_tokens, second.stop) == ("Sorted?", 3, ("\n",))
    assert third.id == 7 and third.prompt is None
    assert third.messages == (("system", "S"), ("user", "Q"), ("assistant", "A"), ("user", "Q2"))
    assert spec.content_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_choice_rows_have_no_generation_budget(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "Positive?", "choices": ["yes", "no"]}])
    request = read_spec(path).requests[0]
    assert (request.choices, request.max_new_tokens, request.stop) == (("yes", "no"), 0, ())


def test_byte_order_mark_and_crlf_line_endings_are_accepted(tmp_path):
    path = tmp_path / "jobs.ndjson"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [request.prompt for request in read_spec(path).requests] == ["a", "b"]


def test_extension_is_matched_case_insensitively(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "a"}], name="JOBS.JSONL")
    assert read_spec(path).requests[0].prompt == "a"


def test_null_values_mean_not_set(tmp_path):
    path = write_jsonl(tmp_path, [{"id": None, "prompt": "a", "messages": None, "stop": None, "choices": None}])
    request = read_spec(path, stop=["END"]).requests[0]
    assert (request.id, request.stop, request.choices) == (1, ("END",), None)


def test_parquet_with_list_columns_and_nested_messages(tmp_path):
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({
        "id": pa.array([10, 11, 12], pa.int64()),
        "prompt": ["Positive?", None, "Tell me"],
        "messages": pa.array([None, [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], None],
                             pa.list_(message)),
        "choices": [["yes", "no"], None, None],
        "stop": [None, ["\n", "END"], None],
        "max_new_tokens": [None, 5, None],
    })
    path = tmp_path / "jobs.parquet"
    pq.write_table(table, path)
    spec = read_spec(path)
    choice, chat, plain = spec.requests
    assert (choice.id, choice.choices, choice.max_new_tokens, choice.location) == (10, ("yes", "no"), 0,
                                                                                  f"{path}: row 1")
    assert chat.messages == (("system", "S"), ("user", "Q")) and chat.prompt is None
    assert (chat.stop, chat.max_new_tokens) == (("\n", "END"), 5)
    assert (plain.messages, plain.max_new_tokens) == ((("user", "Tell me"),), 16)
    assert spec.content_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_openai_batch_lines_are_accepted_as_is(tmp_path):
    path = write_jsonl(tmp_path, [
        openai_line("r1", "hi", max_tokens=12, temperature=0.7, stop="\n", n=1),
        openai_line("r2", "yo", max_completion_tokens=7, stop=["A", "B"]),
        {"custom_id": "r3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Q"}]}},
    ])
    first, second, third = read_spec(path).requests
    assert (first.id, first.messages, first.max_new_tokens, first.stop) == ("r1", (("user", "hi"),), 12, ("\n",))
    assert (second.max_new_tokens, second.stop) == (7, ("A", "B"))
    assert (third.messages, third.max_new_tokens) == ((("system", "Rules"), ("user", "Q")), 16)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (openai_line("r", n=3), "body.n is 3; batchrun writes exactly one answer per request"),
        ({**openai_line("r"), "url": "/v1/embeddings"},
         "url '/v1/embeddings' is not supported; batchrun runs /v1/chat/completions requests only"),
        ({**openai_line("r"), "method": "GET"}, "method 'GET' is not supported"),
        (openai_line("r", max_tokens=5, max_completion_tokens=6),
         "body.max_tokens and body.max_completion_tokens differ"),
        (openai_line("r", max_tokens=0), "body.max_tokens must be a positive integer, got 0"),
        ({"custom_id": "r", "url": "/v1/chat/completions", "body": {"model": "m"}}, "body.messages is missing"),
        ({**openai_line("r"), "extra": 1}, "unknown key 'extra' in an OpenAI batch line"),
    ],
)
def test_bad_openai_batch_lines(tmp_path, line, reason):
    path = write_jsonl(tmp_path, [line])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")


def test_template_corpus_mode_with_id_column(tmp_path):
    path = write_jsonl(tmp_path, [{"doc": "d1", "text": "Great film", "stars": 5, "extra": [1]},
                                  {"doc": 42, "text": "Dull {film}", "stars": 1}])
    spec = read_spec(path, template="Review: {text} ({stars} stars)\nIs it {{positive}}?", id_column="doc",
                     choices=["yes", "no"], system="Classify.")
    first, second = spec.requests
    assert first.id == "d1" and second.id == 42
    assert first.prompt == "Review: Great film (5 stars)\nIs it {positive}?"
    # Braces inside data are data: only the template is parsed.
    assert second.prompt == "Review: Dull {film} (1 stars)\nIs it {positive}?"
    assert first.messages == (("system", "Classify."), ("user", first.prompt))
    assert first.choices == ("yes", "no") and first.max_new_tokens == 0


def test_template_corpus_mode_from_parquet_reads_row_numbers_as_ids(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "score": [0.5, 1.25], "ignored": [b"\x00", b"\x01"]}), path)
    spec = read_spec(path, template="{text}={score}", max_new_tokens=3)
    assert [(r.id, r.prompt, r.max_new_tokens) for r in spec.requests] == [(1, "a=0.5", 3), (2, "b=1.25", 3)]


def test_job_defaults_apply_unless_a_row_sets_its_own(tmp_path):
    path = write_jsonl(tmp_path, [
        {"id": "default", "prompt": "p"},
        {"id": "own-choices", "prompt": "p", "choices": ["a", "b", "c"]},
        {"id": "generation", "prompt": "p", "max_new_tokens": 9},
        {"id": "own-stop", "prompt": "p", "stop": ["\n"]},
        {"id": "no-system", "prompt": "p", "system": ""},
        {"id": "own-system", "prompt": "p", "system": "Mine"},
        {"id": "chat", "messages": [{"role": "user", "content": "q"}]},
        {"id": "chat-with-system",
         "messages": [{"role": "system", "content": "Mine"}, {"role": "user", "content": "q"}]},
    ])
    spec = read_spec(path, choices=("yes", "no"), system="Job", max_new_tokens=4, stop=["END"])
    by_id = {request.id: request for request in spec.requests}
    assert (by_id["default"].choices, by_id["default"].max_new_tokens) == (("yes", "no"), 0)
    assert by_id["default"].messages == (("system", "Job"), ("user", "p"))
    assert by_id["own-choices"].choices == ("a", "b", "c")
    # A row asking for generation settings is a generation row, whatever the job's choices.
    assert (by_id["generation"].choices, by_id["generation"].max_new_tokens, by_id["generation"].stop) == (
        None, 9, ("END",))
    assert (by_id["own-stop"].choices, by_id["own-stop"].max_new_tokens, by_id["own-stop"].stop) == (
        None, 4, ("\n",))
    assert by_id["no-system"].messages == (("user", "p"),)
    assert by_id["own-system"].messages == (("system", "Mine"), ("user", "p"))
    assert by_id["chat"].messages == (("system", "Job"), ("user", "q"))
    assert by_id["chat-with-system"].messages == (("system", "Mine"), ("user", "q"))


def test_skip_invalid_keeps_the_valid_rows_and_returns_reasons(tmp_path):
    path = write_jsonl(tmp_path, [{"id": "a", "prompt": "x"}, "{broken", {"id": "c", "prompt": 3},
                                  {"id": "d", "prompt": "y"}])
    spec = read_spec(path, skip_invalid=True)
    assert [(r.index, r.id) for r in spec.requests] == [(0, "a"), (3, "d")]
    assert spec.invalid == [
        InvalidRow(index=1, id=None, location=f"{path}:2",
                   reason="malformed JSON: Expecting property name enclosed in double quotes (column 2)",
                   name=f"{path}:2"),
        InvalidRow(index=2, id="c", location=f"{path}:3", reason="prompt must be a string, got an integer (3)",
                   name="c"),
    ]
    assert spec.total_rows == 4


def test_an_invalid_row_named_by_its_location_never_takes_a_real_id(tmp_path):
    path = tmp_path / "spec.jsonl"
    path.write_text(json.dumps({"id": f"{path}:2", "prompt": "x"}) + "\n{broken\n")
    spec = read_spec(path, skip_invalid=True)
    (bad,) = spec.invalid
    assert bad.output_id == f"{path}:2 (invalid row)" and spec.requests[0].id == f"{path}:2"


def test_openai_content_parts_and_message_names_are_read_as_text(tmp_path):
    body = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                         {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Review: good."},
                                                                      {"type": "text", "text": "Positive?"}]}]}
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": image}]
    spec = read_spec(write_jsonl(tmp_path, lines), skip_invalid=True)
    assert spec.requests[0].messages == (("system", "Be brief."), ("user", "Review: good.\nPositive?"))
    assert "is a 'image_url' part; only text parts" in spec.invalid[0].reason


def test_whole_number_float_ids_are_the_integers_they_spell(tmp_path):
    spec = read_spec(write_jsonl(tmp_path, [{"id": 1.0, "prompt": "x"}, {"id": 2.5, "prompt": "y"}]),
                     skip_invalid=True)
    assert spec.requests[0].id == 1 and isinstance(spec.requests[0].id, int)
    assert "must be a string or an integer" in spec.invalid[0].reason


@pytest.mark.parametrize("objects", [1, 3])
def test_pretty_printed_json_objects_are_named_as_such(tmp_path, objects):
    path = tmp_path / "spec.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": "x"}, indent=2) + "\n" for i in range(objects)))
    with pytest.raises(SpecError, match="JSON objects spread over several lines") as refused:
        read_spec(path)
    assert len(refused.value.problems) == 1  # one file-level message, not one per line


def test_ids_and_content_parts_edge_cases(tmp_path):
    rows = [{"id": 1.0, "custom_id": 1, "prompt": "x"},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "y"}]}]},
            {"messages": [{"role": "user", "content": [{"text": "z"}]}]},
            {"messages": [{"role": "user", "name": 3, "content": "z"}]}]
    spec = read_spec(write_jsonl(tmp_path, rows), skip_invalid=True)
    assert spec.requests[0].id == 1 and spec.requests[1].messages == (("user", "y"),)
    assert [bad.reason for bad in spec.invalid] == [
        'messages[0].content[0] has no type; a text part is {"type": "text", "text": ...}',
        "messages[0].name must be a string, got an integer (3)"]


def test_fingerprint_follows_the_file_bytes(tmp_path):
    path = write_jsonl(tmp_path, [{"prompt": "x"}])
    before = read_spec(path).content_sha256
    path.write_text(json.dumps({"prompt": "x "}) + "\n")
    assert read_spec(path).content_sha256 != before
