"""Reading checkpoints without loading weights: headers, index, config, decoder stack, sizes, and refusals."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from batchrun.checkpoint import (CheckpointError, checkpoint_sizes, load_config, read_tensor_infos, resolve_checkpoint,
                                 tensor_index)
from batchrun.checkpoint.files import decoder_layer_prefix
from batchrun.checkpoint.sizes import sizes_from_config
from tests.support import CONFIGS

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
TINY_CONFIG = {
    "model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2, "vocab_size": 64,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
}


def write_safetensors(file: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors file of zeros: header declaring each tensor's dtype/shape/offsets, then the data."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        nbytes = int(np.prod(shape)) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_tensors(config: dict, dtype: str = "BF16", tied: bool = False) -> dict:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    tensors = {"model.embed_tokens.weight": (dtype, (vocab, hidden)), "model.norm.weight": (dtype, (hidden,))}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": (dtype, (q_width, hidden)),
            p + "self_attn.k_proj.weight": (dtype, (kv_width, hidden)),
            p + "self_attn.v_proj.weight": (dtype, (kv_width, hidden)),
            p + "self_attn.o_proj.weight": (dtype, (hidden, q_width)),
            p + "mlp.gate_proj.weight": (dtype, (inter, hidden)),
            p + "mlp.up_proj.weight": (dtype, (inter, hidden)),
            p + "mlp.down_proj.weight": (dtype, (hidden, inter)),
            p + "input_layernorm.weight": (dtype, (hidden,)),
            p + "post_attention_layernorm.weight": (dtype, (hidden,)),
        }
    if not tied:
        tensors["lm_head.weight"] = (dtype, (vocab, hidden))
    return tensors


def make_checkpoint(directory: Path, config: dict | None = None, tensors: dict | None = None,
                    shards: int = 1) -> Path:
    config = dict(TINY_CONFIG if config is None else config)
    tensors = llama_tensors(config) if tensors is None else tensors
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        write_safetensors(directory / "model.safetensors", tensors)
        return directory
    names = list(tensors)
    weight_map = {}
    for shard in range(shards):
        shard_name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        write_safetensors(directory / shard_name, part)
        weight_map |= {name: shard_name for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


# --- headers and index ------------------------------------------------------------------------------------------


def test_offsets_are_absolute_so_a_reader_finds_each_tensor_bytes(tmp_path):
    from safetensors.numpy import save_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.float16)}
    directory = tmp_path / "ckpt"
    directory.mkdir()
    save_file(arrays, directory / "model.safetensors")
    (directory / "config.json").write_text("{}")
    infos = read_tensor_infos(directory)
    raw = (directory / "model.safetensors").read_bytes()
    for name, array in arrays.items():
        info = infos[name]
        assert info.shape == array.shape and info.nbytes == array.nbytes
        assert raw[info.offset:info.offset + info.nbytes] == array.tobytes()
    assert infos["a"].dtype == "F32" and infos["b"].dtype == "F16"


def test_sharded_index_maps_every_tensor_to_its_shard(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", shards=3)
    index = tensor_index(directory)
    infos = read_tensor_infos(directory)
    assert set(index) == set(infos) == set(llama_tensors(TINY_CONFIG))
    assert all(infos[name].file.name == shard for name, shard in index.items())
    assert len(set(index.values())) == 3


# --- refusals: each names the file ------------------------------------------------------------------------------


def test_truncated_shard_is_refused_naming_the_file(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", shards=2)
    shard = directory / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated") as error:
        read_tensor_infos(directory)
    assert str(shard) in str(error.value)


def test_header_offsets_past_end_of_file_are_refused(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    file = directory / "model.safetensors"
    header = {"x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(40))  # 4000 bytes declared, 40 present
    with pytest.raises(CheckpointError, match="'x' at bytes") as error:
        read_tensor_infos(directory)
    assert str(file) in str(error.value)


@pytest.mark.parametrize("payload, problem", [
    (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
    (struct.pack("<Q", 5) + b"{oops", "malformed safetensors header"),
    (struct.pack("<Q", 2) + b"[]", "malformed safetensors header"),
    (b"abc", "too short"),
])
def test_damaged_headers_are_refused_naming_the_file(tmp_path, payload, problem):
    directory = make_checkpoint(tmp_path / "ckpt")
    (directory / "model.safetensors").write_bytes(payload)
    with pytest.raises(CheckpointError, match=problem) as error:
        read_tensor_infos(directory)
    assert "model.safetensors" in str(error.value)


def test_unknown_dtype_and_wrong_byte_span_are_refused(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    file = directory / "model.safetensors"
    for entry, problem in [({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, "unknown dtype 'Q4'"),
                           ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8")]:
        raw = json.dumps({"w": entry}).encode()
        file.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
        with pytest.raises(CheckpointError, match=problem):
            read_tensor_infos(directory)


def test_shard_named_in_index_but_absent_is_refused_by_name(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", shards=2)
    (directory / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors: missing"):
        read_tensor_infos(directory)


def test_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", shards=2)
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        read_tensor_infos(directory)


def test_missing_config_is_refused_naming_config_json(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        read_tensor_infos(directory)
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_config(directory)


def test_pickle_only_checkpoint_is_refused_by_name(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(TINY_CONFIG))
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x02not really")
    with pytest.raises(CheckpointError) as error:
        read_tensor_infos(directory)
    message = str(error.value)
    assert "pytorch_model.bin" in message and "pickle has no tensor index" in message
    assert "requires safetensors" in message and "convert" in message


def test_several_unindexed_safetensors_files_are_refused_by_name(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    (directory / "model.safetensors").rename(directory / "a.safetensors")
    write_safetensors(directory / "b.safetensors", {"x": ("F32", (1,))})
    with pytest.raises(CheckpointError, match=r"a\.safetensors, b\.safetensors"):
        tensor_index(directory)


def test_shape_disagreeing_with_config_is_refused_naming_tensor_and_file(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    config = dict(TINY_CONFIG, vocab_size=65)  # the weights have 64 rows
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as error:
        checkpoint_sizes(directory)
    message = str(error.value)
    assert "model.embed_tokens.weight" in message and "model.safetensors" in message
    assert "vocab_size=65" in message


def test_remote_code_is_refused_unless_trusted(tmp_path):
    config = dict(TINY_CONFIG, model_type="acme_secret_arch", auto_map={"AutoConfig": "acme.AcmeConfig"})
    directory = make_checkpoint(tmp_path / "ckpt", config=config)
    with pytest.raises(CheckpointError, match="auto_map") as error:
        load_config(directory)
    assert "config.json" in str(error.value) and "trust_remote_code" in str(error.value)
    assert load_config(directory, trust_remote_code=True)["model_type"] == "acme_secret_arch"


def test_auto_map_for_an_architecture_transformers_ships_needs_no_trust(tmp_path):
    # Phi-3's published config carries auto_map, but transformers runs its own Phi3 code.
    config = dict(TINY_CONFIG, model_type="phi3", auto_map={"AutoConfig": "configuration_phi3.Phi3Config"})
    directory = make_checkpoint(tmp_path / "ckpt", config=config)
    assert load_config(directory)["model_type"] == "phi3"


# --- decoder stack ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"])
def test_decoder_stack_is_found_from_names_alone(prefix):
    names = ["embed.weight", "lm_head.weight"] + [f"{prefix}.{i}.mlp.w.weight" for i in range(3)]
    assert decoder_layer_prefix(names, 3) == prefix


def test_experts_numbered_like_layers_are_not_mistaken_for_the_stack():
    names = [f"model.layers.{i}.mlp.experts.{e}.w1.weight" for i in range(4) for e in range(4)]
    assert decoder_layer_prefix(names, 4) == "model.layers"


def test_no_or_ambiguous_stack_is_an_error_listing_what_was_found():
    with pytest.raises(CheckpointError, match=r"model\.layers \(3\)"):
        decoder_layer_prefix([f"model.layers.{i}.w" for i in range(3)], 4)
    names = [f"text.layers.{i}.w" for i in range(2)] + [f"vision.layers.{i}.w" for i in range(2)]
    with pytest.raises(CheckpointError, match="ambiguous"):
        decoder_layer_prefix(names, 2)


# --- sizes ------------------------------------------------------------------------------------------------------


def test_sizes_from_headers_count_every_layer_and_what_lies_outside(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt", shards=2)
    sizes = checkpoint_sizes(directory)
    hidden, inter, vocab = 16, 32, 64
    layer_params = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * hidden * inter + 2 * hidden
    assert sizes.source == "headers" and not sizes.estimated
    assert sizes.decoder_prefix == "model.layers" and sizes.storage_dtype == "BF16"
    assert sizes.layer_params == [layer_params, layer_params]
    assert sizes.layer_bytes == [2 * layer_params] * 2
    assert sizes.non_decoder_params == 2 * vocab * hidden + hidden
    assert sizes.checkpoint_bytes == 2 * (2 * layer_params + 2 * vocab * hidden + hidden)
    assert (sizes.num_kv_heads, sizes.head_dim, sizes.vocab_size) == (2, 4, 64)
    assert not sizes.tied_embeddings
    report = json.loads(json.dumps(sizes.to_json()))
    assert report["checkpoint_bytes"] == sizes.checkpoint_bytes and report["path"] == str(directory)


def test_headers_and_config_estimate_agree_on_a_llama_shaped_checkpoint(tmp_path):
    sizes = checkpoint_sizes(make_checkpoint(tmp_path / "ckpt"))
    estimate = sizes_from_config(TINY_CONFIG, "BF16")
    assert estimate.estimated and estimate.source == "estimate"
    assert (estimate.layer_bytes, estimate.non_decoder_bytes) == (sizes.layer_bytes, sizes.non_decoder_bytes)


def test_tied_embeddings_are_detected_from_the_headers(tmp_path):
    config = dict(TINY_CONFIG)
    del config["tie_word_embeddings"]
    directory = make_checkpoint(tmp_path / "ckpt", config=config, tensors=llama_tensors(config, tied=True))
    sizes = checkpoint_sizes(directory)
    assert sizes.tied_embeddings and sizes.non_decoder_params == 64 * 16 + 16


def test_storage_dtype_is_the_dtype_holding_most_bytes(tmp_path):
    tensors = {name: ("F32" if name.endswith("norm.weight") else "BF16", shape)
               for name, (_, shape) in llama_tensors(TINY_CONFIG).items()}
    sizes = checkpoint_sizes(make_checkpoint(tmp_path / "ckpt", tensors=tensors))
    assert sizes.storage_dtype == "BF16"


def test_multimodal_config_is_sized_from_its_text_config(tmp_path):
    config = {"model_type": "gemma3", "text_config": dict(TINY_CONFIG, model_type="gemma3_text"),
              "vision_config": {"hidden_size": 8, "num_hidden_layers": 2}}
    sizes = checkpoint_sizes(make_checkpoint(tmp_path / "ckpt", config=config,
                                             tensors=llama_tensors(TINY_CONFIG)))
    assert sizes.model_type == "gemma3_text" and sizes.num_layers == 2 and sizes.hidden_size == 16


# --- published configs: sizes and attention windows ---------------------------------------------------------------


def published(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def test_estimates_match_published_parameter_counts():
    llama = sizes_from_config(published("llama-3-70b.json"), "bfloat16")
    assert llama.total_params == 70_553_706_496  # Meta-Llama-3-70B
    assert llama.layer_bytes[0] == 1_711_308_800 and llama.num_layers == 80
    # Qwen2 always has q/k/v biases; its config does not say so, and they are 0.002% of the weights.
    qwen = sizes_from_config(published("qwen2.5-7b.json") | {"attention_bias": True}, "bfloat16")
    assert qwen.total_params == 7_615_616_512  # Qwen2.5-7B
    assert sizes_from_config(published("qwen2.5-7b.json")).total_params == 7_615_616_512 - 28 * (3584 + 2 * 512)


def test_qwen_with_sliding_window_switched_off_attends_fully():
    sizes = sizes_from_config(published("qwen2.5-7b.json"))
    assert sizes.sliding_windows == [None] * 28 and sizes.num_kv_heads == 4


def test_gemma_pattern_marks_every_sixth_layer_full_attention():
    sizes = sizes_from_config(published("gemma-3-1b.json"))
    assert [i for i, w in enumerate(sizes.sliding_windows) if w is None] == [5, 11, 17, 23]
    assert set(sizes.sliding_windows) == {512, None}


def test_layer_types_override_any_pattern():
    config = published("gemma-3-1b.json") | {
        "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert sizes_from_config(config).sliding_windows == [512, None, 512, None]


def test_window_without_layer_information_is_planned_as_full_attention_sharing_only_inside_the_window():
    from transformers import Gemma2Config, MistralConfig
    from transformers.cache_utils import DynamicCache

    from batchrun.checkpoint import kv_bytes_for_sequence

    config = dict(TINY_CONFIG, sliding_window=4)  # Mistral-7B-v0.1 and gemma-2 configs say no more than this
    sizes = sizes_from_config(config)
    assert sizes.unplaced_window == 4 and sizes.sliding_windows == [None, None]
    assert any("sliding_window=4" in note and "only by rows that fit the window" in note for note in sizes.assumptions)
    # What the runtime builds from such configs differs by model class: every layer slides (Mistral), or every other
    # one (Gemma 2). Sized as full attention, the plan's KV is never below either's.
    assert DynamicCache(config=MistralConfig(num_hidden_layers=2, sliding_window=4)).is_sliding == [True, True]
    assert DynamicCache(config=Gemma2Config(num_hidden_layers=2, sliding_window=4)).is_sliding == [True, False]
    per_token = kv_bytes_for_sequence(sizes, 4, 1)
    assert kv_bytes_for_sequence(sizes, 4, 100) == 100 * per_token  # full: 2 layers x 100 positions
    assert kv_bytes_for_sequence(sizes, 4, 100) > (4 + 100) * per_token // 2  # the Gemma 2 reading: 4 + 100


def test_silent_tie_setting_is_estimated_untied_and_noted():
    sizes = sizes_from_config(published("gemma-3-1b.json"))
    assert not sizes.tied_embeddings
    assert any("tie_word_embeddings not stated" in note for note in sizes.assumptions)


def test_sparse_hub_config_is_sized_conservatively_with_its_assumptions_listed():
    config = {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
              "num_hidden_layers": 34, "vocab_size": 262208}  # gemma-3-4b's text_config lists little more
    sizes = sizes_from_config(config)
    assert sizes.num_attention_heads == 20 and sizes.num_kv_heads == 20 and sizes.head_dim == 128
    assert any("num_attention_heads missing" in note for note in sizes.assumptions)


def test_query_heads_that_key_value_heads_cannot_group_are_refused():
    """transformers builds such a model and fails only in its first attention call, mid-job."""
    config = {"hidden_size": 1216, "num_attention_heads": 19, "num_key_value_heads": 2, "intermediate_size": 4096,
              "num_hidden_layers": 2, "vocab_size": 100}
    with pytest.raises(CheckpointError, match="num_attention_heads=19 is not a multiple of the 2 key/value heads"):
        sizes_from_config(config)
    assert sizes_from_config(config | {"num_attention_heads": 16, "num_key_value_heads": 4}).num_kv_heads == 4


def test_config_without_layer_count_is_refused():
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        sizes_from_config({"hidden_size": 8, "vocab_size": 10})


# --- resolving a model argument ----------------------------------------------------------------------------------


def test_local_directory_resolves_to_itself(tmp_path):
    directory = make_checkpoint(tmp_path / "ckpt")
    assert resolve_checkpoint(directory) == directory
    assert resolve_checkpoint(str(directory)) == directory


@pytest.mark.parametrize("argument", ["./missing-model", "/nowhere/model", "~/no-such-model-here"])
def test_missing_path_is_reported_as_a_path_not_looked_up_on_the_hub(argument):
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as error:
        resolve_checkpoint(argument)
    assert argument.lstrip("./~") in str(error.value)


def test_relative_path_under_an_existing_directory_is_a_path(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="models/llama: no such checkpoint directory"):
        resolve_checkpoint("models/llama")


def fake_hub_cache(cache: Path, repo: str) -> Path:
    """The layout huggingface_hub keeps: refs/main names a commit whose snapshot holds the files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


