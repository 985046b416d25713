"""`quantize_checkpoint`: tiny Llama and Qwen2 checkpoints (float32 and bfloat16, the test tokenizer) written as
Q8_0, Q4_0 and Q4_1 GGUF files, checked against gguf-py and transformers: the config and tokenizer read back as the
checkpoint's own, every tensor holds gguf-py's blocks of the source, and batchrun runs the file as transformers
does. Then what is refused, and that a failed run leaves no file."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from batchrun.checkpoint import CheckpointError, load_config, load_tokenizer, read_tensor_infos
from batchrun.checkpoint.gguf_vocab import PROBE_CONVERSATION, TOKENIZER_PROBE_TEXTS
from batchrun.checkpoint.quantize import QUANT_TYPES, QuantizeRequest, quantize_checkpoint, read_rows
from batchrun.errors import OutputRefused

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 19, 77, 200, 31]])
# The fields of a config that change what the model computes, which the GGUF's config must hold unchanged.
COMPUTE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="session")
def source_checkpoint(tiny_checkpoint, tmp_path_factory):
    """source_checkpoint(arch, dtype): the tiny checkpoint, or a bfloat16 copy of it (saved by transformers)."""
    made: dict = {}

    def get(arch: str, dtype: str) -> Path:
        if dtype == "float32":
            return tiny_checkpoint(arch)
        if (arch, dtype) not in made:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            target = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.bfloat16).save_pretrained(target)
            AutoTokenizer.from_pretrained(tiny_checkpoint(arch)).save_pretrained(target)
            made[arch, dtype] = target
        return made[arch, dtype]

    return get


def quantized(source: Path, out: Path, quant_type: str, **options) -> Path:
    quantize_checkpoint(QuantizeRequest(source, out, quant_type, allow_nfc_loss=True, **options))
    return out


def transformers_gguf(file: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()


def source_tensors_as_gguf(source: Path, arch: str) -> dict[str, tuple[str, np.ndarray]]:
    """GGUF name -> (HF name, float32 values) of the source's tensors."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = load_config(source)
    arch_enum = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    tensors = {}
    for hf_name, info in read_tensor_infos(source).items():
        with open(info.file, "rb") as handle:
            values = read_rows(handle, info, 0, info.shape[0] if len(info.shape) > 1 else 1)
        tensors[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = (hf_name, values)
    return tensors


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_tensor_holds_gguf_pys_blocks_of_the_source(tmp_path, source_checkpoint, arch, quant_type, dtype):
    from gguf import GGUFReader, GGMLQuantizationType, quants
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    source = source_checkpoint(arch, dtype)
    file = quantized(source, tmp_path / "model.gguf", quant_type)
    config = load_config(source)
    unpermute = LlamaTensorProcessor(config=config)
    expected = source_tensors_as_gguf(source, arch)
    reader = GGUFReader(file)
    assert {tensor.name for tensor in reader.tensors} == set(expected) - ({"output.weight"} if arch == "qwen2"
                                                                          else set())
    for tensor in reader.tensors:
        hf_name, values = expected[tensor.name]
        stored = quants.dequantize(tensor.data, tensor.tensor_type).reshape(values.shape)
        if arch == "llama":  # transformers' own undoing of llama.cpp's q/k order
            stored = unpermute.process(stored, tensor.name).weights
        if values.ndim == 1 or values.shape[0] == 1 and len(tensor.shape) == 1:
            assert tensor.tensor_type == GGMLQuantizationType.F32 and np.array_equal(stored.ravel(), values.ravel())
            continue
        head = tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and arch == "qwen2")
        assert tensor.tensor_type.name == ("Q8_0" if head else quant_type.upper()), tensor.name
        # row by row quantization commutes with the row order, so the source's own rows give the same values
        assert np.array_equal(stored, quants.dequantize(quants.quantize(values, tensor.tensor_type),
                                                        tensor.tensor_type)), tensor.name
        scale = np.abs(values).max()
        assert np.abs(stored - values).max() <= scale * (0.01 if tensor.tensor_type.name == "Q8_0" else 0.15)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batchrun_runs_the_file_as_transformers_does_with_the_sources_config(tmp_path, source_checkpoint, arch,
                                                                             quant_type):
    from transformers import AutoConfig

    from batchrun.runtime import ResidentModel

    source = source_checkpoint(arch, "bfloat16")
    file = quantized(source, tmp_path / "model.gguf", quant_type)
    config, mine = load_config(file), load_config(source)
    for field in COMPUTE_FIELDS:
        assert config.get(field) == mine.get(field), field
    rebuilt, original = AutoConfig.for_model(**config), AutoConfig.from_pretrained(source)
    assert np.float32(rebuilt.rms_norm_eps) == np.float32(original.rms_norm_eps)
    assert rebuilt.rope_parameters["rope_theta"] == original.rope_parameters["rope_theta"]
    with torch.inference_mode():
        expected = transformers_gguf(file)(PROMPT).logits
    assert torch.equal(ResidentModel(file, device="cpu", dtype="float32")(PROMPT).logits, expected)
    if quant_type == "q8_0":  # close to the source model's own logits: the q/k rows are where transformers wants them
        from transformers import AutoModelForCausalLM

        with torch.inference_mode():
            original_logits = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(PROMPT).logits
        assert (expected - original_logits).abs().max() < 0.02 * original_logits.abs().max()
        assert torch.equal(expected.argmax(-1), original_logits.argmax(-1))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_files_tokenizer_splits_and_renders_as_the_sources(tmp_path, source_checkpoint, arch):
    import unicodedata

    source = source_checkpoint(arch, "float32")
    file = quantized(source, tmp_path / "model.gguf", "q4_0")
    mine, theirs = load_tokenizer(source), load_tokenizer(file)
    for text in TOKENIZER_PROBE_TEXTS:
        text = unicodedata.normalize("NFC", text)  # Qwen2's NFC normalizer has no GGUF key (--allow-nfc-loss)
        assert theirs(text).input_ids == mine(text).input_ids, text
        assert theirs.decode(theirs(text).input_ids) == mine.decode(mine(text).input_ids)
    for prompt in (True, False):
        rendered = mine.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False, add_generation_prompt=prompt)
        assert theirs.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False,
                                          add_generation_prompt=prompt) == rendered
    assert (theirs.bos_token, theirs.eos_token, theirs.pad_token) == (mine.bos_token, mine.eos_token,
                                                                      mine.pad_token)


