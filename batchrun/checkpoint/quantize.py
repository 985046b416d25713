"""A safetensors checkpoint (Llama or Qwen2, float32, float16 or bfloat16) written as a quantized GGUF file that
batchrun, transformers and llama.cpp read: Q8_0, Q4_0 or Q4_1 blocks through gguf-py's quantizer, tensor by tensor.

Everything is checked before a weight is read: the architecture, every tensor's dtype and GGUF name, the config
transformers rebuilds from the metadata (equal to the checkpoint's on every field that changes what the model
computes) and the tokenizer it rebuilds (gguf_vocab). The weights are then read a chunk of rows at a time into a
file beside the output, renamed into place once complete: memory stays at a chunk's size whatever the model's, and
a stopped run leaves no file under the output's name.

No torch: safetensors bytes are read with numpy (bfloat16 widened by a bit shift), imported only when a file is
written so that `batchrun.checkpoint`, which exports this module, imports no numpy.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.checkpoint.files import CheckpointError, TensorInfo, load_config, read_tensor_infos
from batchrun.checkpoint.gguf_vocab import GGUFVocab, check_rebuilt_tokenizer, gguf_vocab, load_source_tokenizer
from batchrun.checkpoint.progress import bars_shown
from batchrun.errors import OutputRefused

if TYPE_CHECKING:
    import numpy as np

QUANT_TYPES = ("q8_0", "q4_0", "q4_1")
# transformers model_type -> GGUF architecture; q and k rows are stored in llama.cpp's rotary order for "llama".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# The head's matrix (the tied embedding too) stays Q8_0 under the 4-bit types: llama.cpp keeps it in more bits
# (Q6_K, which gguf-py cannot write), as logits are sensitive to it.
HEAD_TYPE = "Q8_0"
HEAD_NAMES = frozenset({"output.weight"})
SOURCE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "uint16"}
# Rows quantized at a time: 4M weights, 16 MB as float32.
CHUNK_WEIGHTS = 1 << 22
# Config fields that do not change what the model computes from a prompt: training and saving details, and the
# transformers fields a GGUF file has no key for that only name things.
UNCOMPARED_CONFIG_FIELDS = frozenset({
    "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache",
    "initializer_range", "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "tokenizer_class", "task_specific_params",
    "is_encoder_decoder", "tf_legacy_loss", "pruned_heads", "cross_attention_hidden_size", "add_cross_attention",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "max_window_layers", "_attn_implementation",
    "transformers.js_config", "model_type", "_model_name_or_path", "unk_token_id",
})


@dataclass(frozen=True)
class QuantizeRequest:
    checkpoint: Path  # a safetensors checkpoint directory: config.json, *.safetensors, the tokenizer's files
    output: Path
    quant_type: str = "q8_0"  # one of QUANT_TYPES
    force: bool = False  # replace an existing output file
    allow_nfc_loss: bool = False  # write a tokenizer whose NFC normalizer GGUF cannot carry (gguf_vocab)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the output: its source, GGUF name, ggml type, and the rows of one q/k head when llama.cpp's
    rotary order applies."""
    source: TensorInfo
    name: str
    ggml_type: str
    head_rows: int | None = None

    @property
    def nbytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[self.ggml_type]]
        return self.source.numel // weights * block_bytes


@dataclass(frozen=True)
class QuantizeResult:
    output: Path
    quant_type: str
    tensors: int
    source_bytes: int
    written_bytes: int
    pre_tokenizer: str
    seconds: float


def quantize_checkpoint(request: QuantizeRequest) -> QuantizeResult:
    """Write `request.checkpoint` as a GGUF file of `request.quant_type` blocks; every refusal comes before the
    first weight is read and leaves no file."""
    began = time.monotonic()
    output, directory = request.output.expanduser(), request.checkpoint.expanduser()
    if request.quant_type not in QUANT_TYPES:
        raise CheckpointError(f"quantization type {request.quant_type!r}: batchrun writes {', '.join(QUANT_TYPES)}")
    _refuse_existing(output, request.force)
    config, arch = _source_config(directory)
    plans = tensor_plans(directory, config, arch, request.quant_type)
    tokenizer = load_source_tokenizer(directory)
    vocab = gguf_vocab(tokenizer, config["vocab_size"], directory)
    metadata = gguf_metadata(config, arch, directory.name, request.quant_type)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as work:
        _check_round_trip(Path(work), arch, (metadata, vocab), plans, (directory, config, tokenizer, request))
        partial = Path(work) / output.name
        _write_gguf(partial, arch, (metadata, vocab), plans)
        _refuse_existing(output, request.force)  # one may have appeared while this ran
        os.replace(partial, output)
    return QuantizeResult(output, request.quant_type, len(plans), sum(plan.source.nbytes for plan in plans),
                          output.stat().st_size, vocab.pre, time.monotonic() - began)


