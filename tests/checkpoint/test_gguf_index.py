"""The GGUF index: every tensor's type, rows-first shape and exact byte range, split files read as one, and the
types and files batchrun cannot read refused before any weight, naming the tensor or the file."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from batchrun.checkpoint import GGUF_BLOCKS, CheckpointError, GGUFTensorInfo, read_gguf_index
from tests.gguf_files import random_blocks, write_gguf


def model_tensors(rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """A few tensors of different types and shapes, as a Llama-style GGUF names them."""
    return {
        "token_embd.weight": ("Q8_0", random_blocks("Q8_0", 10, 2, rng)),  # [10, 64]
        "blk.0.attn_norm.weight": ("F32", rng.standard_normal(64, dtype=np.float32).view(np.uint8)),  # [64]
        "blk.0.attn_q.weight": ("Q4_K", random_blocks("Q4_K", 8, 1, rng)),  # [8, 256]
        "blk.0.attn_k.weight": ("Q6_K", random_blocks("Q6_K", 4, 1, rng)),  # [4, 256]
        "blk.0.ffn_down.weight": ("Q5_1", random_blocks("Q5_1", 3, 5, rng)),  # [3, 160]
        "blk.0.ffn_up.weight": ("BF16", random_blocks("BF16", 6, 7, rng)),  # [6, 7]
    }


def test_each_tensor_has_its_type_shape_and_byte_range(tmp_path):
    tensors = model_tensors(np.random.default_rng(1))
    (file,) = write_gguf(tmp_path / "model.gguf", tensors, metadata={"llama.attention.head_count": 2})
    index = read_gguf_index(file)

    assert list(index.tensors) == list(tensors) and index.files == (file,)
    assert index.architecture == "llama" and index.metadata["llama.attention.head_count"] == 2
    data = file.read_bytes()
    for name, (ggml_type, raw) in tensors.items():
        info = index.tensors[name]
        weights, block_bytes = GGUF_BLOCKS[ggml_type]
        assert isinstance(info, GGUFTensorInfo) and info.dtype == ggml_type and info.file == file
        rows = raw.reshape(-1, raw.shape[-1])  # a 1-D tensor is one row
        assert info.shape == (*raw.shape[:-1], raw.shape[-1] // block_bytes * weights)  # rows are output features
        assert info.nbytes == raw.nbytes and info.row_bytes == rows.shape[1] and info.rows == rows.shape[0]
        assert data[info.offset:info.offset + info.nbytes] == raw.tobytes()
        offset, length = info.row_span(1, info.rows)  # a tile of rows is one contiguous range
        assert data[offset:offset + length] == rows[1:].tobytes()


def test_a_row_span_outside_the_tensor_is_refused(tmp_path):
    (file,) = write_gguf(tmp_path / "model.gguf", model_tensors(np.random.default_rng(2)))
    info = read_gguf_index(file).tensors["blk.0.attn_q.weight"]
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has 8 rows; rows 2..9"):
        info.row_span(2, 9)


def test_a_split_model_is_one_index_whichever_part_is_named(tmp_path):
    tensors = model_tensors(np.random.default_rng(3))
    files = write_gguf(tmp_path / "model.gguf", tensors, tensors_per_file=2)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]

    for named in (files[0], files[2]):
        index = read_gguf_index(named)
        assert index.files == tuple(files) and list(index.tensors) == list(tensors)
    assert index.architecture == "llama"  # the metadata of the first part
    for position, name in enumerate(tensors):
        info = index.tensors[name]
        assert info.file == files[position // 2]
        with open(info.file, "rb") as handle:
            handle.seek(info.offset)
            assert handle.read(info.nbytes) == tensors[name][1].tobytes()

    files[1].unlink()
    with pytest.raises(CheckpointError, match="split in 3 files, but model-00002-of-00003.gguf is missing"):
        read_gguf_index(files[0])


def test_an_unsupported_type_is_refused_naming_the_tensor_and_its_type(tmp_path):
    tensors = model_tensors(np.random.default_rng(4))
    tensors["blk.0.attn_v.weight"] = ("Q2_K", np.zeros((2, 84), dtype=np.uint8))  # two rows of one Q2_K block
    (file,) = write_gguf(tmp_path / "model.gguf", tensors)
    with pytest.raises(CheckpointError, match=r"model.gguf: tensor 'blk.0.attn_v.weight' is of ggml type Q2_K, "
                                              r"which batchrun cannot dequantize \(it reads F32, F16, BF16, Q8_0"):
        read_gguf_index(file)


def test_a_big_endian_file_is_refused(tmp_path):
    (file,) = write_gguf(tmp_path / "model.gguf", model_tensors(np.random.default_rng(5)), big_endian=True)
    with pytest.raises(CheckpointError, match="model.gguf: a big-endian GGUF file; batchrun reads little-endian"):
        read_gguf_index(file)


def test_a_truncated_or_foreign_file_is_refused_naming_it(tmp_path):
    (file,) = write_gguf(tmp_path / "model.gguf", model_tensors(np.random.default_rng(6)))
    data = file.read_bytes()
    file.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.gguf: not a readable GGUF file, or truncated"):
        read_gguf_index(file)
    file.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(CheckpointError, match="model.gguf: not a readable GGUF file"):
        read_gguf_index(file)
    with pytest.raises(CheckpointError, match="absent.gguf: no such GGUF file"):
        read_gguf_index(tmp_path / "absent.gguf")


def test_permuted_heads_are_named_for_llama_q_and_k_only(tmp_path):
    tensors = model_tensors(np.random.default_rng(7))
    metadata = {"llama.attention.head_count": 2, "llama.attention.head_count_kv": 1}
    (file,) = write_gguf(tmp_path / "llama.gguf", tensors, metadata=metadata)
    index = read_gguf_index(file)
    assert index.permuted_head_rows("blk.0.attn_q.weight") == 4  # 8 rows, 2 heads
    assert index.permuted_head_rows("blk.0.attn_k.weight") == 4  # 4 rows, 1 key/value head
    assert index.permuted_head_rows("blk.0.ffn_down.weight") is None

    (other,) = write_gguf(tmp_path / "qwen2.gguf", tensors, arch="qwen2", metadata={"qwen2.attention.head_count": 2})
    assert read_gguf_index(other).permuted_head_rows("blk.0.attn_q.weight") is None

    (odd,) = write_gguf(tmp_path / "odd.gguf", tensors, metadata={"llama.attention.head_count": 3})
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_q.weight' has 8 rows, which cannot be split into 3 heads"):
        read_gguf_index(odd).permuted_head_rows("blk.0.attn_q.weight")


def test_the_block_table_is_gguf_pys():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]] for name in GGUF_BLOCKS} == GGUF_BLOCKS


def test_the_index_imports_no_torch(tmp_path):
    (file,) = write_gguf(tmp_path / "model.gguf", model_tensors(np.random.default_rng(8)))
    script = (f"import sys; from batchrun.checkpoint import read_gguf_index; read_gguf_index({str(file)!r}); "
              "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_parts_of_different_splits_are_refused(tmp_path):
    tensors = model_tensors(np.random.default_rng(9))
    files = write_gguf(tmp_path / "model.gguf", tensors, tensors_per_file=2)
    stranger = {"blk.0.attn_output.weight": ("Q8_0", random_blocks("Q8_0", 2, 1, np.random.default_rng(10)))}
    write_gguf(files[1], stranger)  # one tensor where the split had two
    with pytest.raises(CheckpointError, match="model-00001-of-00003.gguf: the split declares 6 tensors, its 3 parts "
                                              "hold 5"):
        read_gguf_index(files[0])
    write_gguf(files[1], {"token_embd.weight": tensors["token_embd.weight"]})
    with pytest.raises(CheckpointError, match="model-00002-of-00003.gguf: tensor 'token_embd.weight' is also in "
                                              "model-00001-of-00003.gguf"):
        read_gguf_index(files[0])


def test_a_type_number_gguf_py_does_not_know_is_refused_naming_the_file(tmp_path):
    tensors = {"blk.0.attn_v.weight": ("Q8_0", random_blocks("Q8_0", 2, 1, np.random.default_rng(11)))}
    (file,) = write_gguf(tmp_path / "model.gguf", tensors)
    data = bytearray(file.read_bytes())
    # Tensor info: name, uint32 dims count, uint64 per dim, then the uint32 type number.
    type_at = data.index(b"blk.0.attn_v.weight") + len("blk.0.attn_v.weight") + 4 + 2 * 8
    assert data[type_at:type_at + 4] == (8).to_bytes(4, "little")  # Q8_0's number, so the position is right
    data[type_at:type_at + 4] = (200).to_bytes(4, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.gguf: holds a tensor of ggml type number 200, which gguf-py "
                                              "does not know; batchrun reads F32, F16"):
        read_gguf_index(file)
