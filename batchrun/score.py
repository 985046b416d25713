"""The math of one batch: choice log-likelihoods and greedy decoding, pass by pass.

Every forward call of the model is one pass (one walk through the decoder stack, one read of the
checkpoint when streamed). Shapes: B sequences, S padded length, V vocabulary.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from batchrun.prompts import EncodedRow


@dataclass
class Answer:
    idx: int
    answer: str | None
    choice_probs: dict[str, float] | None
    score: float | None
    logprob: float | None
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    token_ids: list[int] | None = None


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad so every sequence ends at the last position: input_ids, attention_mask, position_ids [B, S]."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def cache_argument(model) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache`; accept either release."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def forward(model, ids, mask, positions, *, keep: int, cache=None, use_cache: bool = False):
    """One pass. Returns float32 log-probs of the last `keep` positions [B, keep, V] and the cache."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=use_cache,
                logits_to_keep=keep, **{cache_argument(model): cache})
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return torch.log_softmax(out.logits.float(), dim=-1), new_cache


# -- choice rows ---------------------------------------------------------------------------------
def choice_sequences(row: EncodedRow) -> list[list[int]]:
    """Single-token choices share one sequence (the prompt); otherwise one sequence per choice."""
    if all(len(c) == 1 for c in row.choice_ids):
        return [list(row.prompt_ids)]
    return [list(row.prompt_ids) + list(c) for c in row.choice_ids]


def score_choices(model, rows: Sequence[EncodedRow], pad_id: int, device) -> list[Answer]:
    """All choices of all rows in one pass; log-likelihood of each choice's tokens after the prompt."""
    seqs: list[list[int]] = []
    owners: list[tuple[int, int]] = []  # (row position, first sequence) per row
    for pos, row in enumerate(rows):
        owners.append((pos, len(seqs)))
        seqs.extend(choice_sequences(row))
    longest_choice = max(len(c) for row in rows for c in row.choice_ids)
    ids, mask, positions = left_pad(seqs, pad_id, device)
    keep = longest_choice + 1  # logits of the last prompt token and every choice token but the last
    with torch.inference_mode():
        logprobs, _ = forward(model, ids, mask, positions, keep=keep)  # [N, keep, V]
    return [_choice_answer(row, logprobs, first) for (_, first), row in zip(owners, rows)]


def _choice_answer(row: EncodedRow, logprobs: torch.Tensor, first: int) -> Answer:
    sums = []
    shared = all(len(c) == 1 for c in row.choice_ids)
    for k, tokens in enumerate(row.choice_ids):
        if shared:
            sums.append(logprobs[first, -1, tokens[0]].item())
            continue
        seq_lp = logprobs[first + k]  # [keep, V]; the sequence ends with the choice tokens
        n = len(tokens)
        # position -1-n predicts the first choice token, ..., position -2 the last one
        steps = seq_lp[-1 - n:-1]
        sums.append(sum(steps[j, t].item() for j, t in enumerate(tokens)))
    top = max(sums)
    weights = [math.exp(s - top) for s in sums]
    total = sum(weights)
    probs = {c: w / total for c, w in zip(row.request.choices, weights)}
    best = max(range(len(sums)), key=sums.__getitem__)
    return Answer(idx=row.request.index, answer=row.request.choices[best], choice_probs=probs,
                  score=numeric_score(probs), logprob=sums[best], prompt_tokens=len(row.prompt_ids),
                  output_tokens=len(row.choice_ids[best]), finish_reason="choice")


def numeric_score(probs: dict[str, float]) -> float | None:
    """The probability-weighted mean when every choice is a number."""
    try:
        values = {c: float(c) for c in probs}
    except ValueError:
        return None
    if not all(math.isfinite(v) for v in values.values()):
        return None
    return sum(values[c] * p for c, p in probs.items())


# -- generation rows -----------------------------------------------------------------------------
@dataclass
class Sequence_:
    row: EncodedRow
    generated: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finish: str | None = None
    text: str | None = None


