"""Valid job specs of every supported shape (native JSONL, Parquet, OpenAI batch lines, template corpus mode)
become Requests, with the job's defaults, ids and fingerprint."""
from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec import SpecError, read_spec
from batchrun.spec.read import InvalidRow, Request
from tests.support import openai_line, write_jsonl


def test_jsonl_rows_become_requests(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [
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
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "Positive?", "choices": ["yes", "no"]}])
    request = read_spec(path).requests[0]
    assert (request.choices, request.max_new_tokens, request.stop) == (("yes", "no"), 0, ())


def test_byte_order_mark_and_crlf_line_endings_are_accepted(tmp_path):
    path = tmp_path / "jobs.ndjson"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r\n')
    assert [request.prompt for request in read_spec(path).requests] == ["a", "b"]


def test_extension_is_matched_case_insensitively(tmp_path):
    path = write_jsonl(tmp_path / "JOBS.JSONL", [{"prompt": "a"}])
    assert read_spec(path).requests[0].prompt == "a"


def test_null_values_mean_not_set(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl",
                       [{"id": None, "prompt": "a", "messages": None, "stop": None, "choices": None}])
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
    path = write_jsonl(tmp_path / "jobs.jsonl", [
        openai_line("r1", "hi", max_tokens=12, temperature=0.7, stop="\n", n=1),
        openai_line("r2", "yo", max_completion_tokens=7, stop=["A", "B"]),
        {"custom_id": "r3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "developer", "content": "Rules"}, {"role": "user", "content": "Q"}]}},
    ])
    first, second, third = read_spec(path).requests
    assert (first.id, first.messages, first.max_new_tokens, first.stop) == ("r1", (("user", "hi"),), 12, ("\n",))
    assert (second.max_new_tokens, second.stop) == (7, ("A", "B"))
    assert (third.messages, third.max_new_tokens) == ((("system", "Rules"), ("user", "Q")), 16)


def test_template_corpus_mode_with_id_column(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"doc": "d1", "text": "Great film", "stars": 5, "extra": [1]},
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
    path = write_jsonl(tmp_path / "jobs.jsonl", [
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
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "prompt": "x"}, "{broken", {"id": "c", "prompt": 3},
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
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", lines), skip_invalid=True)
    assert spec.requests[0].messages == (("system", "Be brief."), ("user", "Review: good.\nPositive?"))
    assert "is a 'image_url' part; only text parts" in spec.invalid[0].reason


def test_whole_number_float_ids_are_the_integers_they_spell(tmp_path):
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", [{"id": 1.0, "prompt": "x"}, {"id": 2.5, "prompt": "y"}]),
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
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", rows), skip_invalid=True)
    assert spec.requests[0].id == 1 and spec.requests[1].messages == (("user", "y"),)
    assert [bad.reason for bad in spec.invalid] == [
        'messages[0].content[0] has no type; a text part is {"type": "text", "text": ...}',
        "messages[0].name must be a string, got an integer (3)"]


def test_fingerprint_follows_the_file_bytes(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x"}])
    before = read_spec(path).content_sha256
    path.write_text(json.dumps({"prompt": "x "}) + "\n")
    assert read_spec(path).content_sha256 != before