def test_qwen2s_nfc_normalizer_is_refused_unless_allowed(tmp_path, source_checkpoint):
    out = tmp_path / "qwen2.gguf"
    with pytest.raises(CheckpointError, match="its NFC normalizer has no GGUF key, so text not in NFC form"):
        quantize_checkpoint(QuantizeRequest(source_checkpoint("qwen2", "float32"), out, "q8_0"))
    assert list(tmp_path.iterdir()) == []


def copy_checkpoint(source: Path, target: Path, config_changes: dict | None = None, drop=()) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*drop) if drop else None)
    if config_changes:
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **config_changes}))
    return target


def test_what_cannot_travel_is_refused_before_any_file_is_written(tmp_path, source_checkpoint):
    source = source_checkpoint("llama", "float32")
    out = tmp_path / "out"
    out.mkdir()

    def refused(checkpoint: Path, pattern: str, quant_type: str = "q8_0") -> None:
        with pytest.raises(CheckpointError, match=pattern):
            quantize_checkpoint(QuantizeRequest(checkpoint, out / "model.gguf", quant_type))
        assert list(out.iterdir()) == []

    refused(source, "quantization type 'q4_k': batchrun writes q8_0, q4_0, q4_1", "q4_k")
    refused(copy_checkpoint(source, tmp_path / "mistral", {"model_type": "mistral"}),
            "mistral: a 'mistral' model; batchrun quantizes llama, qwen2 checkpoints")
    refused(copy_checkpoint(source, tmp_path / "bare", drop=("tokenizer*",)), "bare: has no tokenizer")
    refused(copy_checkpoint(source, tmp_path / "scaled", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
            r"scaled: its config cannot travel in a GGUF file .*rope_parameters")
    refused(copy_checkpoint(source, tmp_path / "biased", {"attention_bias": True}),
            "biased: its config cannot travel in a GGUF file .*attention_bias True would read back as False")
    refused(tmp_path / "nowhere", "nowhere: not a safetensors checkpoint directory")


def test_a_non_float_tensor_is_refused_naming_it(tmp_path, source_checkpoint):
    from safetensors.numpy import load_file, save_file

    target = copy_checkpoint(source_checkpoint("llama", "float32"), tmp_path / "int8")
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].astype(np.int8)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor 'model.layers.0.mlp.up_proj.weight' is I8; batchrun quantizes "
                                              "float32, float16 and bfloat16"):
        quantize_checkpoint(QuantizeRequest(target, tmp_path / "model.gguf", "q8_0"))
    assert not (tmp_path / "model.gguf").exists()


def test_an_existing_file_is_replaced_only_when_forced_and_a_failed_run_leaves_none(tmp_path, source_checkpoint,
                                                                                     monkeypatch):
    source = source_checkpoint("llama", "float32")
    out = tmp_path / "model.gguf"
    out.write_text("the user's own file")
    with pytest.raises(OutputRefused, match="model.gguf: exists; pass --force to replace it"):
        quantize_checkpoint(QuantizeRequest(source, out, "q8_0"))
    assert out.read_text() == "the user's own file"

    def failing_chunks(plan):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr("batchrun.checkpoint.quantize.quantized_chunks", failing_chunks)
        with pytest.raises(OSError, match="disk full"):
            quantize_checkpoint(QuantizeRequest(source, out, "q8_0", force=True))
    assert out.read_text() == "the user's own file" and sorted(tmp_path.iterdir()) == [out]
    quantize_checkpoint(QuantizeRequest(source, out, "q8_0", force=True))
    assert out.read_bytes()[:4] == b"GGUF" and sorted(tmp_path.iterdir()) == [out]
