"""Rows that ask for a structured answer: a JSON Schema (OpenAI response_format, a native row's json_schema, corpus
mode's --json-schema) or a regex, each checked by the grammar engine when the spec is read: what it cannot enforce
is refused naming the row and the keyword, never loosened."""
from __future__ import annotations

import json

import pytest

from batchrun.spec import SpecError, Structure, read_spec
from tests.support import openai_line, write_jsonl

TICKET = {"type": "object", "properties": {"order": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                           "kind": {"enum": ["refund", "delay", "damage"]}},
          "required": ["order", "kind"], "additionalProperties": False}


def test_native_openai_and_regex_rows_carry_their_structure(tmp_path):
    (tmp_path / "ticket.json").write_text(json.dumps(TICKET))
    strict = {"type": "json_schema", "json_schema": {"name": "t", "strict": True, "schema": TICKET}}
    path = write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": "inline", "prompt": "x", "json_schema": TICKET, "max_new_tokens": 40},
        {"id": "file", "prompt": "x", "json_schema": "ticket.json", "max_new_tokens": 40},
        {"id": "pattern", "prompt": "x", "regex": "[0-9]{3}-[0-9]{4}"},
        openai_line("strict", response_format=strict),
        openai_line("object", response_format={"type": "json_object"}),
        openai_line("text", response_format={"type": "text"}),
    ])
    by_id = {request.id: request.structure for request in read_spec(path).requests}
    assert by_id["inline"] == by_id["file"] == by_id["strict"] == Structure("json_schema", json.dumps(
        TICKET, separators=(",", ":")))
    assert by_id["pattern"] == Structure("regex", "[0-9]{3}-[0-9]{4}")
    assert by_id["object"] == Structure("json_schema", '{"type":"object"}')
    assert by_id["text"] is None
    # the property order is the order the engine writes them in: kept, never sorted
    assert list(json.loads(by_id["inline"].source)["properties"]) == ["order", "kind"]
    assert by_id["inline"].key == by_id["strict"].key != by_id["object"].key


@pytest.mark.parametrize(("keyword", "schema"), [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
    ("contains", {"type": "array", "contains": {"type": "integer"}}),
    ("if, then", {"if": {"type": "string"}, "then": {"minLength": 2}}),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}),
])
def test_a_keyword_the_engine_cannot_enforce_is_refused_naming_row_and_keyword(tmp_path, keyword, schema):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "fine"}, {"prompt": "x", "json_schema": schema}])
    with pytest.raises(SpecError) as caught:
        read_spec(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}:line 2: json_schema: the grammar engine cannot enforce the keyword(s) "
                              f"{keyword};"), problem


@pytest.mark.parametrize(("row", "reason"), [
    ({"prompt": "x", "choices": ["a", "b"], "json_schema": TICKET}, "a choice row answers with one of its choices"),
    ({"prompt": "x", "json_schema": TICKET, "regex": "a+"}, "a row has either json_schema or regex, not both"),
    ({"prompt": "x", "json_schema": {"type": "strnig"}}, "json_schema: not a valid JSON Schema"),
    ({"prompt": "x", "json_schema": "missing.json"}, "json_schema: cannot read"),
    ({"prompt": "x", "json_schema": 3}, "json_schema must be a JSON Schema object or the path"),
    ({"prompt": "x", "regex": "[a-"}, "regex: the grammar engine refuses it"),
    ({"prompt": "x", "json_schema": {"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}},
     "json_schema: the grammar engine refuses it: oneOf constraints are not supported"),
    ({"prompt": "x", "json_schema": {"type": "string", "format": "no-such-format"}},
     "json_schema: the grammar engine refuses it: Unknown format"),
    (openai_line("o", response_format={"type": "json_schema", "json_schema": {"schema": {"not": {}}}}),
     "body.response_format.json_schema.schema: the grammar engine cannot enforce the keyword(s) not"),
    (openai_line("o", response_format={"type": "xml"}), "body.response_format.type is 'xml'"),
    (openai_line("o", response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
     "body.response_format.json_schema.strict must be true or false"),
])
def test_structured_rows_refused_with_their_reason(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "fine"}, row])
    spec = read_spec(path, skip_invalid=True)
    assert len(spec.requests) == 1 and spec.invalid[0].reason.startswith(reason), spec.invalid[0].reason


def test_lenient_options_inside_a_schema_cannot_loosen_it(tmp_path):
    schema = {"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}
    path = write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "x", "json_schema": schema}])
    spec = read_spec(path, skip_invalid=True)
    assert "cannot enforce the keyword(s) uniqueItems" in spec.invalid[0].reason


def test_corpus_mode_json_schema_applies_to_every_row(tmp_path):
    (tmp_path / "ticket.json").write_text(json.dumps(TICKET))
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "one"}, {"text": "two"}])
    spec = read_spec(path, template="Ticket: {text}", json_schema=tmp_path / "ticket.json", max_new_tokens=40)
    assert {request.structure.key for request in spec.requests} == {Structure(
        "json_schema", json.dumps(TICKET, separators=(",", ":"))).key}
    with pytest.raises(SpecError, match="choices and json_schema exclude each other"):
        read_spec(path, template="Ticket: {text}", json_schema=tmp_path / "ticket.json", choices=["a", "b"])
    with pytest.raises(SpecError, match="only applies with a template"):
        read_spec(path, json_schema=tmp_path / "ticket.json")
    (tmp_path / "loose.json").write_text(json.dumps({"type": "array", "uniqueItems": True}))
    with pytest.raises(SpecError, match="job setting: json_schema: the grammar engine cannot enforce the keyword"):
        read_spec(path, template="Ticket: {text}", json_schema=tmp_path / "loose.json")


def test_a_structured_rows_label_is_any_json_value_kept_as_json_text(tmp_path):
    label = {"order": "AB1234", "kind": "refund"}
    path = write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": "obj", "prompt": "x", "json_schema": TICKET, "label": label},
        {"id": "pattern", "prompt": "x", "regex": "[0-9]+", "label": "42"}])
    by_id = {request.id: request.label for request in read_spec(path).requests}
    assert json.loads(by_id["obj"]) == label and by_id["pattern"] == "42"
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "t", "gold": json.dumps(label)}])
    (tmp_path / "ticket.json").write_text(json.dumps(TICKET))
    (request,) = read_spec(corpus, template="{text}", json_schema=tmp_path / "ticket.json",
                           label_column="gold").requests
    assert json.loads(request.label) == label  # a CSV or JSONL cell's JSON text is the JSON value
