"""A checkpoint's tokenizer as GGUF metadata (llama.cpp's keys), and the proof that the tokenizer transformers builds
back from that metadata splits text as the checkpoint's own does.

transformers rebuilds a byte-level BPE tokenizer from a GGUF file as GPT2Tokenizer(vocab, merges), its special and
added tokens from the token types, and its pre-tokenizer from `tokenizer.ggml.pre`: a name in its table of split
patterns, or GPT-2's own byte-level split for any other name. So the name is chosen by what transformers rebuilds
from it, and the rebuilt tokenizer is then compared with the source: its pipeline part by part (normalizer,
pre-tokenizer, model, decoder, added tokens), its ids on a corpus, its chat template's rendering. Any difference
refuses the checkpoint, naming it: a file that splits text differently runs another model.

No torch: tokenizers and transformers' tokenizer classes only.
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from batchrun.checkpoint.files import CheckpointError

# llama.cpp's token types (gguf-py's TokenType)
NORMAL, UNUSED, CONTROL, USER_DEFINED = 1, 5, 3, 4
NFC = {"type": "NFC"}
# llama.cpp's name for GPT-2's own byte-level split, which transformers keeps for any name outside its table.
GPT2_PRE = "gpt-2"
# Where several of llama.cpp's names share one split pattern in transformers' table, the name llama.cpp gives the
# family that pattern was made for.
PREFERRED_PRE_NAMES = ("llama-bpe", "qwen2", "tekken", "gpt-4o", "qwen35")
# Text that exercises what splits differ on: cases, contractions, digit runs, punctuation runs, unicode letters and
# marks (decomposed too), CJK, emoji, whitespace runs, tabs and newlines.
TOKENIZER_PROBE_TEXTS = (
    "Hello world! The customer's order #58213 never arrived; they'll ask for a refund.",
    "I'M SURE you've SEEN it, haven't you? We'd rather not.",
    "Numbers: 7, 42, 365, 2024, 1234567, 3.14159, -0.5e10, 1,000,000 and 0x1F.",
    "  leading spaces,   runs   of spaces,\ttabs\t\tand trailing spaces   ",
    "line one\nline two\n\nline four\r\nwindows line\n\n\n",
    "Ünïcödé: café, naïve, façade, Straße, ÅÆØ, ĳ; decomposed: cafe\u0301 na\u0131\u0308ve",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "Emoji: 🙂👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨ and symbols ©®™ ≤≥ → ∑∫ 𝔘𝔫𝔦",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
    "<|im_start|>user\nspecial tokens inside text<|im_end|> <pad> <|endoftext|>",
    "",
    " ",
    "\n",
)
PROBE_CONVERSATION = ({"role": "system", "content": "You answer briefly."},
                      {"role": "user", "content": "Is this review positive? 'Great value, 10/10!' 🙂"},
                      {"role": "assistant", "content": "positive"},
                      {"role": "user", "content": "And this one?\n  'Broke after 2 days.'"})


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer as llama.cpp's tokenizer.* keys hold it."""
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    special_ids: dict[str, int]  # "bos", "eos", "unk", "pad" -> id, those the tokenizer has
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def load_source_tokenizer(directory: Path):
    """The checkpoint's tokenizer as transformers loads it (what batchrun runs a safetensors checkpoint with)."""
    from transformers import AutoTokenizer

    if not any((directory / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        raise CheckpointError(f"{directory}: has no tokenizer (tokenizer.json); a GGUF file carries its model's "
                              "tokenizer, so quantizing needs one")
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{directory}: its tokenizer cannot be loaded ({type(error).__name__}: {error})") \
            from None


def gguf_vocab(tokenizer, vocab_size: int, where: Path) -> GGUFVocab:
    """The metadata of `tokenizer` (a byte-level BPE one) for a model of `vocab_size` embedding rows; refused,
    naming the reason, where a GGUF file cannot carry it."""
    backend = json.loads(_backend(tokenizer, where).to_str())
    model = backend["model"]
    if model.get("type") != "BPE" or not _is_byte_level(backend):
        raise CheckpointError(f"{where}: its tokenizer is a {model.get('type')} model without byte-level "
                              "pre-tokenization; batchrun writes byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2 "
                              "style) into GGUF files")
    tokens = {index: token for token, index in model["vocab"].items()}
    types = {index: NORMAL for index in tokens}
    for added in backend.get("added_tokens", []):
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added["special"] else USER_DEFINED
    if max(tokens) >= vocab_size:
        raise CheckpointError(f"{where}: its tokenizer has token id {max(tokens)}, past the model's {vocab_size} "
                              "embedding rows (config vocab_size)")
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model.get("merges", [])]
    if any(merge.count(" ") != 1 for merge in merges):
        raise CheckpointError(f"{where}: a merge of its tokenizer holds a space, which GGUF's space-joined merges "
                              "cannot carry")
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")}
    return GGUFVocab(
        tokens=[tokens.get(index, f"[PAD{index}]") for index in range(vocab_size)],
        token_types=[types.get(index, UNUSED) for index in range(vocab_size)],
        merges=merges, pre=pre_tokenizer_name(backend.get("pre_tokenizer"), where),
        special_ids={name: value for name, value in ids.items() if isinstance(value, int)},
        add_bos=bool(getattr(tokenizer, "add_bos_token", False)), add_eos=bool(getattr(tokenizer, "add_eos_token",
                                                                                                  False)),
        chat_template=tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None)


def _backend(tokenizer, where: Path):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise CheckpointError(f"{where}: its tokenizer loads only as a slow (Python) tokenizer; batchrun writes "
                              "tokenizers that load as a tokenizer.json pipeline into GGUF files")
    return backend


def _is_byte_level(backend: dict) -> bool:
    pre = backend.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return any(part.get("type") == "ByteLevel" for part in parts)


def pre_tokenizer_name(pre: dict | None, where: Path) -> str:
    """The `tokenizer.ggml.pre` from which transformers rebuilds the pre-tokenizer `pre` (tokenizer.json's)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        GGUF_PRE_TOKENIZER_SPLITS = {}
    pre = pre or {}
    if _same_pre_tokenizer(pre, {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}):
        return GPT2_PRE
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(parts) == 2 and parts[0].get("type") == "Split" and parts[0].get("behavior") == "Isolated" \
            and not parts[0].get("invert") and "Regex" in parts[0].get("pattern", {}) \
            and _same_pre_tokenizer(parts[1], {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}):
        names = [name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == parts[0]["pattern"]["Regex"]]
        if names:
            return min(names, key=lambda name: PREFERRED_PRE_NAMES.index(name) if name in PREFERRED_PRE_NAMES
                       else len(PREFERRED_PRE_NAMES))
    raise CheckpointError(f"{where}: its tokenizer's pre-tokenizer ({_describe_pre(pre)}) is none that transformers "
                          "rebuilds from a GGUF file's tokenizer.ggml.pre, so the file would split text differently")


def _same_pre_tokenizer(found: dict, expected: dict) -> bool:
    """Equal where splitting depends on it (trim_offsets moves offsets only)."""
    return {key: value for key, value in found.items() if key != "trim_offsets"} == expected


def _describe_pre(pre: dict) -> str:
    if not pre:
        return "none"
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return " + ".join(part.get("type", "?") for part in parts)


def check_rebuilt_tokenizer(source, rebuilt, where: Path, allow_nfc_loss: bool = False) -> None:
    """Refuse, naming the first difference, unless `rebuilt` (transformers' tokenizer from the GGUF metadata) splits
    and renders text as `source` does: the same pipeline, ids, special tokens and chat template.

    With `allow_nfc_loss`, a source whose only difference is an NFC normalizer (Qwen2's: GGUF has no key for it) is
    accepted: the two then split every NFC text alike (the normalizer leaves it as it is), which the corpus checks
    in its NFC form."""
    mine, theirs = json.loads(source.backend_tokenizer.to_str()), json.loads(rebuilt.backend_tokenizer.to_str())
    nfc_lost = mine.get("normalizer") == NFC and theirs.get("normalizer") is None
    if nfc_lost and not allow_nfc_loss:
        raise _differs(where, "its NFC normalizer has no GGUF key, so text not in NFC form (decomposed accents) "
                              "would reach the model unnormalized (--allow-nfc-loss writes it anyway: every NFC "
                              "text splits alike)")
    if nfc_lost:
        theirs["normalizer"] = NFC
    for part in ("normalizer", "pre_tokenizer", "decoder"):
        if _comparable(mine.get(part)) != _comparable(theirs.get(part)):
            raise _differs(where, f"its {part} ({_short(mine.get(part))}) is rebuilt from the GGUF file as "
                                  f"{_short(theirs.get(part))}")
    for key in ("type", "merges", "byte_fallback", "ignore_merges", "dropout", "unk_token",
                "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk"):
        if _comparable_model(mine["model"], key) != _comparable_model(theirs["model"], key):
            raise _differs(where, f"its BPE model's {key} is rebuilt differently from the GGUF file")
    _check_vocab(mine, theirs, where)
    added = {(token["id"], token["content"], token["special"]) for token in mine.get("added_tokens", [])}
    rebuilt_added = {(token["id"], token["content"], token["special"]) for token in theirs.get("added_tokens", [])}
    if added != rebuilt_added:
        raise _differs(where, f"its added tokens differ: {sorted(added ^ rebuilt_added)[:4]}")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(source, name, None) != getattr(rebuilt, name, None):
            raise _differs(where, f"its {name} {getattr(source, name, None)!r} is rebuilt as "
                                  f"{getattr(rebuilt, name, None)!r}")
    for text in TOKENIZER_PROBE_TEXTS:
        text = unicodedata.normalize("NFC", text) if nfc_lost else text
        for special in (True, False):
            wanted, got = (tokenizer(text, add_special_tokens=special).input_ids for tokenizer in (source, rebuilt))
            if wanted != got:
                raise _differs(where, f"it splits {text!r} differently")
    _check_chat_template(source, rebuilt, where)


def _check_vocab(mine: dict, theirs: dict, where: Path) -> None:
    """The rebuilt BPE vocabulary holds the source's, id for id; beyond it only the added tokens (matched before the
    model runs) and the filler rows no merge produces."""
    vocab, rebuilt = mine["model"]["vocab"], theirs["model"]["vocab"]
    changed = [token for token, index in vocab.items() if rebuilt.get(token) != index]
    if changed:
        raise _differs(where, f"its vocabulary is rebuilt with other ids for {changed[:4]}")
    merged = {piece for merge in _comparable_model(mine["model"], "merges")
              for piece in (*merge.split(" "), merge.replace(" ", ""))}
    extra = [token for token in rebuilt.keys() - vocab.keys() if token in merged]
    if extra:
        raise _differs(where, f"tokens {extra[:4]} the merges reach join its vocabulary")


def _check_chat_template(source, rebuilt, where: Path) -> None:
    if source.chat_template != rebuilt.chat_template:
        raise _differs(where, "its chat template is not the one the GGUF file carries back")
    if not source.chat_template:
        return
    for prompt in (True, False):
        mine = source.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False, add_generation_prompt=prompt)
        theirs = rebuilt.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False, add_generation_prompt=prompt)
        if mine != theirs or source(mine, add_special_tokens=False).input_ids != \
                rebuilt(theirs, add_special_tokens=False).input_ids:
            raise _differs(where, "its chat template renders or tokenizes a conversation differently")


def _comparable(part):
    """A pipeline part without the fields that move offsets only."""
    if isinstance(part, dict):
        return {key: _comparable(value) for key, value in part.items() if key != "trim_offsets"}
    if isinstance(part, list):
        return [_comparable(value) for value in part]
    return part


def _comparable_model(model: dict, key: str):
    value = model.get(key)
    if key == "merges":
        return [merge if isinstance(merge, str) else " ".join(merge) for merge in value or []]
    if key in ("continuing_subword_prefix", "end_of_word_suffix"):
        return value or None  # "" and None both add nothing
    if key == "byte_fallback" or key == "ignore_merges" or key == "fuse_unk":
        return bool(value)
    return value


def _short(part) -> str:
    text = json.dumps(part)
    return text if len(text) <= 160 else text[:157] + "..."


def _differs(where: Path, reason: str) -> CheckpointError:
    return CheckpointError(f"{where}: its tokenizer cannot travel exactly in a GGUF file: {reason}; transformers (and "
                           "batchrun) would split text differently, so no file is written")
