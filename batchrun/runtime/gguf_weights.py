"""A GGUF file's tensors as the transformers model's parameters: which GGUF tensor feeds which parameter (transformers'
own name map), and how its blocks become the parameter's values (dequantized, the q/k rows put back in the
checkpoint's order, the norms' stored offset taken off), exactly as transformers' GGUF load computes them.

The blocks are read as they lie in the file and decoded where a weight is needed: a layer's recipes carry a
`decode` (GGUFDecode) that the loader runs on the bytes it read (weights.realize).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batchrun.checkpoint import (NORM_OFFSET_ARCHITECTURES, CheckpointError, GGUFIndex, gguf_parsed_once,
                                 is_gguf_file, load_config, read_gguf_index)
from batchrun.runtime.dequantize_tally import timed_decode
from batchrun.runtime.gguf_blocks import dequantize, dequantize_into, read_gguf_blocks, undo_qk_permutation
from batchrun.runtime.skeleton import materialise_buffers, set_tensor
from batchrun.runtime.weights import Recipe


# Weights a tensor is decoded by at a time into its destination: the float32 values and the decoders' intermediates
# of one chunk are all a load holds beside the weights, however large the tensor (a vocabulary's embedding). Larger
# chunks decode slower: their intermediates are fresh memory the kernel maps each time (docs/streaming.md#gguf).
DECODE_CHUNK_WEIGHTS = 1 << 20


@dataclass(frozen=True)
class GGUFDecode:
    """One GGUF tensor's blocks -> its float32 values in the model's layout."""
    ggml_type: str
    shape: tuple[int, ...]
    head_rows: int | None = None  # rows of one q or k head stored in llama.cpp's permuted order
    norm_offset: bool = False  # a norm weight stored plus one

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        return self._rows(raw, self.shape)

    def into(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """Decode the blocks into `out` (the tensor's shape, any dtype and device), a chunk of whole rows (whole
        heads) at a time: each value rounded once from float32 into out's dtype, as a whole-tensor copy rounds."""
        if len(self.shape) < 2:
            with timed_decode(self.ggml_type, out):
                out.copy_(self(raw))
            return
        rows, width = self.shape[0], math.prod(self.shape[1:])
        step = self.head_rows or 1
        chunk = max(step, DECODE_CHUNK_WEIGHTS // width // step * step)
        for start in range(0, rows, chunk):
            self.rows_into(raw, start, min(rows, start + chunk), out[start:min(rows, start + chunk)])

    def rows_into(self, raw: torch.Tensor, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows start..stop-1 (whole heads where the rows are permuted) decoded into `out` ([stop - start, ...]). The
        time it takes is counted (dequantize_tally): a load's, a whole weight's or a decode pass's tile."""
        row_bytes = raw.numel() // self.shape[0]
        rows = raw[start * row_bytes:stop * row_bytes]
        with timed_decode(self.ggml_type, out):
            if self.head_rows is None and not self.norm_offset:  # decoded straight into `out`
                dequantize_into(rows, self.ggml_type, out)
            else:
                out.copy_(self._rows(rows, (stop - start, *self.shape[1:])))

    def _rows(self, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        weight = dequantize(raw, self.ggml_type, shape)
        if self.head_rows is not None:
            weight = undo_qk_permutation(weight, self.head_rows)
        if self.norm_offset:
            weight = weight - 1  # in float32, as transformers subtracts it from gguf-py's float32 values
        return weight


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear weight held as its GGUF blocks, as read; the linear dequantizes it as it multiplies
    (linear_kernels.attach_quantized)."""
    blocks: torch.Tensor  # uint8, the tensor's bytes
    decode: GGUFDecode

    @property
    def shape(self) -> tuple[int, int]:
        return self.decode.shape

    @property
    def row_step(self) -> int:
        return self.decode.head_rows or 1

    def fill(self, out: torch.Tensor) -> None:
        self.decode.into(self.blocks, out)

    def fill_rows(self, start: int, stop: int, out: torch.Tensor) -> None:
        self.decode.rows_into(self.blocks, start, stop, out)


def model_config(checkpoint: Path, trust_remote_code: bool = False):
    """The transformers config of a checkpoint directory, or of a GGUF file as from_pretrained(gguf_file=...) builds
    it (from the same dict, checkpoint.gguf_config)."""
    if not is_gguf_file(checkpoint):
        return AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    from transformers import CONFIG_MAPPING

    config = load_config(checkpoint)
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def gguf_decode(index: GGUFIndex, name: str) -> GGUFDecode:
    info = index.tensors[name]
    return GGUFDecode(info.dtype, info.shape, index.permuted_head_rows(name),
                      index.architecture in NORM_OFFSET_ARCHITECTURES and "norm.weight" in name)


def gguf_recipes(model: torch.nn.Module, index: GGUFIndex) -> dict[str, Recipe]:
    """Parameter name -> the recipe reading its GGUF tensor, for every GGUF tensor the model has a parameter for
    (others, such as llama.cpp's precomputed rope factors, are left as from_pretrained leaves them)."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    try:
        with gguf_parsed_once():  # one tensor-name map, not one per module
            names = get_gguf_hf_weights_map(model, TensorProcessor(model.config.to_dict()))
    except NotImplementedError as error:  # gguf-py has no tensor names for this model type
        raise CheckpointError(f"{index.files[0]}: {error}") from None
    recipes: dict[str, Recipe] = {}
    for name, info in index.tensors.items():
        target = names.get(name)
        if target is not None:
            recipes[target] = Recipe(target=target, sources=[info], source_patterns=[name],
                                     decode=gguf_decode(index, name))
    return recipes


def read_gguf_tensor(recipe: Recipe, model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A GGUF recipe's tensor read from its file and decoded into a new tensor at the dtype the model built its
    target with."""
    module_path, _, name = recipe.target.rpartition(".")
    meta = getattr(model.get_submodule(module_path) if module_path else model, name)
    weight = torch.empty(recipe.decode.shape, dtype=meta.dtype, device=device)
    recipe.decode.into(read_gguf_blocks(recipe.sources[0]), weight)
    return weight


def load_gguf_model(checkpoint: Path, config, *, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The whole model from a GGUF file, every tensor read once and dequantized into `dtype` on `device`: built on
    meta, then each parameter assigned, so no weight is allocated twice."""
    index = read_gguf_index(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for target, recipe in gguf_recipes(model, index).items():
        set_tensor(model, target, read_gguf_tensor(recipe, model, device), device, checkpoint)
    model.tie_weights()
    materialise_buffers(model, device)
    missing = [name for name, param in model.named_parameters() if param.is_meta]
    if missing:
        raise CheckpointError(f"{checkpoint}: no tensor in the GGUF file for {', '.join(missing[:5])}")
    return model.eval()
