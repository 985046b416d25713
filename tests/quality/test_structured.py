"""Structured answers checked by jsonschema, apart from the grammar: parsed JSON text, validity, JSON-pointer paths
of what fails; a JSON row cut by its limit is json_incomplete; the output's columns and counts."""
from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa

from batchrun.output import output_rows, quality
from batchrun.output import results_table
from batchrun.quality import check_answer, check_regex_answer, schema_problem
from tests.support import answer

SCHEMA = ('{"type":"object","properties":{"items":{"type":"array","items":{"type":"object","properties":'
          '{"qty":{"type":"integer","minimum":1}},"required":["qty"]}},"email":{"type":"string","format":"email"}},'
          '"required":["items"]}')


def test_errors_name_the_failing_values_by_json_pointer():
    check = check_answer('{"items": [{"qty": 2}, {"qty": 0}, {}], "email": "nobody"}', SCHEMA)
    assert not check.valid and check.json == '{"items": [{"qty": 2}, {"qty": 0}, {}], "email": "nobody"}'
    assert [error.split(":")[0] for error in check.errors] == ["/email", "/items/1/qty", "/items/2"]
    assert "is not a 'email'" in check.errors[0] and "'qty' is a required property" in check.errors[2]
    assert check_answer('{"items": []}', SCHEMA).valid


def test_text_that_is_not_json_is_invalid_with_where_it_broke():
    check = check_answer('{"items": [', SCHEMA)
    assert (check.json, check.valid) == (None, False) and check.errors[0].startswith("/: not JSON")


def test_a_regex_answer_must_match_whole():
    assert check_regex_answer("555-123-4567", "[0-9]{3}-[0-9]{3}-[0-9]{4}").valid
    assert not check_regex_answer("555-123-4567 ok", "[0-9]{3}-[0-9]{3}-[0-9]{4}").valid


def test_a_schema_the_validator_cannot_use_is_named():
    assert "is not valid" in schema_problem({"type": "strnig"})
    assert schema_problem({"type": "object"}) is None


def test_output_columns_and_counts_for_valid_invalid_and_cut_rows():
    structure = {"json_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}
    rows = [replace(answer(0, "ok", '{"n": 3}'), structure=structure,
                    grammar={"overrides": 0, "forced": 3, "lowest_logprob": -0.5}),
            replace(answer(1, "bad", '{"n": "x"}'), structure=structure,
                    grammar={"overrides": 2, "forced": 3, "lowest_logprob": -7.25}),
            replace(answer(2, "cut", '{"n": 12345'), structure=structure, finish_reason="length"),
            answer(3, "plain", "hello")]
    table = results_table(output_rows(rows)).to_pylist()
    assert [(r["json"], r["schema_valid"], r["error"], r["finish_reason"]) for r in table] == [
        ('{"n": 3}', True, None, "stop"), ('{"n": "x"}', False, None, "stop"),
        (None, False, "json_incomplete", "length"), (None, None, None, "stop")]
    assert table[1]["schema_errors"] == ["/n: 'x' is not of type 'integer'"]
    assert table[2]["schema_errors"][0].startswith("/: json_incomplete")
    assert [(r["grammar_overrides"], r["forced_tokens"], r["lowest_logprob"]) for r in table] == [
        (0, 3, -0.5), (2, 3, -7.25), (None, None, None), (None, None, None)]
    found = quality(_answers(output_rows(rows)))
    assert found["structured"] == {"rows": 3, "valid": 1, "invalid": 1, "cut": 1, "forced_hardest": [
        {"id": "bad", "overrides": 2, "lowest_logprob": -7.25}]}
    from batchrun.output import describe_quality

    assert "  forced hardest (the model's top token refused): bad 2x (lowest logprob -7.25)" in describe_quality(found)
    plain = results_table(output_rows([answer(0)]))  # a job without structured rows keeps its columns
    assert "schema_valid" not in plain.column_names and isinstance(plain, pa.Table)


def _answers(rows):
    from batchrun.output import JobAnswers
    from batchrun.quality import Calibration

    return JobAnswers(rows, Calibration("none"), len(rows))


def test_fields_are_judged_one_by_one_with_enum_confusion():
    from batchrun.quality import enum_pointers, field_accuracy

    customer = {"type": "object", "properties": {"age": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"order": {"type": "string"}, "kind": {"enum": ["refund", "delay"]},
                                               "customer": customer}}
    label = {"order": "AB1234", "kind": "refund", "customer": {"age": 30}}
    rows = [({"order": "AB1234", "kind": "refund", "customer": {"age": 30}}, label),
            ({"order": "AB1235", "kind": "delay", "customer": {"age": 30.0}}, label),
            ({"order": "AB1234"}, label),
            (None, label)]  # a row with no JSON: every field wrong
    found = field_accuracy(rows, enum_pointers(schema))
    assert {pointer: (f["correct"], f["labelled"]) for pointer, f in found.items()} == {
        "/order": (2, 4), "/kind": (1, 4), "/customer/age": (2, 4)}
    assert found["/kind"]["confusion"] == {"refund": {"refund": 1, "delay": 1, "(missing)": 2}}
    assert "confusion" not in found["/order"]
    assert found["/order"]["interval"][0] < 0.5 < found["/order"]["interval"][1]
    assert field_accuracy([(1, True), (True, True)], set())["/"]["correct"] == 1  # true is not 1


def test_json_labels_are_judged_whole_and_by_field_in_the_quality_figures():
    properties = {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}}
    structure = {"json_schema": {"type": "object", "properties": properties}}
    rows = [replace(answer(0, "r0", '{"kind": "a", "n": 1}'), structure=structure, label='{"n": 1, "kind": "a"}'),
            replace(answer(1, "r1", '{"kind": "b", "n": 1}'), structure=structure, label='{"kind": "a", "n": 1}')]
    found = quality(_answers(output_rows(rows)))
    assert found["generation"] is None  # JSON labels are not compared as text
    assert (found["fields"]["whole"]["correct"], found["fields"]["whole"]["labelled"]) == (1, 2)
    assert found["fields"]["per_field"]["/kind"]["confusion"] == {"a": {"a": 1, "b": 1}}
    assert found["fields"]["per_field"]["/n"]["correct"] == 2
    from batchrun.output import describe_quality

    lines = describe_quality(found)
    assert any(line.startswith("  field /kind 1/2") for line in lines), lines


def test_an_openai_output_line_carries_the_json_text_as_its_content():
    from batchrun.output import openai_batch_line

    structure = {"json_schema": {"type": "object"}}
    (row,) = output_rows([replace(answer(0, "r0", '{"a": [1, 2]}'), structure=structure)])
    line = openai_batch_line(row, model="m", created=0)
    message = line["response"]["body"]["choices"][0]["message"]
    assert json.loads(message["content"]) == {"a": [1, 2]} and line["error"] is None
