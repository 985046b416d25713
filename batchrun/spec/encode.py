"""Requests -> token ids, exactly as the model will see them. No torch.

Decisions (also in the README):
- A prompt row goes through the tokenizer's chat template as one user message (plus a system
  message when given), with the generation prompt appended. `raw=True`, or a tokenizer without a
  chat template, sends the prompt text as is (with the tokenizer's usual special tokens, e.g. BOS).
- A messages row without a chat template (or in raw mode) is rendered as its contents joined by
  blank lines: there is no neutral way to invent a template, and raw mode means "no template".
- Nothing is ever truncated: a row that does not fit the context becomes an errored row saying
  how many tokens it has and what the context is. So does a row the model's chat template refuses
  (some templates raise on a system message or on roles that do not alternate), and one whose
  prompt encodes to no tokens: the job's other rows still run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from batchrun.spec.read import Request

ENCODE_CHUNK = 4096  # rows per batched tokenizer call: large enough for the fast tokenizer's threads


@dataclass(frozen=True)
class EncodedRow:
    request: Request
    prompt_ids: tuple[int, ...]
    choice_ids: tuple[tuple[int, ...], ...]  # token ids of each choice (empty for generation rows)
    error: str | None = None  # set when the row cannot run (too long, no tokens, refused by the chat template)

    @property
    def is_choice(self) -> bool:
        return bool(self.request.choices)

    def needed_tokens(self) -> int:
        if self.is_choice:
            return len(self.prompt_ids) + max(len(c) for c in self.choice_ids)
        return len(self.prompt_ids) + self.request.max_new_tokens


def uses_chat_template(tokenizer, raw: bool) -> bool:
    return not raw and bool(getattr(tokenizer, "chat_template", None))


def render_text(tokenizer, request: Request, raw: bool) -> str:
    if uses_chat_template(tokenizer, raw):
        messages = [{"role": role, "content": content} for role, content in request.messages]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Plain text: the system message (if any) and the prompt, or a messages row's contents, a blank line apart.
    return "\n\n".join(content for _, content in request.messages)


def encode_requests(tokenizer, requests: Sequence[Request], *, raw: bool = False,
                    context_length: int | None = None) -> list[EncodedRow]:
    """Tokenize every request in batched calls; flag rows that exceed the context."""
    templated = uses_chat_template(tokenizer, raw)
    refused_by_template = _template_refusals() if templated else ()
    texts, refusals = [], {}
    for request in requests:
        try:
            texts.append(render_text(tokenizer, request, raw))
        except refused_by_template as exc:  # the model's template refuses the row ("System role not supported")
            refusals[request.index] = f"the model's chat template refuses this row: {exc}"
            texts.append("")
    # A chat template already writes BOS and friends; adding them again would double them.
    add_special = not templated
    prompt_ids: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        chunk = texts[start:start + ENCODE_CHUNK]
        prompt_ids.extend(tokenizer(chunk, add_special_tokens=add_special, verbose=False)["input_ids"])
    choice_cache: dict[str, tuple[int, ...]] = {}
    rows = []
    for request, ids in zip(requests, prompt_ids):
        choices = ()
        error = refusals.get(request.index)
        if error is None and not ids:
            error = "the prompt encodes to no tokens"
        if request.choices:
            choices = tuple(_choice_ids(tokenizer, c, choice_cache) for c in request.choices)
            empty = [c for c, t in zip(request.choices, choices) if not t]
            if empty and error is None:
                error = f"choice {empty[0]!r} encodes to no tokens"
            if error is None:
                error = _same_tokens(request.choices, choices)
        row = EncodedRow(request, tuple(ids), choices, error)
        if error is None and context_length is not None and row.needed_tokens() > context_length:
            row = EncodedRow(request, tuple(ids), choices, too_long_message(row, context_length))
        rows.append(row)
    return rows


def _same_tokens(choices: Sequence[str], choice_ids: Sequence[tuple[int, ...]]) -> str | None:
    """Two choices the tokenizer maps to the same tokens ("café" composed and decomposed) get the same score: the
    answer would be whichever comes first, with no word of it."""
    first_with: dict[tuple[int, ...], str] = {}
    for choice, ids in zip(choices, choice_ids):
        if ids in first_with:
            return (f"choices {first_with[ids]!r} and {choice!r} encode to the same tokens: the model cannot tell "
                    "them apart")
        first_with[ids] = choice
    return None


def _template_refusals() -> tuple[type[Exception], ...]:
    """What a chat template raises to refuse a row: jinja2's raise_exception, or transformers' checks."""
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    return TemplateError, ValueError, TypeError


def _choice_ids(tokenizer, choice: str, cache: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if choice not in cache:
        cache[choice] = tuple(tokenizer.encode(choice, add_special_tokens=False, verbose=False))
    return cache[choice]


def too_long_message(row: EncodedRow, context_length: int) -> str:
    prompt = len(row.prompt_ids)
    extra = row.needed_tokens() - prompt
    what = "the longest choice" if row.is_choice else "max_new_tokens"
    return (f"prompt has {prompt} tokens; with {extra} more for {what} it needs {prompt + extra}, "
            f"but the model's context is {context_length} tokens (batchrun never truncates a prompt)")


def choice_sequences(row: EncodedRow) -> list[list[int]]:
    """Single-token choices share one sequence (the prompt); otherwise one sequence per choice."""
    if _one_sequence(row):
        return [list(row.prompt_ids)]
    return [list(row.prompt_ids) + list(c) for c in row.choice_ids]


def shortest_first_pass_sequence(row: EncodedRow) -> int:
    """Length of the shortest sequence the first pass computes for `row` (see choice_sequences)."""
    return len(row.prompt_ids) + (0 if _one_sequence(row) else min(len(c) for c in row.choice_ids))


def _one_sequence(row: EncodedRow) -> bool:
    return all(len(c) == 1 for c in row.choice_ids)  # also generation rows (no choices)


def kept_positions(rows: Sequence[EncodedRow]) -> int:
    """Positions at the end of each sequence whose logits a first pass keeps: the last prompt token, and for choice
    rows every choice token but the last (so the longest choice + 1 when scoring choices)."""
    return 1 + max((len(c) for row in rows for c in row.choice_ids), default=0)
