"""GGUF models run resident and streamed from the file itself: the blocks dequantized into the compute dtype give the
logits transformers' own GGUF load gives, and the default model's those of its float32 conversion, bit for bit; a
streamed pass reads each layer's quantized bytes."""
from __future__ import annotations

import pytest
import torch

from batchrun.checkpoint import checkpoint_sizes
from batchrun.runtime import LayerReads, ResidentModel, StreamedModel
from tests.gguf_files import TINY_ARCH_METADATA, write_tiny_gguf_model

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 19, 77, 200, 31]])  # past gemma3's window


def transformers_gguf_model(file) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


def transformers_gguf_logits(file, ids: torch.Tensor) -> torch.Tensor:
    return logits_of(transformers_gguf_model(file), ids)


def streamed_logits_and_pass_bytes(file, ids: torch.Tensor, prefetch: bool) -> tuple[torch.Tensor, int | None]:
    """Logits of a pass, and the layer bytes it read where nothing was read ahead for a next pass (no prefetch)."""
    with StreamedModel(file, device="cpu", dtype="float32", reads=LayerReads(prefetch=prefetch)) as streamed:
        logits = streamed(ids).logits
        return logits, None if prefetch else streamed.loader.bytes_read


@pytest.mark.parametrize("arch", sorted(TINY_ARCH_METADATA))
def test_tiny_gguf_models_give_transformers_own_gguf_logits(tmp_path, monkeypatch, arch):
    # tensors decoded a few rows (a q or k head) at a time, as a large model's are
    monkeypatch.setattr("batchrun.runtime.gguf_weights.DECODE_CHUNK_WEIGHTS", 2048)
    file = write_tiny_gguf_model(tmp_path / f"{arch}.gguf", arch)
    expected = transformers_gguf_logits(file, PROMPT)
    resident = ResidentModel(file, device="cpu", dtype="float32")
    assert torch.equal(resident(PROMPT).logits, expected)
    assert resident.bytes_read == checkpoint_sizes(file).checkpoint_bytes
    for prefetch in (True, False):
        logits, pass_bytes = streamed_logits_and_pass_bytes(file, PROMPT, prefetch)
        assert torch.equal(logits, expected), prefetch
        assert prefetch or pass_bytes == checkpoint_sizes(file).decoder_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied (embedding Q8_0, head Q4_0) and tied
