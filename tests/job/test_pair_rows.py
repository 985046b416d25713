"""Pair rows end to end: the two orders folded into one output row, the statistics over a job's pairs, and the
symmetry a judge run in both orders must have whatever its position bias: swapping a and b turns P(a wins) into
1 minus itself, and identical answers average to exactly one half (on tiny models and the default model)."""
from __future__ import annotations

import json

import pytest

from batchrun.output import encode_results, output_rows, pair_statistics, results_table
from batchrun.store import RowResult
from tests.job.test_resume import job_status, run_to_end, submit_args
from tests.support import invoke, run_job, write_jsonl

SWAP_TOLERANCE = 1e-6
BATCHING_TOLERANCE = 1e-5
JUDGE = "Question: {q}\nAnswer A: {a}\nAnswer B: {b}\nWhich answer is better, A or B?"
PAIRS = [("What is 2+2?", "4", "It is five, I think.", "a"), ("Capital of France?", "Lyon", "Paris", "b"),
         ("Colour of the sky on a clear day?", "blue", "blue", "tie"),
         ("Boiling point of water at sea level?", "100 degrees Celsius", "about 90", "a"),
         ("Largest planet?", "Saturn, the ringed one", "Jupiter", "b")]


def pair_rows(swapped: bool = False) -> list[dict]:
    rows = []
    for number, (question, a, b, label) in enumerate(PAIRS):
        if swapped:
            a, b, label = b, a, {"a": "b", "b": "a"}.get(label, label)
        rows.append({"id": f"p{number}", "prompt": JUDGE.replace("{q}", question), "a": a, "b": b,
                     "choices": [" A", " B"], "label": label})
    return rows


def assert_swap_symmetric(rows: list[dict], swapped: list[dict]) -> None:
    for mine, theirs in zip(rows, swapped):
        assert mine["id"] == theirs["id"]
        assert abs(mine["p_a"] + theirs["p_a"] - 1) <= SWAP_TOLERANCE, mine["id"]
        assert abs(mine["p_a_first"] + theirs["p_a_second"] - 1) <= SWAP_TOLERANCE, mine["id"]
        assert mine["consistent"] == theirs["consistent"]
        assert theirs["answer"] == {"a": "b", "b": "a"}.get(mine["answer"], mine["answer"])
        assert (mine["a_chars"], mine["b_chars"]) == (theirs["b_chars"], theirs["a_chars"])


def result(idx: int, row_id: str, probs: dict | None, order: str | None, chars=(3, 3), label=None) -> RowResult:
    pair = None if order is None else {"order": order, "a_chars": chars[0], "b_chars": chars[1], "label": label}
    failed = probs is None
    return RowResult(idx, row_id, None if failed else max(probs, key=probs.get), probs, None, None, 10, None,
                     "error" if failed else "choice", "the chat template refuses it" if failed else None, pair=pair)


