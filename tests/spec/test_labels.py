"""Labels, metadata and kept columns as the spec reader takes them, and the content-free rows built from a template."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.spec import SpecError, content_free_rows, read_spec
from tests.support import only_problem, write_jsonl

CHOICE = {"prompt": "Is it good?", "choices": ["yes", "no"]}


def test_a_choice_label_must_be_one_of_the_choices(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{**CHOICE, "id": 1, "label": "maybe"}])
    assert only_problem(path) == f"{path}:line 1: label 'maybe' is not one of the row's choices ('yes', 'no')"


def test_a_label_matching_a_choice_loosely_takes_its_spelling_and_numbers_their_digits(tmp_path):
    rows = [{**CHOICE, "id": 1, "label": " Yes"}, {"id": 2, "prompt": "Stars?", "choices": ["1", "2", "3"],
                                                   "label": 3}, {"id": 3, "prompt": "Capital of France?",
                                                                 "label": "Paris"}, {**CHOICE, "id": 4}]
    requests = read_spec(write_jsonl(tmp_path / "a.jsonl", rows)).requests
    assert [request.label for request in requests] == ["yes", "3", "Paris", None]


@pytest.mark.parametrize("label, reason", [(True, "label must be a string or a whole number, got a boolean (True)"),
                                           (4.5, "label must be a string or a whole number, got a number (4.5)"),
                                           ("", "label is empty"),
                                           (["yes"], "label must be a string or a whole number, got a list")])
def test_labels_of_the_wrong_kind_are_refused(tmp_path, label, reason):
    path = write_jsonl(tmp_path / "a.jsonl", [{**CHOICE, "id": 1, "label": label}])
    assert only_problem(path) == f"{path}:line 1: {reason}"


def test_metadata_must_be_an_object_and_rides_with_the_row(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{**CHOICE, "id": 1, "metadata": {"batch": [1, 2]}}])
    assert read_spec(path).requests[0].carried == {"metadata": {"batch": [1, 2]}}
    path = write_jsonl(tmp_path / "b.jsonl", [{**CHOICE, "id": 1, "metadata": "web"}])
    assert only_problem(path) == f"{path}:line 1: metadata must be a JSON object, got a string"


def test_a_misspelt_label_key_is_still_caught(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{**CHOICE, "id": 1, "lable": "yes"}])
    assert "unknown key 'lable' (did you mean 'label'?)" in only_problem(path)


def test_corpus_label_column_and_kept_columns_from_parquet(tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": ["good", "bad"], "gold": ["yes", None], "site": ["a", "b"],
                             "unused": [1, 2]}), path)
    spec = read_spec(path, template="Is {text} good?", choices=["yes", "no"], label_column="gold",
                     keep_columns=["site"])
    assert [(r.label, r.carried) for r in spec.requests] == [("yes", {"site": "a"}), (None, {"site": "b"})]
    everything = read_spec(path, template="Is {text} good?", choices=["yes", "no"], keep_columns=["*"])
    assert everything.requests[0].carried == {"text": "good", "gold": "yes", "site": "a", "unused": 1}


def test_a_refused_corpus_row_keeps_the_columns_it_has(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "good", "site": "a", "page": 1},
                                              {"text": None, "site": "b", "page": 2},  # the template's field is null
                                              {"text": "bad", "page": 3}])  # a kept column it lacks
    everything = read_spec(path, template="Is {text} good?", choices=["yes", "no"], keep_columns=["*"],
                           skip_invalid=True)
    assert [(bad.index, bad.carried) for bad in everything.invalid] == [(1, {"text": None, "site": "b", "page": 2})]
    named = read_spec(path, template="Is {text} good?", choices=["yes", "no"], keep_columns=["site", "page"],
                      skip_invalid=True)
    assert [(bad.index, bad.carried) for bad in named.invalid] == [(1, {"site": "b", "page": 2}),
                                                                    (2, {"site": None, "page": 3})]
    assert [bad.carried for bad in read_spec(path, template="Is {text} good?", choices=["yes", "no"],
                                             skip_invalid=True).invalid] == [None]


@pytest.mark.parametrize("options, reason", [
    ({"label_column": "gold"}, "label_column only applies with a template (corpus mode)"),
    ({"template": "Is {gold} right?", "label_column": "gold"},
     "the template reads the label column 'gold': the model would see its answer"),
    ({"template": "Is {text} good?", "label_column": "golden"},
     "no row has a label in column 'golden' (label_column); check the column's name"),
])
def test_label_column_mistakes_are_refused(tmp_path, options, reason):
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "good", "gold": "yes"}])
    with pytest.raises(SpecError) as refused:
        read_spec(path, choices=["yes", "no"], **options)
    assert reason in str(refused.value)


def test_content_free_rows_fill_every_field_with_each_content_free_value(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"title": "A", "body": "good", "choices": ["yes", "no"]},
                                              {"title": "B", "body": "bad", "choices": ["yes", "no"]},
                                              {"title": "C", "body": "ok", "choices": ["1", "2", "3"]}])
    template = "Title: {title}\nBody: {body}\nGood?"
    spec = read_spec(path, template=template, system="Be brief.")
    rows = content_free_rows(template, spec.requests)
    assert [row["prompt"] for row in rows[:3]] == ["Title: N/A\nBody: N/A\nGood?", "Title: \nBody: \nGood?",
                                                   "Title: [MASK]\nBody: [MASK]\nGood?"]
    assert [row["choices"] for row in rows] == [["yes", "no"]] * 3 + [["1", "2", "3"]] * 3
    assert all(row["system"] == "Be brief." for row in rows) and len({row["id"] for row in rows}) == 6


def test_content_free_rows_need_a_template_and_one_system_message_per_choice_set(tmp_path):
    prompts = read_spec(write_jsonl(tmp_path / "p.jsonl", [{**CHOICE, "id": 1}])).requests
    with pytest.raises(SpecError, match="needs corpus mode"):
        content_free_rows(None, prompts)
    mixed = read_spec(write_jsonl(tmp_path / "m.jsonl", [{"t": "a", "choices": ["y", "n"], "system": "S1"},
                                                         {"t": "b", "choices": ["y", "n"], "system": "S2"}]),
                      template="{t}?").requests
    with pytest.raises(SpecError, match="have different system messages"):
        content_free_rows("{t}?", mixed)
