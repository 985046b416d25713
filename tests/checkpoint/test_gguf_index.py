"""The GGUF index: every tensor's type, rows-first shape and exact byte range, split files read as one, and the
types and files batchrun cannot read refused before any weight, naming the tensor or the file."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from batchrun.checkpoint import GGUF_BLOCKS, CheckpointError, GGUFIndex, GGUFTensorInfo, read_gguf_index
from batchrun.checkpoint.gguf_index import GGML_TYPES
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


def test_the_block_and_type_tables_are_gguf_pys():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {name: GGML_QUANT_SIZES[GGMLQuantizationType[name]] for name in GGUF_BLOCKS} == GGUF_BLOCKS
    assert GGML_TYPES == {int(member): member.name for member in GGMLQuantizationType}


def test_the_index_imports_no_torch_numpy_or_gguf_py(tmp_path):
    (file,) = write_gguf(tmp_path / "model.gguf", model_tensors(np.random.default_rng(8)))
    script = (f"import sys; from batchrun.checkpoint import read_gguf_index; read_gguf_index({str(file)!r}); "
              "print([name for name in ('torch', 'numpy', 'gguf') if name in sys.modules])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


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


def test_rows_of_part_of_a_block_are_refused_naming_the_tensor(tmp_path):
    tensors = {"blk.0.attn_v.weight": ("Q8_0", random_blocks("Q8_0", 2, 2, np.random.default_rng(12)))}
    (file,) = write_gguf(tmp_path / "model.gguf", tensors)
    data = bytearray(file.read_bytes())
    row_at = data.index(b"blk.0.attn_v.weight") + len("blk.0.attn_v.weight") + 4  # the first dimension: the row
    assert data[row_at:row_at + 8] == (64).to_bytes(8, "little")
    data[row_at:row_at + 8] = (48).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.gguf: tensor 'blk.0.attn_v.weight' of ggml type Q8_0 has rows "
                                              "of 48 weights, not whole blocks of 32"):
        read_gguf_index(file)


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
                                              r"does not know; batchrun reads F32, F16.*\(tensor 'blk.0.attn_v.weight'\)"):
        read_gguf_index(file)


def reference_index(file) -> GGUFIndex:
    """The index as gguf-py's own reader sees `file`: its scalar and string fields, its tensors rows first."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(file)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if len(field.types) == 1 and field.types[0] != GGUFValueType.ARRAY}
    tensors = {tensor.name: GGUFTensorInfo(tensor.name, file, tensor.tensor_type.name,
                                           tuple(int(d) for d in reversed(tensor.shape)), int(tensor.data_offset),
                                           int(tensor.n_bytes)) for tensor in reader.tensors}
    return GGUFIndex((file,), metadata, tensors)


def assert_same_index(file) -> None:
    index, reference = read_gguf_index(file), reference_index(file)
    assert index == reference
    assert list(index.metadata) == list(reference.metadata) and list(index.tensors) == list(reference.tensors)
    assert all(type(index.metadata[key]) is type(value) for key, value in reference.metadata.items())


def test_the_default_models_index_is_gguf_pys(default_gguf):
    assert_same_index(default_gguf[0])


@pytest.mark.slow  # gguf-py's reader takes seconds over Gemma's vocabulary
def test_gemma3s_index_is_gguf_pys(gemma3_gguf):
    assert_same_index(gemma3_gguf)


