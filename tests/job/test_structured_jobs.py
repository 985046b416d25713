"""Structured rows end to end: decoding under each row's grammar, every answer validated by jsonschema apart from
the grammar, forced tokens fed in one call giving exactly the tokens of one token a pass, and a job killed
mid-decode finishing with the answers of an uninterrupted run."""
from __future__ import annotations

import functools
import json

import pytest

from batchrun.job import execute
from batchrun.runtime import PoolPlan
from batchrun.store import Store
from tests.job.test_resume import run_killed, run_to_end, submit_args
from tests.spec.test_structure_probe import PROBE, REFUSED
from tests.support import openai_line, run_job, write_jsonl

TICKET = {"type": "object", "properties": {
    "order": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
    "kind": {"enum": ["refund", "delay", "damage"]}, "urgent": {"type": "boolean"}},
    "required": ["order", "kind", "urgent"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
LINES = {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
    "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}},
    "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
    "additionalProperties": False}
TICKETS = ["Order AB1234 arrived broken, I want my money back!", "Parcel CD5678 is two weeks late.",
           "The box of EF9012 was crushed in transit."]
PEOPLE = ["Alice is 31 years old.", "Bob, aged 45, called today."]
ORDERS = ["Two of SKU-7 and one of SKU-9, please.", "I'd like 5 units of A1."]


def extraction_rows(max_new_tokens: int = 48) -> list[dict]:
    """Rows over three schemas, one an OpenAI line, and a regex row."""
    rows = [{"id": f"ticket{i}", "prompt": f"Extract the ticket as JSON.\n{text}", "json_schema": TICKET,
             "max_new_tokens": max_new_tokens} for i, text in enumerate(TICKETS)]
    rows += [{"id": f"person{i}", "prompt": f"Give the person's name and age as JSON.\n{text}",
              "json_schema": PERSON, "max_new_tokens": max_new_tokens} for i, text in enumerate(PEOPLE)]
    strict = {"type": "json_schema", "json_schema": {"name": "lines", "strict": True, "schema": LINES}}
    rows += [openai_line(f"lines{i}", f"List the order lines as JSON.\n{text}", response_format=strict,
                         max_tokens=max_new_tokens + 32) for i, text in enumerate(ORDERS)]  # up to three lines
    rows.append({"id": "phone", "prompt": "Write a US phone number.", "regex": "[0-9]{3}-[0-9]{3}-[0-9]{4}",
                 "max_new_tokens": 20})
    return rows


def token_ids(db, job_id: str) -> dict:
    store = Store(db)
    try:
        return {result.id: result.token_ids for result in store.results(job_id)}
    finally:
        store.close()


def one_token_a_pass(monkeypatch) -> None:
    monkeypatch.setattr(execute, "PoolPlan", functools.partial(PoolPlan, feeds_forced=False))


@pytest.mark.slow
def test_extraction_rows_validate_and_forced_tokens_cut_the_passes(tmp_path, default_checkpoint, monkeypatch):
    spec = write_jsonl(tmp_path / "extract.jsonl", extraction_rows())
    fed, fed_rows = run_job(spec, tmp_path, default_checkpoint, "fed")
    one_token_a_pass(monkeypatch)
    single, single_rows = run_job(spec, tmp_path, default_checkpoint, "single")
    # The same tokens, with or without the forced ones fed together, and at least 30% fewer passes with them.
    assert token_ids(tmp_path / "fed.db", fed.job_id) == token_ids(tmp_path / "single.db", single.job_id)
    assert fed.passes_now <= 0.7 * single.passes_now, (fed.passes_now, single.passes_now)
    floats = {"logprob": None, "lowest_logprob": None}  # the same tokens' log-probs, from calls of other widths
    assert [{**row, **floats} for row in fed_rows] == [{**row, **floats} for row in single_rows]
    for column in floats:
        assert [row[column] for row in fed_rows] == pytest.approx([row[column] for row in single_rows], abs=1e-3)
    for row in fed_rows:
        assert row["finish_reason"] == "stop", row  # every row closes its JSON within its limit
        assert row["schema_valid"] is True and row["schema_errors"] == [], row
        if row["id"] != "phone":
            assert json.loads(row["json"]) == json.loads(row["answer"])
    assert {key: fed.quality["structured"][key] for key in ("rows", "valid", "invalid", "cut")} == {
        "rows": 8, "valid": 8, "invalid": 0, "cut": 0}
    assert all(row["forced_tokens"] > 0 and row["lowest_logprob"] <= 0 for row in fed_rows)
    assert fed.grammar["forced_tokens"] > 0 and fed.grammar["share_of_pass_time"] < 0.05


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_forced_tokens_fed_together_give_the_tokens_of_one_token_a_pass(tmp_path, tiny_checkpoint, monkeypatch,
                                                                        streaming):
    """A random model's strings run long and its rows end at different passes: wide feeds beside one-token ones,
    rows admitted beside live ones, rows cut by the limit."""
    model = tiny_checkpoint("llama")
    spec = write_jsonl(tmp_path / "extract.jsonl", extraction_rows(max_new_tokens=24))
    fed, fed_rows = run_job(spec, tmp_path, model, "fed", streaming=streaming, batch_size=3)
    one_token_a_pass(monkeypatch)
    single, single_rows = run_job(spec, tmp_path, model, "single", streaming=streaming, batch_size=3)
    assert token_ids(tmp_path / "fed.db", fed.job_id) == token_ids(tmp_path / "single.db", single.job_id)
    assert fed.passes_now < single.passes_now
    assert [(r["answer"], r["grammar_overrides"], r["forced_tokens"]) for r in fed_rows] == [
        (r["answer"], r["grammar_overrides"], r["forced_tokens"]) for r in single_rows]
    assert [r["logprob"] for r in fed_rows] == pytest.approx([r["logprob"] for r in single_rows], abs=1e-3)
    for row in fed_rows:  # the grammar's end closes a row; the limit cuts the others, said so
        if row["finish_reason"] == "stop":
            assert row["schema_valid"] is True, row
        else:
            assert (row["finish_reason"], row["error"], row["schema_valid"]) == ("length", "json_incomplete", False)


def test_a_job_killed_mid_decode_finishes_with_the_uninterrupted_answers(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = write_jsonl(tmp_path / "extract.jsonl", extraction_rows(max_new_tokens=30))
    options = ("--batch-size", "8")
    run_to_end(submit_args(spec, model, tmp_path / "ref.db", tmp_path / "ref.parquet", *options))
    db = tmp_path / "job.db"
    args = submit_args(spec, model, db, tmp_path / "job.parquet", *options)
    for kill_at in ("committed:2", "committed:3"):  # mid-decode: rows hold kept tokens, forced ones among them
        run_killed(args, kill_at, tmp_path / f"killed-{kill_at}.log")
    resumed = run_to_end(args)
    assert any("ended without finishing" in note for note in resumed["notes"])
    import pyarrow.parquet as pq

    got, want = pq.read_table(tmp_path / "job.parquet").to_pylist(), pq.read_table(tmp_path / "ref.parquet").to_pylist()
    for row, expected in zip(got, want):
        for column in ("id", "answer", "finish_reason", "output_tokens", "error", "json", "schema_valid",
                       "grammar_overrides", "forced_tokens"):  # the grammar's counts kept across the kills
            assert row[column] == expected[column], (row["id"], column)
        assert row["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
        assert row["lowest_logprob"] == pytest.approx(expected["lowest_logprob"], abs=1e-4)


@pytest.mark.slow
def test_the_probe_schemas_on_the_default_model(tmp_path, default_checkpoint):
    """Every probe feature on the model: an answer that closes its JSON validates, the engine and the validator
    never disagree; the refused features never run, their rows naming the keyword."""
    rows = [{"id": name, "prompt": f"Answer with a JSON value only: an example of {name}.", "json_schema": schema,
             "max_new_tokens": 40} for name, (schema, _, _) in PROBE.items()]
    summary, answers = run_job(write_jsonl(tmp_path / "probe.jsonl", rows), tmp_path, default_checkpoint, "probe",
                               skip_invalid=True)
    by_id = {row["id"]: row for row in answers}
    for name, keyword in REFUSED.items():
        assert by_id[name]["finish_reason"] == "error"
        assert f"cannot enforce the keyword(s) {keyword}" in by_id[name]["error"]
    ran = [row for row in answers if row["id"] not in REFUSED]
    closed = [row for row in ran if row["finish_reason"] == "stop"]
    # 16 of 22 close within 40 tokens on this model; the others run digits or words to the limit
    assert len(closed) >= 14, [(row["id"], row["answer"]) for row in ran if row not in closed]
    assert all(row["schema_valid"] is True for row in closed), [row for row in closed if not row["schema_valid"]]
    cut = [row for row in ran if row["finish_reason"] == "length"]
    assert all(row["error"] == "json_incomplete" and row["schema_valid"] is False for row in cut)
    assert {key: summary.quality["structured"][key] for key in ("rows", "valid", "invalid", "cut")} == {
        "rows": 22, "valid": len(closed), "invalid": 0, "cut": len(cut)}


def test_the_plan_warns_a_schema_row_left_at_the_default_limit(tmp_path, tiny_checkpoint):
    from batchrun.job import JobOptions, plan_report

    model = str(tiny_checkpoint("llama"))
    rows = [{"id": "short", "prompt": "x", "json_schema": TICKET}, {"id": "long", "prompt": "x",
                                                                   "json_schema": TICKET, "max_new_tokens": 80}]
    caveats = plan_report(write_jsonl(tmp_path / "s.jsonl", rows), [model], JobOptions(model=model))[
        "candidates"][0]["caveats"]
    (caveat,) = [c for c in caveats if "structured row(s)" in c]
    assert caveat.startswith("1 structured row(s) allow fewer tokens than a typical answer of their schema takes "
                             f"({tmp_path / 's.jsonl'}:1: max_new_tokens 16, estimated ")


def test_corpus_mode_json_schema_from_the_command_line(tmp_path, tiny_checkpoint):
    from tests.support import invoke

    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    corpus = write_jsonl(tmp_path / "people.jsonl", [{"text": text} for text in PEOPLE])
    result = invoke("submit", corpus, "--model", tiny_checkpoint("llama"), "--template", "Who is it? {text}",
                    "--json-schema", tmp_path / "person.json", "--max-new-tokens", "20", "--db", tmp_path / "j.db",
                    "--output", tmp_path / "out.parquet", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["quality"]["structured"]["rows"] == 2
    loose = tmp_path / "loose.json"
    loose.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    refused = invoke("plan", corpus, "--model", tiny_checkpoint("llama"), "--template", "{text}", "--json-schema",
                     loose)
    assert refused.exit_code != 0 and "cannot enforce the keyword(s) uniqueItems" in refused.output


def test_a_limit_inside_the_grammars_forced_tokens_cuts_the_row_it_never_closes_it(tmp_path, tiny_checkpoint):
    """An enum value's first token forces the rest of the value and the closing '"}': a limit that falls inside
    those forced tokens cuts the row (length, json_incomplete), and the grammar must not count the tokens past the
    limit as written, which would end the row as if its JSON had closed."""
    schema = {"type": "object", "properties": {"kind": {"enum": ["replacement", "delivery"]}}, "required": ["kind"],
              "additionalProperties": False}
    rows = [{"id": limit, "prompt": f"Ticket {limit}: what does the customer want?", "json_schema": schema,
             "max_new_tokens": limit} for limit in range(1, 33)]
    _, answers = run_job(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, tiny_checkpoint("llama"), "cut")
    finishes = {row["finish_reason"] for row in answers}
    assert finishes == {"stop", "length"}, answers  # the limits span the answer's length
    for row in answers:
        if row["finish_reason"] == "stop":  # the grammar's end: the engine and the validator agree
            assert row["schema_valid"] is True and json.loads(row["answer"])["kind"] in ("replacement", "delivery")
        else:
            assert (row["output_tokens"], row["error"], row["schema_valid"]) == (row["id"], "json_incomplete", False)
