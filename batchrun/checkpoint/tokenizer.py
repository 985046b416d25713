"""The checkpoint's own tokenizer (fast when available). No torch needed."""
from __future__ import annotations

import functools
from pathlib import Path

from batchrun.checkpoint.conversion import gguf_parsed_once
from batchrun.checkpoint.files import CheckpointError, is_gguf_file
from batchrun.checkpoint.gguf_index import read_gguf_index

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(checkpoint: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none; a GGUF file's is built from its metadata, as
    transformers builds it."""
    if is_gguf_file(checkpoint):
        return _gguf_tokenizer(Path(checkpoint))
    if not any((Path(checkpoint) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    _drop_build_copies(tokenizer)
    return tokenizer


def _gguf_tokenizer(file: Path):
    """The tokenizer transformers builds from a GGUF file's metadata (the first part's, for a split file), or None
    when the file carries no vocabulary."""
    index = read_gguf_index(file)
    if "tokenizer.ggml.tokens" not in index.array_lengths:
        return None
    from transformers import AutoTokenizer

    first = index.files[0]
    try:
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(first.parent, gguf_file=first.name)
    except ImportError as error:
        raise CheckpointError(f"{first}: reading a GGUF tokenizer needs the gguf package: pip install gguf "
                              f"({error})") from None
    except (ValueError, KeyError, NotImplementedError) as error:
        raise CheckpointError(f"{first}: transformers cannot build a tokenizer from this GGUF file's metadata "
                              f"({type(error).__name__}: {error})") from None
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
