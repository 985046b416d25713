"""The schema-feature probe: 24 JSON Schema features, each either enforced by the grammar (a value that breaks the
keyword is refused token by token, a value that keeps it is accepted) or refused when the spec is read. None is
loosened: no case is both accepted at read time and unenforced. The model's outputs under the same schemas are
checked in tests/job/test_structured_jobs.py."""
from __future__ import annotations

import json

import pytest

from batchrun.spec import Structure, structure_problem

# name -> (schema, a value that keeps every keyword, values that break one); None for refused cases
PROBE = {
    "string": ({"type": "string", "maxLength": 12}, "fine", [12, None]),
    "integer": ({"type": "integer"}, 7, [1.5, "7"]),
    "number": ({"type": "number"}, 2.5, ["x", True]),
    "boolean": ({"type": "boolean"}, False, [1, "false"]),
    "nullable": ({"type": ["string", "null"], "maxLength": 8}, None, [3, False]),
    "enum": ({"enum": ["red", "green"]}, "green", ["blue", "Red"]),
    "const": ({"const": "v1"}, "v1", ["v2"]),
    "required and optional": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                               "required": ["a"], "additionalProperties": False}, {"a": 1}, [{"b": 1}, {}]),
    "nested object": ({"type": "object", "properties": {"o": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}, "required": ["o"],
        "additionalProperties": False}, {"o": {"x": 3}}, [{"o": {"x": "s"}}, {"o": {}}]),
    "array of objects": ({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}},
                                                     "required": ["id"], "additionalProperties": False},
                          "maxItems": 3}, [{"id": 1}], [[{"id": "a"}], [{}]]),
    "array length": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2],
                     [[1], [1, 2, 3, 4]]),
    "integer range": ({"type": "integer", "minimum": 1, "maximum": 10}, 10, [11, 0, -3]),
    "exclusive range": ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5, [0, 1, 1.5]),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 15, [7, 3]),
    "string length": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", ["a", "abcde"]),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "AB123", ["ab123", "AB1234"]),
    "format date": ({"type": "string", "format": "date"}, "2024-02-29", ["2024-13-01", "yesterday"]),
    "format email": ({"type": "string", "format": "email"}, "ann@example.com", ["not-an-email", "a@"]),
    "anyOf": ({"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]}, 42, ["abcd", True]),
    "$ref": ({"$defs": {"count": {"type": "integer", "minimum": 0}}, "type": "object",
              "properties": {"n": {"$ref": "#/$defs/count"}}, "required": ["n"], "additionalProperties": False},
             {"n": 0}, [{"n": -1}]),
    "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, {"a": 1}, [{"a": 1, "z": 2}]),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}},
                         {"required": ["a"]}]}, {"a": 5}, [{}, {"a": 6}]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, None, None),
    "not": ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, None, None),
}
REFUSED = {"uniqueItems": "uniqueItems", "not": "not"}


def structure(schema: dict) -> Structure:
    return Structure("json_schema", json.dumps(schema, separators=(",", ":")))


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    """The grammar engine over the default model's tokenizer."""
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint)
    return tokenizer, llguidance.hf.from_tokenizer(tokenizer)


def accepts(engine, schema: dict, value) -> bool:
    """Whether the schema's grammar takes `value`, written as the grammar writes JSON, to its end."""
    from llguidance import LLMatcher

    tokenizer, table = engine
    matcher = LLMatcher(table, structure(schema).grammar(), log_level=0)
    tokens = tokenizer.encode(json.dumps(value, separators=(", ", ": ")), add_special_tokens=False)
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) \
        and matcher.is_accepting()


def test_the_probe_has_24_features_each_enforced_or_refused():
    assert len(PROBE) == 24
    refused = {name for name, (schema, _, _) in PROBE.items() if structure_problem("json_schema",
                                                                                   structure(schema).source)}
    assert refused == set(REFUSED)


@pytest.mark.parametrize("name", [name for name in PROBE if name not in REFUSED])
def test_an_accepted_feature_is_enforced_by_the_grammar(engine, name):
    schema, good, bad = PROBE[name]
    assert accepts(engine, schema, good), f"{name}: a valid value is refused"
    for value in bad:
        assert not accepts(engine, schema, value), f"{name}: {value!r} breaks the schema and was accepted"


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_feature_names_its_keyword(name):
    problem = structure_problem("json_schema", structure(PROBE[name][0]).source)
    assert f"cannot enforce the keyword(s) {REFUSED[name]};" in problem
