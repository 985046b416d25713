"""The math of one batch: choice log-likelihoods and greedy decoding, pass by pass.

Every forward call of the model is one pass (one walk through the decoder stack, one read of the
checkpoint when streamed). Shapes: B sequences, S padded length, V vocabulary.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from batchrun.plan import RowCost, admit, shares_prefix
from batchrun.runtime.decode import collect_decoded, decode_calls, drop_finished, merge_for_decode, sliding_windows
from batchrun.runtime.grammar import Grammars, RowGrammar
from batchrun.runtime.handle import ModelHandle
from batchrun.runtime.prefill import PrefillCalls, SharedPrefix, prefill
from batchrun.runtime.group_prefix import prefill_grouped
from batchrun.quality import numeric_score
from batchrun.spec import EncodedRow, choice_sequences, kept_positions


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
    choice_tokens: dict[str, int] | None = None  # a choice row's tokens per choice (a calibrated answer's count)
    grammar: dict | None = None  # a structured row's grammar counts (RowGrammar.counts)


# -- choice rows ---------------------------------------------------------------------------------
def score_choices(handle: ModelHandle, rows: Sequence[EncodedRow], pad_id: int, *, micro_batch: int | None = None,
                  share_prefix: bool = True) -> list[Answer]:
    """All choices of all rows in one pass; log-likelihood of each choice's tokens after the prompt. Each forward
    call keeps only the log-probabilities of its rows' choice tokens (choice_picks), never a vocabulary row."""
    seqs: list[list[int]] = []
    picks: list[torch.Tensor] = []
    firsts: list[int] = []  # first sequence of each row
    groups: dict[int, list[int]] = {}  # a pair row's sequences, both orders: they share the prompt's head
    keep = kept_positions(rows)
    for row in rows:
        firsts.append(len(seqs))
        own = choice_sequences(row)
        if row.request.pair_group is not None:
            groups.setdefault(row.request.pair_group, []).extend(range(len(seqs), len(seqs) + len(own)))
        seqs.extend(own)
        picks.extend(choice_picks(row, keep))
    if share_prefix and any(len(members) > 1 for members in groups.values()):
        logprobs = prefill_grouped(handle, seqs, list(groups.values()), pad_id, keep=keep, micro_batch=micro_batch,
                                   picks=picks)
    else:
        logprobs, _ = prefill(handle, seqs, pad_id, keep=keep, micro_batch=micro_batch, use_cache=False,
                              share_prefix=share_prefix, picks=picks)  # per sequence [keep, T]
    return [_choice_answer(row, logprobs, first) for first, row in zip(firsts, rows)]


def choice_picks(row: EncodedRow, keep: int) -> list[torch.Tensor]:
    """The token ids whose log-probs each of the row's sequences needs at its last `keep` positions, [keep, T] a
    sequence (choice_sequences): single-token choices share the prompt's sequence, column k the choice k at the last
    position; a sequence per multi-token choice reads its own tokens, position -1-n predicting the first of n, ...,
    position -2 the last (column 0). Unread places hold token 0."""
    if all(len(tokens) == 1 for tokens in row.choice_ids):
        picks = torch.zeros(keep, len(row.choice_ids), dtype=torch.long)
        picks[-1] = torch.tensor([tokens[0] for tokens in row.choice_ids])
        return [picks]
    sequences = []
    for tokens in row.choice_ids:
        picks = torch.zeros(keep, 1, dtype=torch.long)
        picks[keep - 1 - len(tokens):keep - 1, 0] = torch.tensor(tokens)
        sequences.append(picks)
    return sequences


def _choice_answer(row: EncodedRow, logprobs: list[torch.Tensor], first: int) -> Answer:
    """The row's answer from its sequences' picked log-probs (choice_picks' layout)."""
    if all(len(tokens) == 1 for tokens in row.choice_ids):
        sums = logprobs[first][-1, :len(row.choice_ids)].tolist()
    else:
        sums = [sum(logprobs[first + k][-1 - len(tokens):-1, 0].tolist()) for k, tokens in enumerate(row.choice_ids)]
    top = max(sums)
    weights = [math.exp(s - top) for s in sums]
    total = sum(weights)
    probs = {c: w / total for c, w in zip(row.request.choices, weights)}
    best = max(range(len(sums)), key=sums.__getitem__)
    return Answer(idx=row.request.index, answer=row.request.choices[best], choice_probs=probs,
                  score=numeric_score(probs), logprob=sums[best], prompt_tokens=len(row.prompt_ids),
                  output_tokens=len(row.choice_ids[best]), finish_reason="choice",
                  choice_tokens={c: len(ids) for c, ids in zip(row.request.choices, row.choice_ids)})


