"""A GGUF file as a model: resolved as --model, its config built from its metadata as transformers builds it, its sizes
counted in quantized bytes, and what is refused before any weight is read."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from batchrun.checkpoint import (CheckpointError, checkpoint_location, checkpoint_sizes, gguf_config, load_config,
                                 read_gguf_index, read_tensor_infos, resolve_checkpoint)
from tests.gguf_files import TINY_ARCH_METADATA, write_gguf, write_tiny_gguf_model


def transformers_config(file) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    return load_gguf_checkpoint(str(file))["config"]


@pytest.mark.parametrize("arch", sorted(TINY_ARCH_METADATA))
def test_the_config_is_transformers_own_for_tiny_models(tmp_path, arch):
    file = write_tiny_gguf_model(tmp_path / f"{arch}.gguf", arch)
    assert gguf_config(read_gguf_index(file)) == transformers_config(file)
    assert load_config(file) == transformers_config(file)


def test_the_config_is_transformers_own_for_the_registry_ggufs(default_gguf, gemma3_gguf):
    for file in (default_gguf[0], gemma3_gguf):
        assert gguf_config(read_gguf_index(file)) == transformers_config(file)


def test_a_gguf_file_or_a_folder_holding_one_resolves_to_the_file(tmp_path, default_gguf):
    (tmp_path / "one").mkdir()
    file = write_tiny_gguf_model(tmp_path / "one" / "llama.gguf", "llama")
    assert resolve_checkpoint(file) == file and resolve_checkpoint(str(file)) == file
    assert resolve_checkpoint(tmp_path / "one") == file
    assert checkpoint_location(str(file)) == file.resolve()
    shutil.copy(file, tmp_path / "one" / "other.gguf")
    with pytest.raises(CheckpointError, match=r"one: holds 2 GGUF models \(llama.gguf, other.gguf\)"):
        resolve_checkpoint(tmp_path / "one")
    # a folder with a config.json is a safetensors checkpoint, whatever GGUF lies beside it
    converted = default_gguf[1]
    assert resolve_checkpoint(converted) == converted
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="notes.txt: is a file, not a GGUF model"):
        resolve_checkpoint(tmp_path / "notes.txt")


def test_a_folder_holding_one_split_model_resolves_to_its_first_part(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"blk.{i}.attn_q.weight": ("Q8_0", rng.integers(0, 256, (4, 34), dtype=np.uint8)) for i in range(3)}
    files = write_gguf(tmp_path / "split.gguf", tensors, tensors_per_file=1)
    assert resolve_checkpoint(tmp_path) == files[0]


def test_sizes_count_the_quantized_bytes_of_each_layer(default_gguf):
    file, converted = default_gguf
    sizes, widened = checkpoint_sizes(file), checkpoint_sizes(converted)
    index = read_gguf_index(file)
    layer_bytes = [sum(info.nbytes for name, info in index.tensors.items() if name.startswith(f"blk.{layer}."))
                   for layer in range(sizes.num_layers)]
    assert sizes.layer_bytes == layer_bytes and sizes.file_format == "gguf" and sizes.storage_dtype == "Q4_1"
    assert sizes.checkpoint_bytes == sum(info.nbytes for info in index.tensors.values())
    # the same model as its float32 conversion, in a fifth of the bytes
    assert sizes.layer_params == widened.layer_params and sizes.non_decoder_params == widened.non_decoder_params
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "tied_embeddings", "sliding_windows", "max_position_embeddings"):
        assert getattr(sizes, field) == getattr(widened, field), field
    assert sizes.decoder_bytes < widened.decoder_bytes / 5
    assert sorted(sizes.layer_matrices) == sorted(widened.layer_matrices)
    assert read_tensor_infos(file) == index.tensors


def test_gemma3_sizes_place_its_sliding_window_as_its_config_class_does(gemma3_gguf):
    from batchrun.runtime import model_config

    sizes = checkpoint_sizes(gemma3_gguf)
    config = model_config(gemma3_gguf)
    assert sizes.sliding_windows == [config.sliding_window if kind == "sliding_attention" else None
                                     for kind in config.layer_types]
    assert sizes.unplaced_window is None and None in sizes.sliding_windows


def test_an_architecture_transformers_cannot_map_is_refused_naming_it(tmp_path):
    tensors = {"blk.0.attn_q.weight": ("F32", np.zeros((2, 8), dtype=np.uint8))}
    (file,) = write_gguf(tmp_path / "rwkv.gguf", tensors, arch="rwkv6", metadata={"rwkv6.block_count": 1})
    with pytest.raises(CheckpointError, match=r"rwkv.gguf: GGUF architecture 'rwkv6', which transformers cannot "
                                              r"read from GGUF \(it reads .*llama"):
        checkpoint_sizes(file)


def test_an_architecture_whose_tensors_transformers_reshapes_is_refused_naming_it(tmp_path):
    tensors = {"blk.0.attn_qkv.weight": ("F32", np.zeros((2, 8), dtype=np.uint8))}
    (file,) = write_gguf(tmp_path / "gpt2.gguf", tensors, arch="gpt2", metadata={"gpt2.block_count": 1})
    with pytest.raises(CheckpointError, match="gpt2.gguf: GGUF architecture 'gpt2', whose tensors transformers "
                                              "reshapes on load"):
        checkpoint_sizes(file)


def test_an_unsupported_type_or_a_big_endian_file_is_refused_by_the_sizes(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"blk.0.attn_q.weight": ("Q2_K", rng.integers(0, 256, (1, 84), dtype=np.uint8))}
    (file,) = write_gguf(tmp_path / "q2k.gguf", tensors)
    with pytest.raises(CheckpointError, match="tensor 'blk.0.attn_q.weight' is of ggml type Q2_K"):
        checkpoint_sizes(file)
    (big,) = write_gguf(tmp_path / "big.gguf", {"blk.0.attn_q.weight": ("F32", np.zeros((1, 8), np.uint8))},
                        big_endian=True)
    with pytest.raises(CheckpointError, match="big.gguf: a big-endian GGUF file"):
        checkpoint_sizes(big)


def test_an_architecture_of_transformers_newer_gguf_reader_is_refused_naming_it(tmp_path):
    tensors = {"blk.0.attn_q.weight": ("F32", np.zeros((2, 8), dtype=np.uint8))}
    (file,) = write_gguf(tmp_path / "qwen35.gguf", tensors, arch="qwen35", metadata={"qwen35.block_count": 1})
    with pytest.raises(CheckpointError, match="qwen35.gguf: GGUF architecture 'qwen35', which transformers reads "
                                              "through its newer GGUF loader"):
        checkpoint_sizes(file)
