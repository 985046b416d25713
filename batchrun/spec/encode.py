"""Requests -> token ids, exactly as the model will see them. No torch.

Decisions (also in the README):
- A prompt row goes through the tokenizer's chat template as one user message (plus a system
  message when given), with the generation prompt appended. `raw=True`, or a tokenizer without a
  chat template, sends the prompt text as is (with the tokenizer's usual special tokens, e.g. BOS).
- A messages row without a chat template (or in raw mode) is rendered as its contents joined by
  blank lines: there is no neutral way to invent a template, and raw mode means "no template".
- Nothing is truncated unless the job asks (`truncate`): a row that does not fit the context becomes
  an errored row saying how many tokens it has and what the context is. So does a row the model's
  chat template refuses (some templates raise on a system message or on roles that do not
  alternate), and one whose prompt encodes to no tokens: the job's other rows still run.
- Asked to truncate, only the document is cut (a prompt row's text, or in corpus mode the template's
  fields), never the system message, the template's own text or the chat template's, and never
  silently: every row carries the tokens cut in its `truncated_tokens` output column.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Sequence

from batchrun.spec.read import Request
from batchrun.spec.template import Field, parse_template

ENCODE_CHUNK = 4096  # rows per batched tokenizer call: large enough for the fast tokenizer's threads
TRUNCATE_SIDES = ("head", "tail")  # the end of the document a cut takes away
TRUNCATED_COLUMN = "truncated_tokens"  # the output column counting the prompt tokens a cut took away
# Tokens can merge across a cut, so a cut of exactly the excess may leave a token over: cut again, a few times at most.
CUT_ROUNDS = 8


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
    """The text the model reads: the rendered messages, then where the answer begins (Request.answer_start)."""
    return _rendered_messages(tokenizer, request, raw) + request.answer_start


def _rendered_messages(tokenizer, request: Request, raw: bool) -> str:
    if uses_chat_template(tokenizer, raw):
        messages = [{"role": role, "content": content} for role, content in request.messages]
        if request.continue_final:  # the final assistant turn left open: the answer goes on from its text
            return tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # Plain text: the system message (if any) and the prompt, or a messages row's contents, a blank line apart (a
    # final assistant message is continued either way: the answer follows the text).
    return "\n\n".join(content for _, content in request.messages)


def encode_requests(tokenizer, requests: Sequence[Request], *, raw: bool = False, context_length: int | None = None,
                    truncate: str | None = None, template: str | None = None) -> list[EncodedRow]:
    """Tokenize every request in batched calls; flag rows that exceed the context. `truncate` ("head" or "tail"):
    cut such a row's document instead, from that end, to fit (`template`: the corpus template whose fields are the
    document), and count the cut in every row's TRUNCATED_COLUMN."""
    if truncate is not None and truncate not in TRUNCATE_SIDES:
        raise ValueError(f"truncate must be one of {', '.join(TRUNCATE_SIDES)}, got {truncate!r}")
    cutting = _Cutting(tokenizer, raw, context_length, truncate, parse_template(template) if template else None)
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
            if truncate:
                row = cutting.to_fit(row)
            else:
                too_long = too_long_message(row, context_length) + _fitting_hint(row, context_length)
                row = EncodedRow(request, tuple(ids), choices, too_long)
        elif error is None and truncate:
            row = _counted(row, 0)
        rows.append(row)
    return rows


@dataclass(frozen=True)
class _Cutting:
    """How an encoding job cuts a row's document to fit the context (encode_requests' `truncate`)."""
    tokenizer: object
    raw: bool
    context_length: int | None
    side: str | None  # "head" | "tail"
    template: list[str | Field] | None  # corpus mode: the document is the template's fields

    def to_fit(self, row: EncodedRow) -> EncodedRow:
        """The row with its document cut until it fits the context, counted; or, where it has no document (a
        messages row) or would need all of it cut, the row refused as too long, saying so."""
        request, context = row.request, self.context_length
        spans = _document_spans(request.prompt, self.template) if request.prompt is not None else []
        if not spans:
            return EncodedRow(request, row.prompt_ids, row.choice_ids, too_long_message(row, context) + (
                "; --truncate cuts a prompt row's text or a template's fields, and this row has neither"))
        prompt, current = request.prompt, row
        for _ in range(CUT_ROUNDS):
            over = current.needed_tokens() - context
            if over <= 0:
                return _counted(current, len(row.prompt_ids) - len(current.prompt_ids))
            prompt, spans = _cut_document(self.tokenizer, prompt, spans, over, self.side)
            if not spans:
                why = "cutting its whole document would not make it fit"
                break
            shorter = replace(request, messages=request.messages[:-1] + (("user", prompt),), prompt=prompt)
            current = EncodedRow(shorter, tuple(self._encode(shorter)), row.choice_ids)
        else:
            why = f"{CUT_ROUNDS} cuts of its document did not make it fit"
        return EncodedRow(request, row.prompt_ids, row.choice_ids, too_long_message(row, context) + (
            f"; {why} (the system message, the template's text and the answer are never cut)"))

    def _encode(self, request: Request) -> list[int]:
        text = render_text(self.tokenizer, request, self.raw)
        return self.tokenizer(text, add_special_tokens=not uses_chat_template(self.tokenizer, self.raw),
                              verbose=False)["input_ids"]