def test_cached_hub_repository_resolves_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/tiny")
    make_checkpoint(snapshot)
    assert resolve_checkpoint("acme/tiny", cache_dir=tmp_path / "hub") == snapshot


def test_unknown_repository_error_names_it_and_never_the_token(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    snapshot = fake_hub_cache(tmp_path / "hub", "acme/partial")
    (snapshot / "config.json").write_text("{}")  # metadata cached, weights never downloaded
    for repo in ("acme/never-seen", "acme/partial"):
        with pytest.raises(CheckpointError) as error:
            resolve_checkpoint(repo, hf_token="hf_SECRET_token_123", cache_dir=tmp_path / "hub")
        message = str(error.value)
        assert f"repository {repo} not found / not cached" in message
        assert "hf_SECRET_token_123" not in message


def test_hub_metadata_download_brings_remote_code_and_tokenizer_files_but_no_weights():
    """With --trust-remote-code a Hub model needs its configuration_*.py and modeling_*.py; tiktoken tokenizers
    ship their vocabulary as *.tiktoken. Shards come in a second step, only those the index names."""
    from huggingface_hub.utils import filter_repo_objects

    from batchrun.checkpoint.resolve import HUB_METADATA_PATTERNS

    files = ["config.json", "configuration_acme.py", "modeling_acme.py", "tokenizer.json", "qwen.tiktoken",
             "tokenizer.model", "chat_template.jinja", "model.safetensors.index.json",
             "model-00001-of-00002.safetensors", "consolidated.safetensors", "README.md"]
    kept = set(filter_repo_objects(files, allow_patterns=HUB_METADATA_PATTERNS))
    assert kept == set(files) - {"model-00001-of-00002.safetensors", "consolidated.safetensors", "README.md"}
