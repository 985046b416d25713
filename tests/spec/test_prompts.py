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


def test_a_final_assistant_message_is_continued_only_where_the_row_asks(tmp_path):
    """A row asking for continue_final_message leaves its final assistant turn open, so the answer goes on from its
    text; without it the template opens a new assistant turn after it. A chat template (SmolLM2's shape) renders
    both; without one the answer follows the text either way."""
    from jinja2 import Template

    chat = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    class ChatTokenizer:
        chat_template = chat

        def apply_chat_template(self, messages, add_generation_prompt=False, continue_final_message=False,
                                tokenize=False):
            text = Template(chat).render(messages=messages, add_generation_prompt=add_generation_prompt)
            if continue_final_message:  # as transformers does: cut after the final message's text
                final = messages[-1]["content"]
                text = text[:text.rindex(final) + len(final)]
            return text

    conversation = [{"role": "user", "content": "Is the sky blue?"}, {"role": "assistant", "content": "Reason: it"}]
    spec = read_spec(write_jsonl(tmp_path / "jobs.jsonl", [
        {"id": "continued", "messages": conversation, "continue_final_message": True},
        {"id": "new turn", "messages": conversation},
        {"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": conversation, "continue_final_message": True}}]))
    continued, new_turn, openai = (render_text(ChatTokenizer(), request, raw=False) for request in spec.requests)
    assert continued == openai == "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\nReason: it"
    assert new_turn.endswith("Reason: it<|im_end|>\n<|im_start|>assistant\n")
    assert [render_text(NO_TEMPLATE, request, raw=True) for request in spec.requests[:2]] == [
        "Is the sky blue?\n\nReason: it"] * 2