def _counted(row: EncodedRow, cut_tokens: int) -> EncodedRow:
    carried = {**(row.request.carried or {}), TRUNCATED_COLUMN: cut_tokens}
    return EncodedRow(replace(row.request, carried=carried), row.prompt_ids, row.choice_ids, row.error)


def _document_spans(prompt: str, template: Sequence[str | Field] | None) -> list[tuple[int, int]]:
    """Where the document lies in a prompt row's text, [start, end) character spans: all of it, or in corpus mode
    each of the template's fields (the text between the template's own pieces, matched in order)."""
    if template is None:
        return [(0, len(prompt))]
    pattern = "".join("(.*?)" if isinstance(part, Field) else re.escape(part) for part in template)
    found = re.fullmatch(pattern, prompt, flags=re.DOTALL)
    return [found.span(group) for group in range(1, found.re.groups + 1)] if found else []


def _cut_document(tokenizer, prompt: str, spans: list[tuple[int, int]], tokens: int,
                  side: str) -> tuple[str, list[tuple[int, int]]]:
    """`prompt` with `tokens` tokens cut from the document, from its longest span first (in corpus mode a template's
    long field is the document, its short ones titles and labels), then the next longest; and the spans after the
    cut. No spans: the whole document would go."""
    spans = list(spans)
    while tokens > 0:
        longest = max(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
        start, end = spans[longest]
        if start == end:
            return prompt, []
        kept, removed = _cut_text(tokenizer, prompt[start:end], tokens, side)
        prompt = prompt[:start] + kept + prompt[end:]
        shift = len(kept) - (end - start)
        spans = [span if i < longest else (start, start + len(kept)) if i == longest else (span[0] + shift,
                                                                                          span[1] + shift)
                 for i, span in enumerate(spans)]
        tokens -= removed
    return prompt, spans


def _cut_text(tokenizer, text: str, tokens: int, side: str) -> tuple[str, int]:
    """(text with up to `tokens` of its own tokens cut from `side`, how many were cut). A fast tokenizer's offsets
    cut the characters themselves; a slow one's kept tokens are decoded."""
    fast = getattr(tokenizer, "is_fast", False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast, verbose=False)
    ids = encoded["input_ids"]
    cut = min(tokens, len(ids))
    if cut == len(ids):
        return "", cut
    if fast:
        offsets = encoded["offset_mapping"]
        return (text[:offsets[len(ids) - cut - 1][1]] if side == "tail" else text[offsets[cut][0]:]), cut
    kept = ids[:len(ids) - cut] if side == "tail" else ids[cut:]
    return tokenizer.decode(kept), cut


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
            f"but the model's context is {context_length} tokens")


def _fitting_hint(row: EncodedRow, context_length: int) -> str:
    """What makes a row fit that --truncate was not asked for: a generation row whose prompt fits alone has room for
    fewer new tokens, and no cut of the document makes room for max_new_tokens of the whole context."""
    room = context_length - len(row.prompt_ids)
    if row.is_choice or room <= 0:
        return " (batchrun never truncates a prompt unless asked: --truncate head|tail cuts the document)"
    if row.request.max_new_tokens >= context_length:
        return f"; lower max_new_tokens to at most {room} for this prompt (--max-new-tokens, or the row's own)"
    return (f"; lower max_new_tokens to at most {room} for this prompt (--max-new-tokens, or the row's own), or cut "
            "the document with --truncate head|tail")


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
