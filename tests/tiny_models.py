"""Tiny random-weight checkpoints for the architecture matrix, plus sharded and large variants.

Everything is built locally (no hub access), deterministically, and cached on disk: a checkpoint
directory is only ever renamed into place once complete, and builders of one directory take turns under a file
lock, so parallel test processes can share a cache. A cached tiny checkpoint's directory name carries the library
versions and this file's hash (cache_key), so a changed builder or library builds anew instead of reusing weights
it would no longer write.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

TINY_ARCHS = ("llama", "qwen2", "gemma3", "gpt_neox", "phi3", "mixtral", "gpt2")

COMPLETE_MARKER = ".complete"
MAX_POSITIONS = 256
# Gemma 3's sliding window, kept far below typical test prompt lengths so that the window changes results.
GEMMA3_SLIDING_WINDOW = 8

PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen2Tokenizer (which AutoTokenizer forces for qwen2 checkpoints) adds this token when it is missing.
ENDOFTEXT = "<|endoftext|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB_SIZE = 512

_COMMON_WORDS = (
    "the a an of to and in is was for on with as by at from that this it be are were has have had not but or "
    "which one all would there their what so up out if about who get go me when make can like time no just him "
    "know take people into year your good some could them see other than then now look only come its over think "
    "also back after use two how our work first well way even new want because any these give day most us"
).split()
_DOMAIN_WORDS = (
    "report review customer product service order invoice contract meeting summary document letter email "
    "delivery price quality support team manager account issue problem request answer positive negative"
).split()


def training_text(num_lines: int = 400) -> list[str]:
    """Deterministic English-like sentences for training the tiny tokenizer."""
    rng = random.Random(0)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_COMMON_WORDS if rng.random() < 0.7 else _DOMAIN_WORDS) for _ in range(rng.randint(5, 16))]
        line = " ".join(words).capitalize() + rng.choice([".", ".", "?", "!"])
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 2024)}"
        lines.append(line)
    return lines


def build_tokenizer(model_max_length: int = MAX_POSITIONS):
    """A byte-level BPE tokenizer (any text round-trips) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        # The pad token last, as in real checkpoints (SmolLM2's is 2): the model's embedding gets a padding index
        # that a table of a few gathered rows does not reach.
        special_tokens=[IM_START, IM_END, ENDOFTEXT, PAD_TOKEN],
        # The full byte alphabet is what makes every string encodable without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_text(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IM_START,
        eos_token=IM_END,  # as in SmolLM2: generation stops at the end of the assistant turn
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _token_ids(tokenizer) -> dict:
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tiny_config(arch: str, vocab_size: int, token_ids: dict):
    """The transformers config of the tiny model for `arch` (hidden 64, 4 heads, 2 KV heads where supported)."""
    import transformers

    shared = dict(vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS, dtype="float32", **token_ids)
    llama_like = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if arch == "llama":
        return transformers.LlamaConfig(**llama_like, **shared)
    if arch == "qwen2":
        return transformers.Qwen2Config(**llama_like, tie_word_embeddings=True, **shared)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**llama_like, "num_hidden_layers": 3},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=GEMMA3_SLIDING_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=True,
            **shared,
        )
    if arch == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            tie_word_embeddings=False, **shared,
        )
    if arch == "phi3":
        return transformers.Phi3Config(**llama_like, **shared)
    if arch == "mixtral":
        return transformers.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2, **shared)
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=MAX_POSITIONS, vocab_size=vocab_size,
            dtype="float32", **token_ids,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def _build_model(arch: str, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, len(tokenizer), _token_ids(tokenizer))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def library_versions() -> dict[str, str]:
    """The versions whose change can change what the builders write: transformers (configs, save_pretrained),
    tokenizers (the BPE training), torch (the random initialisation) and batchrun."""
    import tokenizers
    import torch
    import transformers

    import batchrun

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "torch": torch.__version__, "batchrun": batchrun.__version__}


def builder_source() -> str:
    """This file's text: the configs, the tokenizer's training text and the builders all live here."""
    return Path(__file__).read_text(encoding="utf-8")