def _refuse_existing(output: Path, force: bool) -> None:
    if not output.parent.is_dir():
        raise CheckpointError(f"{output}: its directory {output.parent} does not exist")
    if output.exists() and (not force or not output.is_file()):
        raise OutputRefused(f"{output}: exists; pass --force to replace it" if output.is_file()
                            else f"{output}: exists and is not a file")


def _source_config(directory: Path) -> tuple[dict, str]:
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: not a safetensors checkpoint directory (no config.json)")
    config = load_config(directory)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{directory}: a {model_type!r} model; batchrun quantizes "
                              f"{', '.join(sorted(ARCHITECTURES))} checkpoints")
    return config, ARCHITECTURES[model_type]


def tensor_plans(directory: Path, config: dict, arch: str, quant_type: str) -> list[TensorPlan]:
    """Every tensor of the checkpoint as the output stores it, in llama.cpp's order; refused, naming the tensor,
    where one is not a float or has no GGUF name."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_enum = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    tied = bool(config.get("tie_word_embeddings"))
    plans = []
    for hf_name, info in read_tensor_infos(directory).items():
        if info.dtype not in SOURCE_DTYPES:
            raise CheckpointError(f"{info.file}: tensor {hf_name!r} is {info.dtype}; batchrun quantizes float32, "
                                  "float16 and bfloat16 checkpoints (a quantized checkpoint cannot be quantized again)")
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"{info.file}: tensor {hf_name!r} has no GGUF name for a {arch} model")
        if name == "output.weight" and tied:
            continue  # the tied head is the embedding
        plans.append(TensorPlan(info, name, _ggml_type(name, info, quant_type, tied), _head_rows(name, config, arch)))
    if not tied and not any(plan.name == "output.weight" for plan in plans):
        raise CheckpointError(f"{directory}: its config unties the head from the embedding, but no lm_head tensor "
                              "is in its safetensors files")
    return sorted(plans, key=lambda plan: _file_order(plan.name))


def _ggml_type(name: str, info: TensorInfo, quant_type: str, tied: bool) -> str:
    """F32 for 1-D tensors (norms, biases: llama.cpp's choice) and rows not whole blocks of 32; the head Q8_0."""
    if len(info.shape) != 2 or info.shape[-1] % 32:
        return "F32"
    if name in HEAD_NAMES or (tied and name == "token_embd.weight"):
        return HEAD_TYPE
    return quant_type.upper()


def _head_rows(name: str, config: dict, arch: str) -> int | None:
    if arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return None
    return _head_dim(config)  # llama.cpp interleaves the two rotary halves of each head


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _file_order(name: str) -> tuple:
    """llama.cpp's order: the token embedding, the layers in turn, then the rest."""
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if parts[0] == "token_embd" else 2, 0, name)


