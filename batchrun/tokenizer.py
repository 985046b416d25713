"""The checkpoint's own tokenizer (fast when available). No torch needed."""
from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(checkpoint: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none."""
    if not any((Path(checkpoint) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