@functools.cache
def cache_key() -> str:
    """'transformers<v>-batchrun<v>-<hash>': names the cache entries built by this code under these libraries. The
    hash covers this file's text and every version in library_versions."""
    versions = library_versions()
    digest = hashlib.sha256(json.dumps([versions, builder_source()], sort_keys=True).encode()).hexdigest()[:12]
    readable = f"transformers{versions['transformers']}-batchrun{versions['batchrun']}-{digest}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", readable)  # a local version ("2.5+cpu") stays one path component


def _build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` and rename tmp_dir to `target`, unless a complete `target` already exists.

    Readers take a complete `target` without locking: it appears only by a rename, whole. Builders of one target
    take turns under a lock file beside it, so while one removes an incomplete leftover, no other is renaming its
    finished copy into that place (which the removal would delete under its readers)."""
    if (target / COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (target / COMPLETE_MARKER).exists():  # another process built it while this one waited
            return target
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
        try:
            write(staging)
            (staging / COMPLETE_MARKER).write_text("ok\n")
            os.chmod(staging, 0o755)  # mkdtemp creates 0700; a shared test cache must stay readable
            if target.exists():
                shutil.rmtree(target)  # something incomplete (an interrupted build) that no builder owns
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def tiny_checkpoint_dir(arch: str, root: Path) -> Path:
    """Where build_tiny_checkpoint keeps `arch` under `root`: root/'<arch>-<cache_key()>'."""
    return Path(root) / f"{arch}-{cache_key()}"


def build_tiny_checkpoint(arch: str, root: Path) -> Path:
    """root/'<arch>-<cache_key()>': a tiny float32 random checkpoint of `arch` with tokenizer and chat template.
    Built once per builder source and library versions."""
    if arch not in TINY_ARCHS:  # before a lock file or directory is named after it
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(TINY_ARCHS)}")

    def write(directory: Path) -> None:
        tokenizer = build_tokenizer()
        _build_model(arch, tokenizer).save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return _build_once(tiny_checkpoint_dir(arch, root), write)


def build_sharded_checkpoint(arch: str, root: Path, max_shard_size: str = "200KB") -> Path:
    """root/'<arch>-sharded-<cache_key()>': the same weights as build_tiny_checkpoint(arch), split into several
    shards."""

    def write(directory: Path) -> None:
        tokenizer = build_tokenizer()
        _build_model(arch, tokenizer).save_pretrained(directory, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(directory)

    return _build_once(Path(root) / f"{arch}-sharded-{cache_key()}", write)


# Layer shape of TinyLlama-1.1B: 22 such layers plus a 32000-token vocabulary make a 2.2 GB bf16 checkpoint.
LARGE_HIDDEN = 2048
LARGE_INTERMEDIATE = 5632
LARGE_HEAD_DIM = 64
LARGE_GQA_GROUP = 8
LARGE_INIT_STD = 0.02


def _large_shape(hidden: int) -> dict:
    heads = max(1, hidden // LARGE_HEAD_DIM)
    # Key/value heads must divide the query heads (19 heads took 2 and made a model no attention could run).
    kv_heads = max(d for d in range(1, max(1, heads // LARGE_GQA_GROUP) + 1) if heads % d == 0)
    return dict(
        hidden_size=hidden,
        intermediate_size=max(64, LARGE_INTERMEDIATE * hidden // LARGE_HIDDEN // 64 * 64),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def _large_params(shape: dict, num_layers: int, vocab_size: int) -> int:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv_dim = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    return num_layers * per_layer + 2 * vocab_size * hidden + hidden


def _choose_large_shape(target_params: int, num_layers: int | None, vocab_size: int,
                        hidden_size: int = LARGE_HIDDEN) -> tuple[dict, int]:
    if num_layers is not None and hidden_size != LARGE_HIDDEN:
        raise ValueError("give the layer count or the hidden size, not both: the other is chosen to reach the size")
    if num_layers is None:
        shape = _large_shape(hidden_size)
        per_layer = _large_params(shape, 1, 0) - hidden_size
        embeddings = _large_params(shape, 0, vocab_size)
        return shape, max(1, round((target_params - embeddings) / per_layer))
    hidden = min(
        range(64, 16384 + 1, 64),
        key=lambda h: abs(_large_params(_large_shape(h), num_layers, vocab_size) - target_params),
    )
    return _large_shape(hidden), num_layers


def build_large_llama(
    root: Path,
    target_bytes: int,
    dtype: str = "bfloat16",
    num_layers: int | None = None,
    vocab_size: int = 32000,
    shard_bytes: int = 256_000_000,
    hidden_size: int = LARGE_HIDDEN,
) -> Path:
    """A random Llama-style checkpoint of about `target_bytes`, written shard by shard (never all in RAM).

    With num_layers None the layers have TinyLlama's shape scaled to `hidden_size` (TinyLlama's own by default)
    and their count is chosen to reach the size; otherwise the hidden size is chosen. The vocabulary is
    `vocab_size` rows (the tokenizer uses the first few hundred) so the embedding and head weigh what they do in a
    real model. Returns root/<name>.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    torch_dtype = getattr(torch, dtype)
    element_size = torch.empty((), dtype=torch_dtype).element_size()
    shape, layers = _choose_large_shape(target_bytes // element_size, num_layers, vocab_size, hidden_size)
    name = f"llama-{target_bytes // 1_000_000}MB-{dtype}-h{shape['hidden_size']}-L{layers}-v{vocab_size}"

    def tensor_specs():
        hidden, inter = shape["hidden_size"], shape["intermediate_size"]
        kv_dim = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
        yield "model.embed_tokens.weight", (vocab_size, hidden)
        for i in range(layers):
            prefix = f"model.layers.{i}."
            yield prefix + "input_layernorm.weight", (hidden,)
            yield prefix + "self_attn.q_proj.weight", (hidden, hidden)
            yield prefix + "self_attn.k_proj.weight", (kv_dim, hidden)
            yield prefix + "self_attn.v_proj.weight", (kv_dim, hidden)
            yield prefix + "self_attn.o_proj.weight", (hidden, hidden)
            yield prefix + "post_attention_layernorm.weight", (hidden,)
            yield prefix + "mlp.gate_proj.weight", (inter, hidden)
            yield prefix + "mlp.up_proj.weight", (inter, hidden)
            yield prefix + "mlp.down_proj.weight", (hidden, inter)
        yield "model.norm.weight", (hidden,)
        yield "lm_head.weight", (vocab_size, hidden)

    def make(tensor_name: str, dims: tuple, generator) -> torch.Tensor:
        if len(dims) == 1:  # RMSNorm weights: ones, as at initialisation
            return torch.ones(dims, dtype=torch_dtype)
        # Small std keeps activations finite through many random layers.
        return (torch.randn(dims, generator=generator) * LARGE_INIT_STD).to(torch_dtype)

    def write(directory: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        tokenizer = build_tokenizer(model_max_length=2048)
        config = LlamaConfig(
            **shape, num_hidden_layers=layers, vocab_size=vocab_size, max_position_embeddings=2048,
            tie_word_embeddings=False, dtype=dtype, architectures=["LlamaForCausalLM"], **_token_ids(tokenizer),
        )
        shards: list[dict] = [{}]
        shard_sizes = [0]
        for tensor_name, dims in tensor_specs():
            size = element_size * _numel(dims)
            if shard_sizes[-1] and shard_sizes[-1] + size > shard_bytes:
                shards.append({})
                shard_sizes.append(0)
            shards[-1][tensor_name] = dims
            shard_sizes[-1] += size
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            tensors = {tensor_name: make(tensor_name, dims, generator) for tensor_name, dims in shard.items()}
            save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
            del tensors  # only one shard's tensors are ever alive
            weight_map.update({tensor_name: file_name for tensor_name in shard})
        index_json = {"metadata": {"total_size": sum(shard_sizes)}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
        config.save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return _build_once(Path(root) / name, write)


def _numel(dims: tuple) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count