def write_every_kind_of_metadata(path, alignment: int) -> None:
    """A GGUF whose metadata holds a scalar and an array of every value type, nested arrays of strings and of
    numbers, and strings of odd lengths, so the tensor infos and data start off any natural boundary."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    rng = np.random.default_rng(alignment)
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    numbers = {GGUFValueType.UINT8: 200, GGUFValueType.INT8: -7, GGUFValueType.UINT16: 60000,
               GGUFValueType.INT16: -300, GGUFValueType.UINT32: 4_000_000_000, GGUFValueType.INT32: -5,
               GGUFValueType.FLOAT32: 0.1, GGUFValueType.BOOL: True, GGUFValueType.UINT64: 2**63 + 5,
               GGUFValueType.INT64: -(2**40), GGUFValueType.FLOAT64: 1e-300}
    for value_type, value in numbers.items():
        writer.add_key_value(f"test.{value_type.name.lower()}", value, value_type)
        writer.add_key_value(f"test.{value_type.name.lower()}s", [value] * (value_type + 3), GGUFValueType.ARRAY,
                             sub_type=value_type)
    writer.add_string("test.string", "ünïcode, and an odd length")
    writer.add_key_value("test.empty", "", GGUFValueType.STRING)  # add_string drops an empty string
    writer.add_array("test.strings", ["", "a", "ñ" * 300, "tokens\x00with nul"])
    writer.add_array("test.nested_strings", [["a", "bc"], ["", "d" * 1000, "e"], ["f"]])
    writer.add_array("test.nested_numbers", [[1, 2, 3], [4], [[5.5, 6.5], [7.5]]])
    writer.add_bool("test.after_the_arrays", False)  # a value read after every skip lands where it should
    writer.add_tensor("blk.0.attn_q.weight", random_blocks("Q8_0", 3, 2, rng), raw_shape=None,
                      raw_dtype=GGMLQuantizationType["Q8_0"])
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(5, dtype=np.float32).view(np.uint8),
                      raw_shape=None, raw_dtype=GGMLQuantizationType["F32"])
    writer.add_tensor("blk.0.ffn_up.weight", random_blocks("Q4_K", 2, 1, rng), raw_shape=None,
                      raw_dtype=GGMLQuantizationType["Q4_K"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [1, 8, 32, 64, 4096])
def test_every_value_type_and_alignment_reads_as_gguf_py_reads_it(tmp_path, alignment):
    file = tmp_path / "model.gguf"
    write_every_kind_of_metadata(file, alignment)
    assert_same_index(file)
    index = read_gguf_index(file)
    assert index.metadata["test.uint64"] == 2**63 + 5 and index.metadata["test.float64"] == 1e-300
    assert index.metadata["test.string"] == "ünïcode, and an odd length" and index.metadata["test.empty"] == ""
    assert index.metadata["test.after_the_arrays"] is False and index.metadata["general.alignment"] == alignment
    assert "test.strings" not in index.metadata and "test.nested_strings" not in index.metadata
    assert all(info.offset % alignment == 0 for info in index.tensors.values())


def cut_points(data: bytes, last: GGUFTensorInfo) -> dict[str, int]:
    """Where to cut the file write_every_kind_of_metadata wrote: inside each part of it, in file order."""
    infos_end = data.index(b"blk.0.ffn_up.weight") + len("blk.0.ffn_up.weight") + 4 + 2 * 8 + 4 + 8
    return {
        "empty": 0, "in the magic": 2, "in the counts": 12,
        "in a key": data.index(b"test.uint8") + 3,
        "in a number array": data.index(b"test.float64s") + len("test.float64s") + 4 + 4 + 8 + 1,
        "in a string array": data.index("ñ".encode() * 300) + 100,
        "in a nested string array": data.index(b"d" * 1000) + 10,
        "in the tensor infos": data.index(b"blk.0.ffn_up.weight") + 5,
        "at the end of the tensor infos": infos_end,
        "in the last tensor": last.offset + last.nbytes - 1,
    }


@pytest.mark.parametrize("where", ["empty", "in the magic", "in the counts", "in a key", "in a number array",
                                   "in a string array", "in a nested string array", "in the tensor infos",
                                   "at the end of the tensor infos", "in the last tensor"])
def test_a_file_cut_anywhere_is_refused_naming_it(tmp_path, where):
    whole = tmp_path / "whole.gguf"
    write_every_kind_of_metadata(whole, 64)
    data = whole.read_bytes()
    cuts = cut_points(data, list(reference_index(whole).tensors.values())[-1])
    assert list(cuts.values()) == sorted(cuts.values())  # each cut is where its name says, past the one before
    file = tmp_path / "model.gguf"
    file.write_bytes(data[:cuts[where]])
    with pytest.raises(CheckpointError, match="model.gguf: not a readable GGUF file, or truncated"):
        read_gguf_index(file)


def test_a_bad_alignment_or_value_type_is_refused_naming_the_file(tmp_path):
    whole = tmp_path / "whole.gguf"
    write_every_kind_of_metadata(whole, 64)
    data = bytearray(whole.read_bytes())
    file = tmp_path / "model.gguf"
    alignment_at = data.index(b"general.alignment") + len("general.alignment")
    assert data[alignment_at:alignment_at + 8] == bytes([4, 0, 0, 0, 64, 0, 0, 0])  # uint32 64
    file.write_bytes(data[:alignment_at + 4] + (48).to_bytes(4, "little") + data[alignment_at + 8:])
    with pytest.raises(CheckpointError, match="model.gguf: not a readable GGUF.*general.alignment is 48, not a power"):
        read_gguf_index(file)
    file.write_bytes(data[:alignment_at] + (13).to_bytes(4, "little") + data[alignment_at + 4:])
    with pytest.raises(CheckpointError, match="model.gguf: not a readable GGUF.*'general.alignment' has value type "
                                              "number 13"):
        read_gguf_index(file)
