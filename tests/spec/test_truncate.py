"""Smaller input fixes: a document over the context cut only where asked (--truncate), only the document, and counted;
a choices list of one item warned about; an empty choice named by its position."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from batchrun.spec import encode_requests, read_spec
from tests.support import invoke, only_problem, run_job, write_jsonl

CONTEXT = 64
INSTRUCTION = "Is this review positive or negative?"
SYSTEM = "You label reviews."


def review(index: int) -> str:
    """A review of a few hundred tokens that says, sentence by sentence, where it is (so a cut shows which end
    went)."""
    return " ".join(f"Sentence {n} of review {index} says the kettle is fine." for n in range(40))


@pytest.fixture
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def corpus_spec(tmp_path, texts):
    return write_jsonl(tmp_path / "corpus.jsonl", [{"doc": f"d{i}", "text": text} for i, text in enumerate(texts)])


@pytest.mark.parametrize("side", ["tail", "head"])
def test_truncate_cuts_the_document_and_counts_it(tmp_path, tokenizer, side):
    template = "Review: {text}\n" + INSTRUCTION
    spec = read_spec(corpus_spec(tmp_path, [review(0), "Short and sweet."]), template=template, id_column="doc",
                     choices=("positive", "negative"), system=SYSTEM)
    refused, short = encode_requests(tokenizer, spec.requests, context_length=CONTEXT)
    assert "context is 64 tokens" in refused.error and "--truncate" in refused.error
    cut, kept = encode_requests(tokenizer, spec.requests, context_length=CONTEXT, truncate=side, template=template)
    assert cut.error is None and cut.needed_tokens() <= CONTEXT
    # Only the document is cut: the template's own text and the system message are whole, in place.
    prompt = cut.request.prompt
    assert prompt.startswith("Review: ") and prompt.endswith("\n" + INSTRUCTION)
    assert cut.request.messages[0] == ("system", SYSTEM) and cut.request.messages[-1] == ("user", prompt)
    document = prompt.removeprefix("Review: ").removesuffix("\n" + INSTRUCTION)
    assert document and document in review(0)
    assert review(0).startswith(document) if side == "tail" else review(0).endswith(document)
    # Never silently: the count is the prompt tokens the model no longer sees, and every row carries one.
    assert cut.request.carried == {"truncated_tokens": len(refused.prompt_ids) - len(cut.prompt_ids)}
    assert cut.request.carried["truncated_tokens"] >= len(refused.prompt_ids) - CONTEXT
    assert (kept.error, kept.prompt_ids, kept.request.carried) == (None, short.prompt_ids, {"truncated_tokens": 0})


def test_truncate_cuts_a_prompt_rows_text_and_refuses_what_cannot_fit(tmp_path, tokenizer):
    spec = read_spec(write_jsonl(tmp_path / "rows.jsonl", [
        {"id": "long", "prompt": review(1), "system": SYSTEM, "max_new_tokens": 4},
        {"id": "talk", "messages": [{"role": "user", "content": review(2)}], "max_new_tokens": 4},
        {"id": "huge-answer", "prompt": "Hi", "max_new_tokens": CONTEXT}]))
    long, talk, huge = encode_requests(tokenizer, spec.requests, context_length=CONTEXT, truncate="tail")
    assert long.error is None and review(1).startswith(long.request.prompt)
    assert long.request.messages[0] == ("system", SYSTEM) and long.request.carried["truncated_tokens"] > 0
    assert "has neither" in talk.error  # a messages row has no one document to cut
    assert "whole document would not make it fit" in huge.error  # the answer's tokens alone fill the context


def test_a_row_over_the_context_by_its_answer_is_told_to_ask_fewer_new_tokens(tmp_path, tokenizer):
    """--truncate cuts the document, never the answer: where max_new_tokens alone fills the context it is no way
    out, and where the prompt fits alone the bound that makes the row fit is said."""
    spec = read_spec(write_jsonl(tmp_path / "rows.jsonl", [
        {"id": "huge", "prompt": "Hi", "max_new_tokens": 100000},
        {"id": "near", "prompt": "Hi", "max_new_tokens": CONTEXT - 1},
        {"id": "choice", "prompt": review(3), "choices": ["yes", "no"]}]))
    huge, near, choice = encode_requests(tokenizer, spec.requests, context_length=CONTEXT)
    room = CONTEXT - len(huge.prompt_ids)
    assert 0 < room < CONTEXT - 1
    assert huge.error.endswith(f"but the model's context is {CONTEXT} tokens; lower max_new_tokens to at most {room} "
                               "for this prompt (--max-new-tokens, or the row's own)")
    assert near.error.endswith(f"; lower max_new_tokens to at most {room} for this prompt (--max-new-tokens, or the "
                               "row's own), or cut the document with --truncate head|tail")
    assert choice.error.endswith("(batchrun never truncates a prompt unless asked: --truncate head|tail cuts the "
                                 "document)")


def test_truncate_runs_end_to_end_with_the_count_in_the_output(tmp_path, tiny_checkpoint):
    model = tiny_checkpoint("llama")
    spec = corpus_spec(tmp_path, ["word " * 400, "A fine kettle."])
    options = dict(template="Review: {text}\nVerdict?", id_column="doc", choices=("good", "bad"))
    _, refused = run_job(spec, tmp_path, model, "refused", **options)
    assert [row["finish_reason"] for row in refused] == ["error", "choice"] and "truncated_tokens" not in refused[0]
    _, answered = run_job(spec, tmp_path, model, "cut", truncate="tail", **options)
    assert [row["finish_reason"] for row in answered] == ["choice", "choice"]
    assert answered[0]["truncated_tokens"] > 0 and answered[1]["truncated_tokens"] == 0
    # the short row is answered as it was
    assert dict(answered[1]["choice_probs"]) == pytest.approx(dict(refused[1]["choice_probs"]))


def test_one_choice_warns(tmp_path, tiny_checkpoint):
    spec = write_jsonl(tmp_path / "one.jsonl", [{"id": "a", "prompt": "Is it good?", "choices": ["yes"]},
                                                {"id": "b", "prompt": "Is it bad?", "choices": ["yes", "no"]}])
    model = tiny_checkpoint("llama")
    result = invoke("plan", spec, "--model", model, "--json")
    (candidate,) = json.loads(result.output)["candidates"]
    warned = [caveat for caveat in candidate["caveats"] if "single choice" in caveat]
    assert len(warned) == 1 and "1 row(s)" in warned[0] and "one.jsonl:1" in warned[0]
    assert "probability 1.0" in warned[0]
    summary, answers = run_job(spec, tmp_path, model, "one")
    assert any("single choice" in note for note in summary.notes)
    assert dict(answers[0]["choice_probs"]) == {"yes": 1.0}  # what the warning is about


def test_empty_choice_named_by_position(tmp_path):
    spec = write_jsonl(tmp_path / "empty.jsonl", [{"id": "a", "prompt": "x", "choices": ["", "negative"]}])
    assert only_problem(spec).endswith("choices[0] is empty")
    spec = write_jsonl(tmp_path / "later.jsonl", [{"id": "a", "prompt": "x", "choices": ["yes", "no", ""]}])
    assert only_problem(spec).endswith("choices[2] is empty")


def test_truncate_output_column_reads_back(tmp_path, tiny_checkpoint):
    """The count travels with the job's rows: an export of the answers so far carries it too."""
    model = tiny_checkpoint("llama")
    spec = corpus_spec(tmp_path, ["word " * 400])
    run_job(spec, tmp_path, model, "first", template="{text}\nVerdict?", id_column="doc", choices=("good", "bad"),
            truncate="head")
    exported = tmp_path / "exported.parquet"
    result = invoke("results", "--db", tmp_path / "first.db", "-o", exported)
    assert result.exit_code == 0, result.output
    assert pq.read_table(exported).column("truncated_tokens").to_pylist()[0] > 0