# -- generation rows -----------------------------------------------------------------------------
@dataclass
class Sequence_:
    row: EncodedRow
    generated: list[int] = field(default_factory=list)
    logprob: float = 0.0
    finish: str | None = None
    text: str | None = None
    fed: int = 0  # of `generated`, the tokens the model has read (the rest: a grammar's forced tokens, still to feed)
    grammar: RowGrammar | None = None  # a structured row's matcher (runtime/grammar.py)


@dataclass(frozen=True)
class PoolPlan:
    """What the plan decided for a job's generation rows, as the pool carries it out."""
    limits: tuple[int, int]  # (most sequences, most padded tokens) one pass holds
    micro_batch: int | None = None  # sequences per prefill call; None: all at once
    decode_micro_batch: int | None = None  # sequences per decode call (decode.merge_for_decode); None: all at once
    shared_prefix: int = 0  # prompt tokens every row starts with, computed once by the first pass
    # Every row, answered in full, fits inside the smallest sliding window: windowed layers cache like full ones,
    # so the micro-batches of rows admitted in different passes merge into one decode call
    # (PlanBatching.windows_as_full).
    windows_as_full: bool = True
    # A grammar's forced tokens are fed in one call (False: one token a pass, as an unforced token is).
    feeds_forced: bool = True


