"""Property tests: whatever bytes, rows or tables a spec holds, read_spec either returns a JobSpec or raises
SpecError whose every problem names the file (and the line/row when it is about one); templates are data,
never code."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.spec import JobSpec, SpecError, read_spec
from batchrun.spec.template import Field, RowProblem, parse_template, render_template

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KNOWN_KEYS = ["id", "custom_id", "prompt", "messages", "system", "choices", "max_new_tokens", "stop",
              "method", "url", "body"]

json_scalars = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=True) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["role", "content", "x"]) | st.text(max_size=4),
                                             inner, max_size=3), max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "bot"]),
                                           "content": st.text(max_size=10)}), max_size=3)
plausible_values = {
    "id": st.text(max_size=5) | st.integers(-3, 50) | st.booleans(),
    "custom_id": st.text(max_size=5) | st.integers(0, 50),
    "prompt": st.text(max_size=20),
    "messages": messages,
    "system": st.text(max_size=5),
    "choices": st.lists(st.text(max_size=4), max_size=3),
    "max_new_tokens": st.integers(-2, 64),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
    "method": st.sampled_from(["POST", "GET"]),
    "url": st.sampled_from(["/v1/chat/completions", "/v1/embeddings"]),
    "body": st.fixed_dictionaries({"messages": messages}, optional={"max_tokens": st.integers(-1, 9),
                                                                     "n": st.integers(0, 3), "stop": json_values}),
}


@st.composite
def spec_rows(draw) -> dict:
    """Mostly plausible rows (known keys, near-right types), sometimes any JSON value under any key."""
    keys = draw(st.lists(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), max_size=5, unique=True))
    return {key: draw(plausible_values[key] if key in plausible_values and draw(st.booleans()) else json_values)
            for key in keys}


def mutate(line: bytes, data: st.DataObject) -> bytes:
    """Delete, insert or overwrite a few bytes, as a corrupted or hand-edited file would."""
    for _ in range(data.draw(st.integers(0, 3))):
        position = data.draw(st.integers(0, len(line)))
        action = data.draw(st.sampled_from(["delete", "insert", "replace"]))
        byte = data.draw(st.binary(min_size=1, max_size=1))
        if action == "delete":
            line = line[:position] + line[position + 1:]
        elif action == "insert":
            line = line[:position] + byte + line[position:]
        else:
            line = line[:position] + byte + line[position + 1:]
    return line


def assert_read_or_refused(path: Path, unit: str, **options) -> JobSpec | None:
    """read_spec must return a JobSpec or raise SpecError naming the file (and line/row) in every problem."""
    try:
        spec = read_spec(path, **options)
    except SpecError as error:
        assert error.problems
        row_problem = re.compile(re.escape(str(path)) + (r":line \d+: " if unit == "line" else r": row \d+: "))
        for problem in error.problems:
            assert row_problem.match(problem) or problem.startswith(f"{path}: "), problem
        return None
    assert spec.total_rows == len(spec.requests) + len(spec.invalid) > 0
    assert all(request.location.startswith(str(path)) for request in spec.requests)
    indexes = [row.index for row in spec.requests + spec.invalid]
    assert sorted(indexes) == list(range(spec.total_rows))
    return spec


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("spec-fuzz")


@FUZZ
@given(content=st.binary(max_size=300))
def test_random_bytes_are_read_or_refused(fuzz_dir, content):
    path = fuzz_dir / "random.jsonl"
    path.write_bytes(content)
    assert_read_or_refused(path, "line")


@FUZZ
@given(rows=st.lists(spec_rows(), min_size=1, max_size=6), data=st.data(), skip=st.booleans())
def test_mutated_jsonl_lines_are_read_or_refused(fuzz_dir, rows, data, skip):
    lines = [json.dumps(row).encode() for row in rows]
    lines = [mutate(line, data) if data.draw(st.booleans()) else line for line in lines]
    path = fuzz_dir / "mutated.jsonl"
    path.write_bytes(b"\n".join(lines))
    spec = assert_read_or_refused(path, "line", skip_invalid=skip)
    if spec is not None and not skip:
        assert spec.invalid == []


@FUZZ
@given(rows=st.lists(spec_rows(), min_size=1, max_size=6),
       template=st.sampled_from(["{prompt}", "Q: {id} {x}", "{__class__}", "{{{system}}}"]),
       id_column=st.sampled_from([None, "id", "custom_id"]))
def test_jsonl_corpus_mode_is_read_or_refused(fuzz_dir, rows, template, id_column):
    path = fuzz_dir / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    spec = assert_read_or_refused(path, "line", template=template, id_column=id_column, skip_invalid=True)
    for request in spec.requests if spec else []:
        assert request.prompt is not None and request.messages[-1] == ("user", request.prompt)


@st.composite
def valid_rows(draw) -> list[dict]:
    count = draw(st.integers(1, 8))
    ids = draw(st.lists(st.text(min_size=1, max_size=6), min_size=count, max_size=count, unique=True))
    rows = []
    for row_id in ids:
        row = {"id": row_id, "prompt": draw(st.text(min_size=1, max_size=30))}
        if draw(st.booleans()):
            row["choices"] = draw(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=4, unique=True))
        elif draw(st.booleans()):
            row["max_new_tokens"] = draw(st.integers(1, 512))
        rows.append(row)
    return rows


@FUZZ
@given(rows=valid_rows())
def test_valid_rows_survive_unchanged(fuzz_dir, rows):
    path = fuzz_dir / "valid.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    spec = read_spec(path)
    assert [(r.id, r.prompt, r.choices) for r in spec.requests] == [
        (row["id"], row["prompt"], tuple(row["choices"]) if "choices" in row else None) for row in rows]
    assert [r.max_new_tokens for r in spec.requests] == [
        0 if "choices" in row else row.get("max_new_tokens", 16) for row in rows]


message_type = pa.struct([("role", pa.string()), ("content", pa.string())])
column_types = {
    "string": (pa.string(), st.text(max_size=8)),
    "int": (pa.int64(), st.integers(-3, 2**40)),
    "float": (pa.float64(), st.floats(allow_nan=True)),
    "bool": (pa.bool_(), st.booleans()),
    "binary": (pa.binary(), st.binary(max_size=4)),
    "strings": (pa.list_(pa.string()), st.lists(st.text(max_size=3), max_size=3)),
    "messages": (pa.list_(message_type), st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "robot"]), "content": st.text(max_size=5)}), max_size=3)),
}


@st.composite
def parquet_tables(draw, names) -> pa.Table:
    rows = draw(st.integers(0, 6))
    chosen = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    columns = {}
    for name in chosen:
        arrow_type, values = column_types[draw(st.sampled_from(sorted(column_types)))]
        columns[name] = pa.array(draw(st.lists(st.none() | values, min_size=rows, max_size=rows)), arrow_type)
    return pa.table(columns)


@FUZZ
@given(table=parquet_tables(st.sampled_from(KNOWN_KEYS[:8] + ["__index_level_0__"]) | st.text(min_size=1, max_size=4)),
       skip=st.booleans())
def test_random_parquet_tables_are_read_or_refused(fuzz_dir, table, skip):
    path = fuzz_dir / "random.parquet"
    pq.write_table(table, path)
    assert_read_or_refused(path, "row", skip_invalid=skip)


@FUZZ
@given(table=parquet_tables(st.sampled_from(["text", "doc", "n", "choices", "max_new_tokens", "stop"])))
def test_random_parquet_corpora_are_read_or_refused(fuzz_dir, table):
    path = fuzz_dir / "corpus.parquet"
    pq.write_table(table, path)
    assert_read_or_refused(path, "row", template="Doc {text} #{n}", id_column="doc", skip_invalid=True)


@FUZZ
@given(template=st.text(alphabet="{}.[]!:ab _", max_size=12))
def test_templates_parse_into_plain_names_or_are_refused(template):
    try:
        parts = parse_template(template)
    except SpecError as error:
        assert all(problem.startswith("template: ") for problem in error.problems)
        return
    for part in parts:
        if isinstance(part, Field):
            assert part.name and not set(part.name) & set("{}.[]!:") and part.name == part.name.strip()
    # Re-escaping the literal text must give back the template exactly: nothing was interpreted.
    rebuilt = "".join(f"{{{part.name}}}" if isinstance(part, Field) else part.replace("{", "{{").replace("}", "}}")
                      for part in parts)
    assert rebuilt == template


@pytest.mark.parametrize("template", ["{a.__class__}", "{a[0]}", "{a.__class__.__mro__}", "{a!r}", "{a:{b}}"])
def test_templates_reaching_into_values_are_refused(template):
    with pytest.raises(SpecError, match="^template: "):
        parse_template(template)


def test_dunder_names_are_looked_up_as_columns_not_attributes():
    parts = parse_template("{__class__}{__dict__}")
    assert render_template(parts, {"__class__": "A", "__dict__": "B"}) == "AB"
    with pytest.raises(RowProblem, match="column '__class__' \\(named in the template\\) is missing"):
        render_template(parts, {"a": "x"})
