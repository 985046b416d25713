"""Job spec rows that are refused: every bad row is named by its line and why (malformed JSON, wrong types,
unknown or repeated keys, duplicate ids, bad OpenAI batch lines), and every one is listed."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec import SpecError, read_spec
from tests.support import only_problem, openai_line, write_jsonl


def test_malformed_json_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "fine"}, '{"prompt": "broken"'])
    assert only_problem(path).startswith(f"{path}:line 2: malformed JSON")


def test_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "fine"}, '"just a string"'])
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
        ({"prompt": "x", "choices": ["yes", 1]}, "choices[1] must be a string, got an integer (1)"),
        ({"prompt": "x", "choices": ["yes", ""]}, "choices[1] is empty"),
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
        ({"prompt": "x", "continue_final_message": True},
         "continue_final_message continues a final assistant message, and this row's last message is 'user'"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
          "continue_final_message": "yes"}, "continue_final_message must be true or false, got a string"),
    ],
)
def test_wrong_type_for_a_field(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [row])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")


def test_missing_prompt_and_messages(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "choices": ["yes", "no"]}])
    assert only_problem(path) == f"{path}:line 1: missing prompt (or messages)"


def test_both_prompt_and_messages(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}])
    assert only_problem(path) == f"{path}:line 1: a row has either prompt or messages, not both"


def test_id_and_custom_id_that_differ(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "custom_id": "b", "prompt": "x"}])
    assert only_problem(path) == f"{path}:line 1: id 'a' and custom_id 'b' differ; give one of them"


def test_id_and_custom_id_that_agree_are_one_id(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"id": "a", "custom_id": "a", "prompt": "x"}])
    assert read_spec(path).requests[0].id == "a"


def test_key_given_twice_in_one_line(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", ['{"prompt": "x", "prompt": "y"}'])
    assert only_problem(path) == f"{path}:line 1: key 'prompt' appears twice"


def test_duplicate_ids_name_both_rows(tmp_path):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    path = write_jsonl(tmp_path / "jobs.jsonl", rows)
    assert only_problem(path) == f"{path}:line 3: duplicate id 'a': line 1 has the same id"


def test_default_id_colliding_with_an_explicit_one_explains_defaults(tmp_path):
    # Line 1 has no id, so its id is 1; the integer id 1 and the string "1" are the same id in the outputs.
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x"}, {"id": "1", "prompt": "y"}])
    assert only_problem(path) == (f"{path}:line 2: duplicate id '1': line 1 has the same id "
                                  "(a row without an id gets its line number)")


def test_unknown_key_suggests_the_known_one(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"promt": "x"}])
    assert only_problem(path) == f"{path}:line 1: unknown key 'promt' (did you mean 'prompt'?)"


def test_unknown_key_without_a_close_match_lists_known_keys(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "temperature": 0.2}])
    assert "unknown key 'temperature' (known keys: id, custom_id, prompt, messages," in only_problem(path)


def test_empty_choices(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "choices": []}])
    assert only_problem(path) == f"{path}:line 1: choices is empty; give at least one choice"


@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_max_new_tokens(tmp_path, value):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "max_new_tokens": value}])
    assert only_problem(path) == f"{path}:line 1: max_new_tokens must be a positive integer, got {value}"


def test_whole_numbers_written_as_floats_are_token_limits(tmp_path):
    """A Parquet column with nulls comes back as doubles (5.0), and JSON may write 1e2: both spell an integer."""
    path = tmp_path / "jobs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "max_new_tokens": pa.array([5.0, None, 1e2])}), path)
    spec = read_spec(path, max_new_tokens=7)
    assert [r.max_new_tokens for r in spec.requests] == [5, 7, 100]
    assert all(type(r.max_new_tokens) is int for r in spec.requests)


def test_row_with_choices_and_generation_settings_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "choices": ["a", "b"], "max_new_tokens": 4}])
    assert "a row is either a choice row (choices) or a generation row" in only_problem(path)


def test_system_key_on_a_messages_row_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"system": "s", "messages": [{"role": "user", "content": "x"}]}])
    assert "system applies to prompt rows; put a system message first in messages" in only_problem(path)


def test_invalid_utf8_reports_the_line_number(tmp_path):
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n\n{"prompt": "caf\xe9"}\n')
    assert only_problem(path) == f"{path}:line 3: not valid UTF-8 (byte 0xe9 at column 16)"


def test_lone_surrogate_escape_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", ['{"prompt": "bad \\ud800 text"}'])
    assert "prompt contains an unpaired surrogate escape" in only_problem(path)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", "malformed JSON: nested too deeply"),
        ('{"prompt": ' + "1" * 5000 + "}", "malformed JSON: Exceeds the limit (4300 digits) for integer string"),
    ],
)
def test_pathological_json_is_a_row_problem(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [line])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")


def test_every_bad_row_is_listed_and_the_message_is_capped(tmp_path):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "good"}] + ["{oops"] * 60)
    with pytest.raises(SpecError) as caught:
        read_spec(path)
    assert len(caught.value.problems) == 60
    message = str(caught.value)
    assert message.startswith("60 problems:\n")
    assert f"{path}:line 51: malformed JSON" in message
    assert f"{path}:line 52:" not in message
    assert message.endswith("... and 10 more")


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
    path = write_jsonl(tmp_path / "jobs.jsonl", [line])
    assert only_problem(path).startswith(f"{path}:line 1: {reason}")
