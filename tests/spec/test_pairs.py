"""Pair rows as the spec reader takes them: two requests per row, one per order, each with the prompt filled as its
order says and the label the order should answer; corpus mode's pair columns; and every refusal naming the row."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec import PairOrder, SpecError, read_spec
from tests.support import only_problem, write_jsonl

READY_JOB = Path(__file__).resolve().parents[2] / "jobs" / "answer-judging.jsonl"
PROMPT = "Question: {q}\nAnswer A: {a}\nAnswer B: {b}\nBetter:"
PAIR = {"prompt": "Q: 2+2?\nA: {a}\nB: {b}\nBetter:", "a": "4", "b": "five", "choices": [" A", " B"]}


def test_a_pair_row_runs_as_two_orders_with_adjacent_indices(tmp_path):
    rows = [{"id": "plain", "prompt": "Hi?", "choices": ["yes", "no"]}, {**PAIR, "id": "p", "label": "a"},
            {"id": "broken", "prompt": "x", "a": "1", "b": "2", "choices": [" A", " B"]},
            {"id": "last", "prompt": "Bye?", "choices": ["yes", "no"]}]
    spec = read_spec(write_jsonl(tmp_path / "pairs.jsonl", rows), skip_invalid=True)
    assert [(r.index, r.id) for r in spec.requests] == [(0, "plain"), (1, "p"), (2, "p"), (4, "last")]
    assert [(bad.index, bad.id) for bad in spec.invalid] == [(3, "broken")]
    first, second = spec.requests[1:3]
    assert first.prompt == "Q: 2+2?\nA: 4\nB: five\nBetter:" and second.prompt == "Q: 2+2?\nA: five\nB: 4\nBetter:"
    # the label names the answer; each order's request expects the choice of the slot that answer sits in
    assert (first.label, second.label) == (" A", " B")
    assert first.pair == PairOrder("ab", 1, 4, "a") and second.pair == PairOrder("ba", 1, 4, "a")
    assert spec.pair_rows == 1 and spec.total_rows == 5 and spec.requests[0].pair is None


def test_a_pair_label_is_a_b_or_tie_and_a_tie_names_no_slot(tmp_path):
    rows = [{**PAIR, "id": 1, "label": " B"}, {**PAIR, "id": 2, "label": "tie"}]
    requests = read_spec(write_jsonl(tmp_path / "pairs.jsonl", rows)).requests
    assert [(r.label, r.pair.label) for r in requests] == [(" B", "b"), (" A", "b"), (None, "tie"), (None, "tie")]
    path = write_jsonl(tmp_path / "bad.jsonl", [{**PAIR, "id": 1, "label": "first"}])
    assert only_problem(path) == (f"{path}:line 1: label of a pair row names the better answer: a, b or tie; "
                                  "got 'first'")


def test_answers_holding_the_other_placeholder_stay_as_written(tmp_path):
    row = {**PAIR, "prompt": "B: {b}\nA: {a}\n", "a": "see {b}", "b": "{a}{a}"}
    first, second = read_spec(write_jsonl(tmp_path / "pairs.jsonl", [row])).requests
    assert first.prompt == "B: {a}{a}\nA: see {b}\n" and second.prompt == "B: see {b}\nA: {a}{a}\n"


@pytest.mark.parametrize("change, reason", [
    ({"prompt": "A: {a} B: {b} again {a}"}, "a pair row's prompt holds {a} exactly once; this one holds it 2 times"),
    ({"prompt": "A: {a}"}, "a pair row's prompt holds {b} exactly once; this one holds it 0 times"),
    ({"b": None}, "a pair row has both a and b; this row has no b"),
    ({"b": 5}, "b must be a string, got an integer (5)"),
    ({"choices": [" A", " B", " C"]},
     "a pair row has exactly two choices (the first slot's and the second's); this one has 3"),
    ({"choices": None, "max_new_tokens": 5}, "a pair row is judged by its two choices; max_new_tokens does not apply "
                                             "to it"),
    ({"choices": None}, "a pair row is a choice row: give two choices, the first naming the first slot, the second "
                        "the second"),
    ({"prompt": None, "messages": [{"role": "user", "content": "{a} or {b}?"}]},
     "a pair row is a prompt row: its prompt holds {a} and {b} (a messages row cannot be one)"),
])
def test_a_pair_row_that_cannot_run_in_both_orders_is_refused_by_its_line(tmp_path, change, reason):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"id": 1, "prompt": "Hi?", "choices": ["y", "n"]},
                                                  {**PAIR, "id": 2, **change}])
    assert only_problem(path) == f"{path}:line 2: {reason}"


def test_corpus_pair_columns_swap_in_the_second_order(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"q": ["2+2?", "sky?"], "left": ["4", "blue"], "right": ["five", "green"],
                             "gold": ["A", None]}), path)
    spec = read_spec(path, template=PROMPT.replace("{a}", "{left}").replace("{b}", "{right}"), choices=[" A", " B"],
                     pair_columns="left,right", label_column="gold", keep_columns=["left"])
    assert [r.prompt for r in spec.requests[:2]] == ["Question: 2+2?\nAnswer A: 4\nAnswer B: five\nBetter:",
                                                      "Question: 2+2?\nAnswer A: five\nAnswer B: 4\nBetter:"]
    assert [(r.index, r.id, r.label, r.pair.order) for r in spec.requests] == [
        (0, 1, " A", "ab"), (1, 1, " B", "ba"), (2, 2, None, "ab"), (3, 2, None, "ba")]
    assert spec.requests[0].pair == PairOrder("ab", 1, 4, "a")
    assert spec.requests[0].carried == {"left": "4"}  # the row's own columns, as the first order has them


@pytest.mark.parametrize("settings, reason", [
    ({"template": "A: {left}", "pair_columns": "left,right"},
     "the template names pair column {right} exactly once; it names it 0 times"),
    ({"template": "A: {left} B: {right}", "pair_columns": "left"}, "pair_columns names two different columns (a,b)"),
    ({"template": "A: {left} B: {right}", "pair_columns": "left,right", "id_column": "right"},
     "pair column 'right' is also the id or label column"),
    ({"pair_columns": "left,right"}, "pair_columns only applies with a template (corpus mode)"),
])
def test_pair_columns_are_checked_as_a_job_setting(tmp_path, settings, reason):
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"left": "x", "right": "y"}])
    with pytest.raises(SpecError) as caught:
        read_spec(path, choices=[" A", " B"], **settings)
    assert caught.value.problems[0].startswith(f"job setting: {reason}")


def test_corpus_columns_named_a_and_b_are_plain_data_without_pair_columns(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"a": "x", "b": "y"}])
    requests = read_spec(path, template="A: {a} B: {b}", choices=[" A", " B"]).requests
    assert [(request.prompt, request.pair) for request in requests] == [("A: x B: y", None)]


def test_a_corpus_row_without_its_pair_column_is_refused_by_its_line(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"left": "x", "right": "y"}, {"left": "x", "right": None}])
    assert only_problem(path, template="A: {left} B: {right}", choices=[" A", " B"], pair_columns=("left", "right")) \
        == f"{path}:line 2: pair column 'right' is null"


def test_the_ready_judging_job_is_labelled_pair_rows_with_the_better_answer_in_either_slot():
    spec = read_spec(READY_JOB)
    firsts = [request for request in spec.requests if request.pair.order == "ab"]
    assert spec.pair_rows == len(firsts) == len(spec.requests) // 2 and not spec.invalid
    labels = [request.pair.label for request in firsts]
    assert labels.count("a") == labels.count("b") and "tie" in labels
    # the better answer is the shorter one in some pairs and the longer in others: length and verdict can part
    lengths = {(request.pair.a_chars < request.pair.b_chars) == (request.pair.label == "a")
               for request in firsts if request.pair.label != "tie" and request.pair.a_chars != request.pair.b_chars}
    assert lengths == {True, False}