def gguf_metadata(config: dict, arch: str, name: str, quant_type: str) -> dict[str, object]:
    """The architecture's keys (as llama.cpp's converter writes them) and the file's; values keep their Python type
    (int -> uint32, float -> float32, str, bool)."""
    from gguf import LlamaFileType

    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    metadata: dict[str, object] = {
        "general.name": name, "general.file_type": int(LlamaFileType[f"MOSTLY_{quant_type.upper()}"]),
        "general.quantization_version": 2,
        f"{arch}.context_length": config["max_position_embeddings"],
        f"{arch}.embedding_length": config["hidden_size"], f"{arch}.block_count": config["num_hidden_layers"],
        f"{arch}.feed_forward_length": config["intermediate_size"],
        f"{arch}.attention.head_count": config["num_attention_heads"],
        f"{arch}.attention.head_count_kv": config.get("num_key_value_heads") or config["num_attention_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
        f"{arch}.rope.freq_base": float(theta), f"{arch}.vocab_size": config["vocab_size"],
    }
    if arch == "llama":
        metadata[f"{arch}.rope.dimension_count"] = _head_dim(config)
    return metadata


def _add_metadata(writer, metadata: dict[str, object], vocab: GGUFVocab) -> None:
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_token_merges(vocab.merges)
    for kind, token_id in vocab.special_ids.items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


def _check_round_trip(work: Path, arch: str, header: tuple[dict, GGUFVocab], plans: list[TensorPlan],
                      source: tuple) -> None:
    """Write the metadata alone, and refuse unless the config and tokenizer transformers rebuilds from it are the
    checkpoint's own."""
    from gguf import GGUFWriter

    from batchrun.checkpoint.gguf_index import read_gguf_index
    from batchrun.checkpoint.gguf_model import gguf_config

    directory, config, tokenizer, request = source
    probe = work / "metadata.gguf"
    writer = GGUFWriter(probe, arch)
    _add_metadata(writer, *header)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    rebuilt = gguf_config(read_gguf_index(probe))
    rebuilt["tie_word_embeddings"] = not any(plan.name in HEAD_NAMES for plan in plans)
    check_rebuilt_config(config, rebuilt, directory)
    check_rebuilt_tokenizer(tokenizer, _gguf_tokenizer(probe), directory, request.allow_nfc_loss)


def check_rebuilt_config(config: dict, rebuilt: dict, where: Path) -> None:
    """Refuse, naming the fields, unless the config transformers builds from the GGUF metadata (`rebuilt`) equals
    the checkpoint's on every field that changes what the model computes."""
    from transformers import AutoConfig

    mine = AutoConfig.for_model(**config).to_dict()
    theirs = AutoConfig.for_model(**rebuilt).to_dict()
    differing = [key for key in sorted(mine.keys() | theirs.keys())
                 if key not in UNCOMPARED_CONFIG_FIELDS and _as_float32(mine.get(key)) != _as_float32(theirs.get(key))]
    if differing:
        said = "; ".join(f"{key} {mine.get(key)!r} would read back as {theirs.get(key)!r}" for key in differing[:4])
        raise CheckpointError(f"{where}: its config cannot travel in a GGUF file that transformers reads back "
                              f"({said}); no file is written")


def _as_float32(value):
    """GGUF stores floats as float32 (llama.cpp's choice), which is also the precision the model adds them in."""
    import numpy as np

    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {key: _as_float32(item) for key, item in value.items()}
    return value


def _gguf_tokenizer(file: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except (ValueError, KeyError, NotImplementedError) as error:
        raise CheckpointError(f"{file}: transformers cannot build a tokenizer from the metadata batchrun would write "
                              f"({type(error).__name__}: {error})") from None


def _write_gguf(path: Path, arch: str, header: tuple[dict, GGUFVocab], plans: list[TensorPlan]) -> None:
    """The file: metadata and tensor infos first, then each tensor's blocks a chunk of rows at a time."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from tqdm import tqdm

    writer = GGUFWriter(path, arch)
    _add_metadata(writer, *header)
    for plan in plans:
        writer.add_tensor_info(plan.name, plan.source.shape, np.dtype(np.float32), plan.nbytes,
                               raw_dtype=GGMLQuantizationType[plan.ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    bar = tqdm(total=sum(plan.source.nbytes for plan in plans), unit="B", unit_scale=True, desc="quantize",
               disable=not bars_shown())
    try:
        for plan in plans:
            bar.set_postfix_str(f"{plan.name} {plan.ggml_type}", refresh=False)
            writer.write_padding(out, out.tell())
            for blocks in quantized_chunks(plan):
                out.write(memoryview(np.ascontiguousarray(blocks)).cast("B"))
                bar.update(blocks.shape[0] * plan.source.nbytes // plan.source.shape[0])
            writer.write_padding(out, plan.nbytes)
        out.flush()
        os.fsync(out.fileno())
    finally:
        bar.close()
        writer.close()


def quantized_chunks(plan: TensorPlan):
    """The tensor's blocks (or F32 values), as uint8/float32 rows, a chunk of rows at a time; q and k rows in
    llama.cpp's rotary order."""
    from gguf import GGMLQuantizationType, quants

    info = plan.source
    width = info.shape[-1]
    rows = info.numel // width
    step = max(1, CHUNK_WEIGHTS // width)
    if plan.head_rows:
        step = max(plan.head_rows, step // plan.head_rows * plan.head_rows)
    with open(info.file, "rb") as handle:
        for start in range(0, rows, step):
            values = read_rows(handle, info, start, min(rows, start + step))
            if plan.head_rows:
                values = permute_qk_rows(values, plan.head_rows)
            yield quants.quantize(values, GGMLQuantizationType[plan.ggml_type])


def read_rows(handle, info: TensorInfo, start: int, stop: int) -> np.ndarray:
    """Rows start..stop-1 of a safetensors tensor as float32 [rows, width] (a 1-D tensor is one row)."""
    import numpy as np

    width = info.shape[-1]
    stored = np.dtype(SOURCE_DTYPES[info.dtype])
    handle.seek(info.offset + start * width * stored.itemsize)
    raw = np.fromfile(handle, dtype=stored.newbyteorder("<"), count=(stop - start) * width)
    if info.dtype == "BF16":  # bfloat16 is float32's high half
        values = (raw.astype(np.uint32) << 16).view(np.float32)
    else:
        values = raw.astype(np.float32)
    return values.reshape(stop - start, width) if len(info.shape) > 1 else values


def permute_qk_rows(values: np.ndarray, head_rows: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute: each head's two rotary halves interleaved row by row."""
    heads = values.shape[0] // head_rows
    return values.reshape(heads, 2, head_rows // 2, values.shape[1]).swapaxes(1, 2).reshape(values.shape)
