"""A resident model holds its weights in process memory, copied out of the checkpoint's file mappings only where
transformers left them there."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from batchrun.checkpoint import read_tensor_infos
from batchrun.runtime import ResidentModel
from batchrun.runtime.resident import copy_out_of_file_mappings, file_mapped_ranges, lies_in


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


def mapping_resident_bytes(files) -> int:
    """Resident bytes of this process's mappings of `files` (/proc/self/smaps)."""
    wanted = {str(Path(file).resolve()) for file in files}
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and fields[1][:1] in "r-":  # a mapping's header line
            inside = len(fields) == 6 and fields[5] in wanted
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("chunk_bytes", [None, 64 << 10])  # the default, and many chunks a tensor
def test_copying_weights_out_of_the_file_mapping_leaves_its_pages_unmapped(tmp_path, monkeypatch, chunk_bytes):
    """Otherwise every page the copies read stays resident beside them until the last tensor is copied: a resident
    load peaked at twice the weights."""
    from batchrun.runtime import resident as runtime
    from tests.tiny_models import build_large_llama

    if chunk_bytes:
        monkeypatch.setattr(runtime, "COPY_CHUNK_BYTES", chunk_bytes)

    path = build_large_llama(tmp_path, 24_000_000, dtype="float32", num_layers=2, vocab_size=2000)
    files = weight_files(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if mapped_tensors(model, files) == 0:
        pytest.skip("this transformers release copies weights at load: nothing is left mapped to test")
    originals = [tensor.data for tensor in model.parameters()]  # keeps the mapping open, as a load in progress does
    size = sum(Path(file).stat().st_size for file in files)
    copy_out_of_file_mappings(model, files)
    assert mapped_tensors(model, files) == 0
    assert mapping_resident_bytes(files) < size / 10
    assert all(torch.equal(copy, original) for copy, original in zip(model.parameters(), originals))