def test_two_orders_fold_into_one_row_with_the_pair_statistics():
    results = [result(0, "p1", {"A": 0.8, "B": 0.2}, "ab", (10, 3), "a"),  # a wins in both orders
               result(1, "p1", {"A": 0.3, "B": 0.7}, "ba", (10, 3), "a"),
               result(2, "plain", {"yes": 0.6, "no": 0.4}, None),
               result(3, "p2", {"A": 0.9, "B": 0.1}, "ab", label="b"),  # the first slot wins in both: a tie
               result(4, "p2", {"A": 0.6, "B": 0.4}, "ba", label="b"),
               result(5, "p3", {"A": 0.5, "B": 0.5}, "ab"),
               result(6, "p3", None, "ba"),
               result(7, "p4", {"A": 0.5, "B": 0.5}, "ab")]  # its second order is not finished: left out
    rows = output_rows(results)
    assert [row.result.id for row in rows] == ["p1", "plain", "p2", "p3"]
    table = {row["id"]: row for row in results_table(rows).to_pylist()}
    assert table["p1"]["answer"] == "a" and table["p1"]["consistent"] is True and table["p1"]["correct"] is True
    assert table["p1"]["p_a_first"] == pytest.approx(0.8) and table["p1"]["p_a_second"] == pytest.approx(0.7)
    assert table["p1"]["p_a"] == pytest.approx(0.75) and table["p1"]["prompt_tokens"] == 20
    assert table["p2"]["answer"] == "tie" and table["p2"]["consistent"] is False and table["p2"]["correct"] is False
    assert table["p3"]["answer"] is None and table["p3"]["error"] == "order ba: the chat template refuses it"
    assert table["plain"]["answer"] == "yes" and table["plain"]["p_a"] is None
    found = pair_statistics(rows)
    assert (found["pairs"], found["judged"]) == (3, 2)
    assert (found["consistency"]["count"], found["consistency"]["of"]) == (1, 2)
    assert (found["first_slot"]["count"], found["first_slot"]["of"]) == (3, 4)
    assert (found["longer"]["count"], found["longer"]["of"]) == (1, 1)
    low, high = found["first_slot"]["interval"]
    assert low < 0.75 < high
    assert (found["accuracy"]["correct"], found["accuracy"]["labelled"]) == (1, 2)
    lines = [json.loads(line) for line in bytes(encode_results(rows, "jsonl")).decode().splitlines()]
    assert [line["custom_id"] for line in lines] == ["p1", "plain", "p2", "p3"]
    body = lines[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == "a" and body["p_a"] == pytest.approx(0.75)
    assert lines[0]["label"] == "a" and lines[0]["correct"] is True and lines[3]["response"] is None


@pytest.mark.parametrize("calibrate", ["none", "batch"])
def test_swapping_a_and_b_gives_one_minus_p_a_on_a_tiny_model(tmp_path, tiny_checkpoint, calibrate):
    model = tiny_checkpoint("llama")
    spec = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    swapped = write_jsonl(tmp_path / "swapped.jsonl", pair_rows(swapped=True))
    summary, rows = run_job(spec, tmp_path, model, "pairs", calibrate=calibrate)
    _, swapped_rows = run_job(swapped, tmp_path, model, "swapped", calibrate=calibrate)
    assert_swap_symmetric(rows, swapped_rows)
    identical = rows[2]
    assert identical["p_a"] == 0.5 and identical["answer"] == "tie"
    pairs = summary.quality["pairs"]
    assert pairs["pairs"] == len(PAIRS) and pairs["accuracy"]["labelled"] == len(PAIRS)
    assert pairs["first_slot"]["of"] == 2 * len(PAIRS)


def test_status_and_plan_count_the_pairs_and_both_orders(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("qwen2")
    spec = write_jsonl(tmp_path / "pairs.jsonl", pair_rows() + [{"id": "plain", "prompt": "Hi?",
                                                                 "choices": ["yes", "no"]}])
    summary = run_to_end(submit_args(spec, model, tmp_path / "j.db", tmp_path / "a.parquet", "--calibrate", "none"))
    assert summary["rows_total"] == 2 * len(PAIRS) + 1
    status = job_status(tmp_path / "j.db")
    assert status["quality"]["pairs"] == summary["quality"]["pairs"]
    assert status["quality"]["pairs"]["judged"] == len(PAIRS)
    shown = invoke("status", "--db", str(tmp_path / "j.db"))
    assert f"pairs: {len(PAIRS)} of {len(PAIRS)} pair rows judged in both orders" in shown.output
    plan = invoke("plan", str(spec), "--model", str(model))
    assert f"{2 * len(PAIRS) + 1} rows; {len(PAIRS)} pair rows judged in both orders" in plan.output
    report = (tmp_path / "a.report.html").read_text()
    assert 'data-table="pairs"' in report and "First-slot preference" in report
    assert "The labelled rows are pair rows" in report


def test_corpus_pair_columns_judge_each_row_in_both_orders(tmp_path, tiny_checkpoint):
    rows = [{"q": question, "left": a, "right": b, "gold": label} for question, a, b, label in PAIRS]
    spec = write_jsonl(tmp_path / "corpus.jsonl", rows)
    options = {"template": JUDGE.replace("{a}", "{left}").replace("{b}", "{right}"), "choices": (" A", " B"),
               "pair_columns": "left,right", "label_column": "gold", "calibrate": "none"}
    summary, got = run_job(spec, tmp_path, tiny_checkpoint("llama"), "corpus", **options)
    assert [row["id"] for row in got] == [1, 2, 3, 4, 5] and [row["label"] for row in got] == [p[3] for p in PAIRS]
    assert got[2]["p_a"] == 0.5
    assert summary.rows_total == 2 * len(PAIRS)


def test_swapping_a_and_b_gives_one_minus_p_a_on_the_default_model(tmp_path, default_checkpoint):
    spec = write_jsonl(tmp_path / "pairs.jsonl", pair_rows())
    swapped = write_jsonl(tmp_path / "swapped.jsonl", pair_rows(swapped=True))
    _, rows = run_job(spec, tmp_path, default_checkpoint, "pairs", calibrate="none")
    _, swapped_rows = run_job(swapped, tmp_path, default_checkpoint, "swapped", calibrate="none")
    assert_swap_symmetric(rows, swapped_rows)
    assert rows[2]["p_a"] == 0.5


DOCUMENTS = [
    "The committee met on Tuesday to review the proposal for a new library in the town centre. Members heard from "
    "residents, the architect and the finance officer, who set out the costs of construction, staffing and upkeep "
    "over twenty years, and the grants the town could apply for. After a long debate the committee asked for a "
    "revised plan with a smaller building and more reading rooms.",
    "Heavy rain over the weekend flooded roads in three valleys and cut power to about two thousand homes. Crews "
    "worked through Sunday night to clear fallen trees, and the river authority opened its overflow channels for "
    "the first time in a decade. Schools in the lower valley stay closed until the water has gone down and the "
    "buildings have been checked."]
SUMMARIES = [("A library plan was sent back for a smaller design.", "The town opened a library."),
             ("Residents objected to the flooding costs.", "Floods closed roads, cut power and shut schools.")]


def test_a_pair_with_a_long_question_scores_as_its_two_orders_written_out(tmp_path, default_checkpoint):
    """The two orders share their prompt up to the first answer (here a whole document), computed once for both
    (runtime/group_prefix.py): the probabilities are those of the two orders written as plain choice rows."""
    template = "Document: {d}\n\nSummary A: {a}\n\nSummary B: {b}\n\nWhich summary is better, A or B?"
    prompts = [template.replace("{d}", document) for document in DOCUMENTS]
    spec = write_jsonl(tmp_path / "pairs.jsonl", [{"id": f"p{n}", "prompt": prompt, "a": a, "b": b,
                                                  "choices": [" A", " B"]}
                                                 for n, (prompt, (a, b)) in enumerate(zip(prompts, SUMMARIES))])
    _, rows = run_job(spec, tmp_path, default_checkpoint, "pairs", calibrate="none")
    written = write_jsonl(tmp_path / "written.jsonl", [
        {"id": f"p{n}-{order}", "prompt": prompt.replace("{a}", first).replace("{b}", second),
         "choices": [" A", " B"]}
        for n, (prompt, (a, b)) in enumerate(zip(prompts, SUMMARIES))
        for order, (first, second) in (("ab", (a, b)), ("ba", (b, a)))])
    _, plain = run_job(written, tmp_path, default_checkpoint, "written", calibrate="none")
    for number, row in enumerate(rows):
        ab, ba = dict(plain[2 * number]["choice_probs"]), dict(plain[2 * number + 1]["choice_probs"])
        # float32 sums in another order: how rows share a pass moves probabilities by about 1e-5 (docs/cli.md)
        assert abs(row["p_a_first"] - ab[" A"]) <= BATCHING_TOLERANCE
        assert abs(row["p_a_second"] - ba[" B"]) <= BATCHING_TOLERANCE
