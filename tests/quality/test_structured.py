"""Structured answers checked by jsonschema, apart from the grammar: parsed JSON text, validity, JSON-pointer paths
of what fails; a JSON row cut by its limit is json_incomplete; the output's columns and counts."""
from __future__ import annotations

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
    rows = [replace(answer(0, "ok", '{"n": 3}'), structure=structure),
            replace(answer(1, "bad", '{"n": "x"}'), structure=structure),
            replace(answer(2, "cut", '{"n": 12345'), structure=structure, finish_reason="length"),
            answer(3, "plain", "hello")]
    table = results_table(output_rows(rows)).to_pylist()
    assert [(r["json"], r["schema_valid"], r["error"], r["finish_reason"]) for r in table] == [
        ('{"n": 3}', True, None, "stop"), ('{"n": "x"}', False, None, "stop"),
        (None, False, "json_incomplete", "length"), (None, None, None, "stop")]
    assert table[1]["schema_errors"] == ["/n: 'x' is not of type 'integer'"]
    assert table[2]["schema_errors"][0].startswith("/: json_incomplete")
    assert quality(_answers(output_rows(rows)))["structured"] == {"rows": 3, "valid": 1, "invalid": 1, "cut": 1}
    plain = results_table(output_rows([answer(0)]))  # a job without structured rows keeps its columns
    assert "schema_valid" not in plain.column_names and isinstance(plain, pa.Table)


def _answers(rows):
    from batchrun.output import JobAnswers
    from batchrun.quality import Calibration

    return JobAnswers(rows, Calibration("none"), len(rows))