class GreedyPool:
    """Greedy decoding of a job's generation rows, one pass per call to `step()`. Rows wait in a queue; each pass
    decodes the next token of the rows live in it and prefills the prompts of the next queued rows, admitted while
    they fit beside the live ones within the plan's batch limits (refill.admit), so places that rows finishing
    early leave are taken in the next pass instead of staying empty until the batch's last row is done.

    `costs`: each row's RowCost as the plan sized it (its own tokens where a prefix is shared). A shared prefix of
    `plan.shared_prefix` tokens (every row starts with it) is computed by the first pass and kept for the later rows.
    Rows may start with tokens already generated before an interruption (`prefixes`): their prefill then covers
    prompt + those tokens, and decoding continues from there.

    A structured row (a JSON Schema or regex) decodes under its grammar (runtime/grammar.py): the tokens the grammar
    forces join the row at once and are fed in the next pass's call together (`plan.feeds_forced`), and the row
    ends where its grammar does.
    """

    def __init__(self, handle: ModelHandle, rows: Sequence[EncodedRow], costs: Sequence[RowCost], plan: PoolPlan,
                 tokenizer, eos_ids: set[int], pad_id: int, prefixes: dict[int, tuple[list[int], float]] | None = None):
        self.handle, self.tokenizer, self.eos_ids, self.pad_id = handle, tokenizer, eos_ids, pad_id
        self.special_ids = special_token_ids(tokenizer)
        self.costs, self.limits = costs, plan.limits
        self.micro_batch, self.decode_micro_batch = plan.micro_batch, plan.decode_micro_batch
        self.sequences = [Sequence_(row) for row in rows]
        self.grammars = self._grammars(handle, tokenizer, eos_ids)
        # Padding columns of a feed wider than one token would count against a sliding window: one token a pass there.
        self.feeds_forced = plan.feeds_forced and not sliding_windows(handle.model)
        for seq in self.sequences:
            self._restore(seq, (prefixes or {}).get(seq.row.request.index))
        self.already_finished = [seq for seq in self.sequences if seq.finish]
        self.queue = deque(i for i, seq in enumerate(self.sequences) if not seq.finish)
        self.live: dict[int, Sequence_] = {}  # admitted, unfinished
        self.states: list = []  # the live rows' micro-batches between passes
        shared = plan.shared_prefix
        self.prefix = (SharedPrefix(handle.model, list(rows[self.queue[0]].prompt_ids[:shared]), handle.device)
                       if shared and shares_prefix(len(self.queue), plan.limits[0]) else None)
        self.windows_as_full = plan.windows_as_full
        self.in_flight = 0  # rows the pass in flight carries: those decoding and those it admits
        # Where they cannot merge (windowed caches of longer rows), every admission beside live rows would add a
        # decode call, each reading every layer's weights from RAM once more: rows then wait until the pool is
        # empty, batch after batch (refill.refill_schedule's refill_while_live, as the plan schedules them).
        self.refills = self.prefix is not None or self.windows_as_full

    def _grammars(self, handle: ModelHandle, tokenizer, eos_ids: set[int]) -> Grammars | None:
        """The grammar engine, where any row is structured; sized to the model's logits."""
        if not any(seq.row.request.structure is not None for seq in self.sequences):
            return None
        width = max(getattr(handle.model.config, "vocab_size", 0) or 0, len(tokenizer))
        return Grammars(tokenizer, eos_ids, width)

    def _restore(self, seq: Sequence_, prefix: tuple[list[int], float] | None) -> None:
        """A row's state before its first pass: the tokens an earlier run generated (kept in SQLite), its matcher
        past them and the tokens its grammar forces from there."""
        if prefix is not None:
            seq.generated, seq.logprob = list(prefix[0]), prefix[1]
        structure = seq.row.request.structure
        if structure is not None:
            seq.grammar = self.grammars.start(structure, seq.generated)
            seq.generated += self.grammars.forced(seq.grammar, self._left(seq))
        seq.fed = len(seq.generated)  # its prefill reads them all
        if seq.generated:
            # A row whose restored tokens already end it (the crash came between its last pass and the commit
            # of its answer) finishes without any pass.
            self._check_finished(seq)

    def step(self) -> list[Sequence_]:
        """Run one pass; return the sequences that finished in it."""
        admitted = (admit(self.costs, list(self.live), self.queue, *self.limits) if self.refills or not self.live
                    else [])
        prefilling = None
        if admitted:
            seqs = [list(self.sequences[i].row.prompt_ids) + self.sequences[i].generated for i in admitted]
            prefilling = PrefillCalls.build(self.handle, seqs, self.pad_id, keep=1, micro_batch=self.micro_batch,
                                            use_cache=True, prefix=self.prefix,
                                            windows_as_full=self.windows_as_full)
        decoding = self.states
        tokens = self._feeds(decoding)
        self.in_flight = len(tokens) + len(admitted)
        # after this pass, at most the longest remaining answer less one more passes: the room caches keep
        after = max((self._left(self.sequences[i]) for i in [*self.live, *admitted]), default=1) - 1
        calls = decode_calls(self.handle, decoding, tokens, after) if decoding else []
        if prefilling:  # first: the prefix's call and its hook count micro-batches from 0
            calls = prefilling.calls + calls
        outputs = self.handle.run_pass(calls, before_layer=prefilling.before_layer if prefilling else None,
                                       rows=(prefilling.rows if prefilling else 0) + sum(map(len, tokens.values())),
                                       light=prefilling is None)
        logprobs = collect_decoded(decoding, outputs[len(prefilling.calls):] if prefilling else outputs)
        states = decoding
        if prefilling:
            for local, lp in enumerate(prefilling.collect(outputs)):
                logprobs[admitted[local]] = lp[-1]
            for state in prefilling.states:
                state.members = [admitted[local] for local in state.members]
            states = decoding + prefilling.states
            self.live.update((i, self.sequences[i]) for i in admitted)
        finished = {}
        for i, lp in logprobs.items():
            seq = self.sequences[i]
            seq.fed += len(tokens.get(i, ()))
            if seq.fed < len(seq.generated):
                continue  # forced tokens still to feed, one a pass: this pass's log-probs decide nothing
            self._advance(seq, lp)
            self._check_finished(seq)
            if seq.finish:
                finished[i] = self.live.pop(i)
        states = drop_finished(states, set(finished)) if finished else states
        # New rows' micro-batches join the others for decoding (their keys and values copied into one cache).
        self.states = merge_for_decode(states, self.decode_micro_batch) if prefilling else states
        return list(finished.values())

    def _feeds(self, states: list) -> dict[int, list[int]]:
        """The tokens each decoding row feeds this pass: the last one chosen, and the forced ones after it where the
        pool feeds them together, as many as the micro-batch's cache has room for (the plan sized each row's cache
        for its prompt and answer: a wide feed leaves hidden columns beside the shorter feeds)."""
        feeds = {}
        for state in states:
            room = 1
            if self.feeds_forced:
                planned = max(len(self.sequences[i].row.prompt_ids) + self.sequences[i].row.request.max_new_tokens
                              for i in state.members)
                shared = len(self.prefix.prefix) if self.prefix is not None else 0
                room = max(1, shared + planned - state.mask.shape[1])
            for i in state.members:
                seq = self.sequences[i]
                feeds[i] = seq.generated[seq.fed:seq.fed + room]
        return feeds

    def _advance(self, seq: Sequence_, lp: torch.Tensor) -> None:
        """The row's next tokens from this pass's log-probs [V]: the top one, under its grammar where it has one,
        and then the tokens the grammar forces (its log-probability counts the tokens the model chose)."""
        if seq.grammar is None:
            token = int(lp.argmax())
            seq.generated.append(token)
            seq.logprob += float(lp[token])
            return
        room = self._left(seq)
        chosen = self.grammars.forced(seq.grammar, room)  # forced without a choice: this pass's log-probs unasked
        if not chosen:
            token, logprob = self.grammars.choose(seq.grammar, lp)
            seq.logprob += logprob
            chosen = [token] + ([] if token in self.eos_ids else self.grammars.forced(seq.grammar, room - 1))
        seq.generated += chosen

    def _left(self, seq: Sequence_) -> int:
        """Tokens the row may still generate."""
        return seq.row.request.max_new_tokens - len(seq.generated)

    @property
    def done(self) -> bool:
        return not (self.live or self.queue)

    def _check_finished(self, seq: Sequence_) -> None:
        request = seq.row.request
        # A stop that is a special token's text ("<|im_start|>") never shows in the text, which drops those tokens:
        # it stops at the token itself.
        stop_ids = {self.special_ids[stop] for stop in request.stop if stop in self.special_ids}
        if seq.generated[-1] in self.eos_ids or seq.generated[-1] in stop_ids:
            seq.finish = "stop"
            seq.text = self.tokenizer.decode(seq.generated[:-1], skip_special_tokens=True)
            return
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        # The earliest match wins, whatever the order of the stop list: one token can complete two stops at once.
        cuts = [cut for cut in (text.find(stop) for stop in request.stop) if cut != -1]
        if cuts:
            seq.finish, seq.text = "stop", text[:min(cuts)]
            return
        if seq.grammar is not None and Grammars.ended(seq.grammar):  # complete, nothing more allowed: no end token
            seq.finish, seq.text = "stop", text
            return
        if len(seq.generated) >= request.max_new_tokens:
            seq.finish, seq.text = "length", text

    def partial(self) -> dict[int, tuple[list[int], float]]:
        """Tokens generated so far by every unfinished row: what a resume keeps."""
        return {s.row.request.index: (list(s.generated), s.logprob) for s in self.live.values()}

    def partial_counts(self) -> dict[int, dict]:
        """The grammar counts so far of every unfinished structured row: what a resume keeps beside the tokens."""
        return {s.row.request.index: s.grammar.counts() for s in self.live.values() if s.grammar is not None}

    def resume_counts(self, counts: dict[int, dict]) -> None:
        """Give resumed rows the grammar counts an earlier run kept (partial_counts), before the first pass."""
        for seq in self.sequences:
            kept = counts.get(seq.row.request.index)
            if kept is not None and seq.grammar is not None:
                seq.grammar.restore(kept)


def generation_answer(seq: Sequence_) -> Answer:
    return Answer(idx=seq.row.request.index, answer=seq.text, choice_probs=None, score=None,
                  logprob=seq.logprob, prompt_tokens=len(seq.row.prompt_ids), output_tokens=len(seq.generated),
                  finish_reason=seq.finish or "length", token_ids=list(seq.generated),
                  grammar=seq.grammar.counts() if seq.grammar is not None else None)


def special_token_ids(tokenizer) -> dict[str, int]:
    """Text -> id of the tokens that decoding with skip_special_tokens drops: the named special tokens and every
    added token marked special (SmolLM2's <file_sep>, Llama 3's header tokens)."""
    ids = {str(token.content): index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
           if getattr(token, "special", False)}
    ids.update(zip(getattr(tokenizer, "all_special_tokens", ()), getattr(tokenizer, "all_special_ids", ())))
    return ids


def eos_token_ids(model_config, generation_config, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model_config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple)) else [source])
    return ids
