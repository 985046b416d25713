"""Greedy decoding under a grammar (llguidance): a structured row's next tokens are the ones its grammar forces, or
else the model's top token where the grammar allows it, or else the best token the grammar allows.

One token table per job (about a second to build from the tokenizer), one compiled matcher per distinct structure
(Structure.key), copied for every row; the mask is computed only where the model's top token is refused. Forced
tokens are the engine's canonical tokenization of the bytes the grammar leaves no choice about: a row takes them all
at once, and the pool feeds them to the model in as few calls as it can (score.GreedyPool).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from batchrun.spec import Structure


@dataclass
class GrammarStats:
    """What the grammars did over a run: mask work beside the passes, and the tokens forced or overridden."""

    mask_seconds: float = 0.0  # checking top tokens, computing masks and forced tokens
    masks: int = 0  # full masks computed (the model's top token was refused)
    forced: int = 0  # tokens the grammar forced, the model not asked
    chosen: int = 0  # tokens chosen from the model's log-probs


@dataclass
class RowGrammar:
    """One row's matcher and its own counts."""

    matcher: object
    overrides: int = 0  # steps where the model's top token was refused
    lowest_logprob: float | None = None  # the lowest log-probability among the tokens chosen from the model
    forced: int = 0

    def counts(self) -> dict:
        """What the grammar did to this row so far, as its answer and a resume keep it."""
        return {"overrides": self.overrides, "forced": self.forced, "lowest_logprob": self.lowest_logprob}

    def restore(self, counts: dict) -> None:
        """Counts an earlier run of the row kept (its matcher is rebuilt from the tokens, its counts are not)."""
        self.overrides, self.forced = counts["overrides"], counts["forced"]
        self.lowest_logprob = counts["lowest_logprob"]


class Grammars:
    """The grammar engine for one job's tokenizer and logits width (a model's logits may be wider than its
    tokenizer: the extra ids are never allowed)."""

    def __init__(self, tokenizer, eos_ids: set[int], vocab_width: int):
        import llguidance.hf  # the engine, loaded only by jobs with structured rows

        self.table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_width, eos_token=sorted(eos_ids))
        self.compiled: dict[str, object] = {}
        self.stats = GrammarStats()

    def start(self, structure: Structure, generated: list[int]) -> RowGrammar:
        """A row's matcher, past the tokens it has generated already (a resumed row's, kept in SQLite)."""
        from llguidance import LLMatcher

        if structure.key not in self.compiled:
            matcher = LLMatcher(self.table, structure.grammar(), log_level=0)
            if matcher.is_error():
                raise ValueError(f"the grammar engine cannot compile this structure: {matcher.get_error()}")
            self.compiled[structure.key] = matcher
        row = RowGrammar(self.compiled[structure.key].deep_copy())
        if generated and not row.matcher.consume_tokens(list(generated)):
            raise ValueError(f"the tokens kept for this row do not follow its grammar: {row.matcher.get_error()}")
        return row

    def forced(self, row: RowGrammar, room: int) -> list[int]:
        """The tokens the grammar forces from here, at most `room` of them (the row's limit), consumed: none where
        the model has a choice. Those past the limit are left unconsumed, so a cut row's grammar never ends."""
        started = time.perf_counter()
        tokens = [] if row.matcher.is_stopped() or room <= 0 else list(row.matcher.compute_ff_tokens())[:room]
        if tokens and not row.matcher.consume_tokens(tokens):
            raise RuntimeError(f"grammar engine: its own forced tokens were refused ({row.matcher.get_error()})")
        row.forced += len(tokens)
        self.stats.forced += len(tokens)
        self.stats.mask_seconds += time.perf_counter() - started
        return tokens

    def choose(self, row: RowGrammar, logprobs: torch.Tensor) -> tuple[int, float]:
        """The model's top token where the grammar allows it, else the best allowed one (consumed); with its
        log-probability. `logprobs`: [V] float32."""
        started = time.perf_counter()
        token = int(logprobs.argmax())
        if row.matcher.validate_tokens([token]) != 1:
            allowed = self._allowed(row, logprobs.shape[-1], logprobs.device)
            token = int(logprobs.masked_fill(~allowed, float("-inf")).argmax())
            row.overrides += 1
            self.stats.masks += 1
        if not row.matcher.consume_token(token):
            raise RuntimeError(f"grammar engine: an allowed token was refused ({row.matcher.get_error()})")
        logprob = float(logprobs[token])
        row.lowest_logprob = logprob if row.lowest_logprob is None else min(row.lowest_logprob, logprob)
        self.stats.chosen += 1
        self.stats.mask_seconds += time.perf_counter() - started
        return token, logprob

    @staticmethod
    def _allowed(row: RowGrammar, width: int, device) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next, unpacked from its bitmask (one bit per token id); ids past
        the tokenizer's, where the logits are wider, are never allowed."""
        bits = np.unpackbits(np.frombuffer(row.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(width, dtype=torch.bool)
        count = min(width, len(bits))
        allowed[:count] = torch.from_numpy(bits[:count].astype(bool))
        return allowed.to(device)

    @staticmethod
    def ended(row: RowGrammar) -> bool:
        """The grammar is complete and admits nothing more: the row ends without asking for an end token."""
        return row.matcher.is_stopped()