def test_tiny_gguf_models_gather_and_stream_their_token_matrices_exactly(tmp_path, arch):
    file = write_tiny_gguf_model(tmp_path / f"{arch}.gguf", arch)
    expected = transformers_gguf_logits(file, PROMPT)
    sizes = checkpoint_sizes(file)
    for gather, stream in ((True, False), (False, True), (True, True)):
        reads = LayerReads(prefetch=False, gather_embeddings=gather, stream_head=stream)
        with StreamedModel(file, device="cpu", dtype="float32", reads=reads) as streamed:
            assert torch.equal(streamed(PROMPT).logits, expected), (gather, stream)
            assert (streamed.matrices.head is not None) == stream
            if stream:  # the head's quantized rows, read once in the pass
                assert streamed.matrices.bytes_read >= sizes.head_bytes


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_gguf_models_compute_in_bfloat16_as_transformers_does(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    file = write_tiny_gguf_model(tmp_path / f"{arch}.gguf", arch, seed=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        expected = model(PROMPT).logits
    assert torch.equal(ResidentModel(file, device="cpu", dtype="bfloat16")(PROMPT).logits, expected)
    with StreamedModel(file, device="cpu", dtype="bfloat16") as streamed:
        assert torch.equal(streamed(PROMPT).logits, expected)


@pytest.mark.parametrize("ggml_type, head_rows, norm_offset", [("Q4_K", 64, False), ("Q8_0", None, True),
                                                               ("Q6_K", None, False)])
def test_a_tensor_decoded_chunk_by_chunk_equals_it_decoded_whole(monkeypatch, ggml_type, head_rows, norm_offset):
    import numpy as np

    from batchrun.runtime import GGUFDecode
    from tests.gguf_files import pack_k_quant

    rng = np.random.default_rng(2)
    if ggml_type.endswith("_K"):
        blocks = pack_k_quant(ggml_type, 256, 512, rng)
    else:
        from gguf import GGMLQuantizationType, quants
        blocks = quants.quantize(rng.normal(size=(256, 512)).astype(np.float32), GGMLQuantizationType[ggml_type])
    raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(-1)
    decode = GGUFDecode(ggml_type, (256, 512), head_rows, norm_offset)
    whole = decode(raw)
    monkeypatch.setattr("batchrun.runtime.gguf_weights.DECODE_CHUNK_WEIGHTS", 3 * 512)  # 3 rows, or one head
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(256, 512, dtype=dtype)
        decode.into(raw, out)
        assert torch.equal(out, whole.to(dtype)), dtype


def test_a_streamed_gguf_model_generates_as_the_resident_one(tmp_path):
    file = write_tiny_gguf_model(tmp_path / "qwen2.gguf", "qwen2", seed=5)
    resident = ResidentModel(file, device="cpu", dtype="float32")
    with torch.inference_mode():
        expected = resident.model.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with StreamedModel(file, device="cpu", dtype="float32") as streamed:
        generated = streamed.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected)


def test_the_default_model_from_its_gguf_gives_its_float32_conversions_logits(default_gguf):
    file, converted = default_gguf
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
                         407, 19712, 8182, 2, 198, 1, 4093, 198]])
    with torch.inference_mode():
        expected = ResidentModel(converted, device="cpu", dtype="float32")(ids).logits
    resident = ResidentModel(file, device="cpu", dtype="float32")
    assert torch.equal(resident(ids).logits, expected)
    del resident
    sizes = checkpoint_sizes(file)
    for prefetch in (True, False):
        logits, pass_bytes = streamed_logits_and_pass_bytes(file, ids, prefetch)
        assert torch.equal(logits, expected), prefetch
    assert pass_bytes == sizes.decoder_bytes < checkpoint_sizes(converted).decoder_bytes / 5
    # the tied matrix streamed for both uses: embedding rows gathered, the head dequantized chunk by chunk
    reads = LayerReads(gather_embeddings=True, stream_head=True)
    with StreamedModel(file, device="cpu", dtype="float32", reads=reads) as streamed:
        assert streamed.matrices.head is not None and torch.equal(streamed(ids).logits, expected)


def test_gemma3s_q4_k_m_gguf_gives_transformers_own_gguf_logits(gemma3_gguf):
    """A trained Q4_K_M file: Q4_K, Q6_K, Q5_0 and Q8_0 tensors mixed, norms stored plus one, a sliding window."""
    ids = torch.tensor([[2, 818, 5279, 529, 7001, 563, 1144, 236761, 669, 1651, 529, 8760, 563]])
    reference = transformers_gguf_model(gemma3_gguf)  # loaded once: gguf-py dequantizes it in numpy, slowly
    expected = logits_of(reference, ids)
    assert torch.equal(ResidentModel(gemma3_gguf, device="cpu", dtype="float32")(ids).logits, expected)
    logits, pass_bytes = streamed_logits_and_pass_bytes(gemma3_gguf, ids, prefetch=False)
    assert torch.equal(logits, expected)
    assert pass_bytes == checkpoint_sizes(gemma3_gguf).decoder_bytes
    reads = LayerReads(gather_embeddings=True, stream_head=True)  # its 262,144-row tied matrix, never held
    # One thread for the head: with two, MKL on some CPUs (an AMX Xeon) sums the whole head's product in another
    # order than a chunk's of 13,107 rows, so the two differ in the last bits (1e-4 at logits of 80).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected_one_thread = logits_of(reference, ids)
        with StreamedModel(gemma3_gguf, device="cpu", dtype="float32", reads=reads) as streamed:
            logits = streamed(ids).logits
    finally:
        torch.set_num_threads(threads)
    assert streamed.matrices.head is not None and torch.equal(logits, expected_one_thread)
    assert torch.allclose(logits, expected, rtol=1e-5, atol=1e-4)
