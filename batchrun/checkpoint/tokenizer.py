"""The checkpoint's own tokenizer (fast when available). No torch needed."""
from __future__ import annotations

import functools
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(checkpoint: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none."""
    if not any((Path(checkpoint) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    _drop_build_copies(tokenizer)
    return tokenizer


def _drop_build_copies(tokenizer) -> None:
    """transformers keeps the vocabulary and merges it built the Rust tokenizer from as Python objects, which
    encoding, decoding and chat templates never read again (they use the Rust tokenizer): hundreds of MB for a large
    vocabulary, handed back once the caller trims the heap (docs/planning.md#the-memory-floor)."""
    if getattr(tokenizer, "_tokenizer", None) is None:  # a slow (Python) tokenizer encodes from its own tables
        return
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            setattr(tokenizer, name, None)


class TokenizerOnDemand:
    """A model handle's `.tokenizer`, loaded on first use: the executor brings the one it planned with (a large
    vocabulary's holds hundreds of MB). The handle sets `checkpoint` and `_trust_remote_code`."""

    checkpoint: Path
    _trust_remote_code: bool = False

    @functools.cached_property
    def tokenizer(self):
        return load_tokenizer(self.checkpoint, self._trust_remote_code)
