"""A resident model holds its weights in process memory, copied out of the checkpoint's file mappings only where
transformers left them there."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.checkpoint import read_tensor_infos
from batchrun.runtime import ResidentModel, copy_out_of_file_mappings, file_mapped_ranges, lies_in


def weight_files(path) -> set:
    return {info.file for info in read_tensor_infos(path).values()}


def mapped_tensors(model: torch.nn.Module, files) -> int:
    ranges = file_mapped_ranges(files)
    assert ranges is not None, "/proc/self/maps unreadable: these tests need Linux"
    return sum(lies_in(tensor, ranges) for tensor in list(model.parameters()) + list(model.buffers()))


def test_a_resident_model_holds_no_weight_in_a_file_mapping(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # float32 on disk, so transformers can map the weights straight from the file
    files = weight_files(path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if mapped_tensors(plain, files) == 0:
        pytest.skip("this transformers release copies weights at load: nothing is left mapped to test")
    resident = ResidentModel(path, device="cpu", dtype=torch.float32)
    try:
        assert mapped_tensors(resident.model, files) == 0
        ids = torch.tensor([[5, 9, 13, 21, 34]])
        with torch.inference_mode():
            assert torch.equal(resident(ids).logits, plain(ids).logits)
    finally:
        resident.close()


def test_weights_converted_at_load_are_not_copied_again(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # float32 on disk: converted
    pointers = [tensor.data_ptr() for tensor in converted.parameters()]
    assert copy_out_of_file_mappings(converted, weight_files(path)) == 0
    assert [tensor.data_ptr() for tensor in converted.parameters()] == pointers
