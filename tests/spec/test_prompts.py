"""What text a row becomes without a chat template (--raw, or a base model's tokenizer)."""
from types import SimpleNamespace

from batchrun.spec import read_spec
from batchrun.spec.encode import render_text
from tests.support import write_jsonl

NO_TEMPLATE = SimpleNamespace(chat_template=None)


def rendered(tmp_path, rows, **options):
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", rows), **options)
    return [render_text(NO_TEMPLATE, request, raw=True) for request in spec.requests]


def test_raw_prompt_row_keeps_its_system_message(tmp_path):
    rows = [{"prompt": "Is this good?", "system": "Answer in French."}, {"prompt": "Is this good?"},
            {"messages": [{"role": "system", "content": "Answer in French."},
                          {"role": "user", "content": "Is this good?"}]}]
    assert rendered(tmp_path, rows) == ["Answer in French.\n\nIs this good?", "Is this good?",
                                        "Answer in French.\n\nIs this good?"]


def test_raw_prompt_row_gets_the_jobs_system_option(tmp_path):
    assert rendered(tmp_path, [{"prompt": "Is this good?"}], system="Be brief.") == ["Be brief.\n\nIs this good?"]


def test_raw_prompt_is_sent_exactly_as_written(tmp_path):
    prompt = "  Review:\n\n  great  \n"
    assert rendered(tmp_path, [{"prompt": prompt}]) == [prompt]


class CaseBlindTokenizer:
    """Encodes text by lowercased characters: "Yes" and "yes" become the same tokens, as a normalising tokenizer
    makes composed and decomposed accents the same."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=True, verbose=True):
        return {"input_ids": [self.encode(text) for text in texts]}

    def encode(self, text, add_special_tokens=False, verbose=True):
        return [ord(character) for character in text.lower()]


def test_choices_the_tokenizer_cannot_tell_apart_are_an_errored_row(tmp_path):
    from batchrun.spec import encode_requests

    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", [{"prompt": "Agree?", "choices": ["Yes", "yes", "no"]},
                                            {"prompt": "Agree?", "choices": ["yes", "no"]}]))
    first, second = encode_requests(CaseBlindTokenizer(), spec.requests, raw=True)
    assert first.error == "choices 'Yes' and 'yes' encode to the same tokens: the model cannot tell them apart"
    assert second.error is None