class GreedyBatch:
    """Greedy decoding of a batch, one pass per call to `step()`; finished rows leave the batch.

    Rows may start with tokens already generated before an interruption (`prefixes`): the first pass
    then prefills prompt + prefix, which costs one pass, and decoding continues from there.
    """

    def __init__(self, model, rows: Sequence[EncodedRow], tokenizer, eos_ids: set[int], pad_id: int, device,
                 prefixes: dict[int, tuple[list[int], float]] | None = None):
        self.model, self.tokenizer, self.eos_ids, self.pad_id, self.device = model, tokenizer, eos_ids, pad_id, device
        prefixes = prefixes or {}
        self.live: list[Sequence_] = []
        for row in rows:
            seq = Sequence_(row)
            if row.request.index in prefixes:
                tokens, logprob = prefixes[row.request.index]
                seq.generated, seq.logprob = list(tokens), logprob
            self.live.append(seq)
        self.cache = None
        self.mask = None
        self.positions = None
        self.passes = 0
        # A row whose restored prefix already ends it (the crash came between its last pass and the
        # commit of its answer) finishes without any pass.
        self.already_finished = []
        for seq in self.live:
            if seq.generated:
                self._check_finished(seq)
                if seq.finish:
                    self.already_finished.append(seq)
        self.live = [s for s in self.live if not s.finish]

    def step(self) -> list[Sequence_]:
        """Run one pass; return the sequences that finished in it."""
        with torch.inference_mode():
            if self.cache is None:
                logprobs = self._prefill()
            else:
                logprobs = self._decode()
        self.passes += 1
        next_ids = logprobs.argmax(-1)  # [B]
        finished = []
        for b, seq in enumerate(self.live):
            token = int(next_ids[b])
            seq.generated.append(token)
            seq.logprob += float(logprobs[b, token])
            self._check_finished(seq)
            if seq.finish:
                finished.append(seq)
        if finished:
            self._drop([b for b, s in enumerate(self.live) if not s.finish])
        self._next_tokens = torch.tensor([[s.generated[-1]] for s in self.live], dtype=torch.long,
                                         device=self.device)
        return finished

    @property
    def done(self) -> bool:
        return not self.live

    def _prefill(self) -> torch.Tensor:
        seqs = [list(s.row.prompt_ids) + s.generated for s in self.live]
        ids, self.mask, self.positions = left_pad(seqs, self.pad_id, self.device)
        logprobs, self.cache = forward(self.model, ids, self.mask, self.positions, keep=1, use_cache=True)
        return logprobs[:, -1]

    def _decode(self) -> torch.Tensor:
        ones = torch.ones((len(self.live), 1), dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.positions = self.positions[:, -1:] + 1
        logprobs, self.cache = forward(self.model, self._next_tokens, self.mask, self.positions, keep=1,
                                       cache=self.cache, use_cache=True)
        return logprobs[:, -1]

    def _check_finished(self, seq: Sequence_) -> None:
        request = seq.row.request
        if seq.generated[-1] in self.eos_ids:
            seq.finish = "stop"
            seq.text = self.tokenizer.decode(seq.generated[:-1], skip_special_tokens=True)
            return
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        for stop in request.stop:
            cut = text.find(stop)
            if cut != -1:
                seq.finish, seq.text = "stop", text[:cut]
                return
        if len(seq.generated) >= request.max_new_tokens:
            seq.finish, seq.text = "length", text

    def _drop(self, keep: list[int]) -> None:
        """Finished sequences leave the pass: shrink the batch, the mask and the KV cache."""
        self.live = [self.live[b] for b in keep]
        if not keep or self.cache is None:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.positions = self.positions[index]

    def partial(self) -> dict[int, tuple[list[int], float]]:
        """Tokens generated so far by every unfinished row: what a resume keeps."""
        return {s.row.request.index: (list(s.generated), s.logprob) for s in self.live}


def generation_answer(seq: Sequence_) -> Answer:
    return Answer(idx=seq.row.request.index, answer=seq.text, choice_probs=None, score=None,
                  logprob=seq.logprob, prompt_tokens=len(seq.row.prompt_ids), output_tokens=len(seq.generated),
                  finish_reason=seq.finish or "length", token_ids=list(seq.generated))


def eos_token_ids(model_config, generation_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    return ids
