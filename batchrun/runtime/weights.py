"""Checkpoint tensors -> module parameters, through transformers' own conversion mapping.

transformers 5 renames and fuses some checkpoint tensors at load time (GPT-NeoX's `embed_out`,
Mixtral's per-expert `w1/w2/w3` fused into `gate_up_proj`). Rather than keeping a table of our own,
we ask transformers which checkpoint keys feed which parameter (`get_model_conversion_mapping`) and
replay its conversion operations on the tensors we read, one decoder layer at a time.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from batchrun.checkpoint import CheckpointError, GGUFTensorInfo, TensorInfo

if TYPE_CHECKING:  # gguf_weights builds recipes, so it imports this module
    from batchrun.runtime.gguf_weights import GGUFDecode

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class Recipe:
    """How to produce one or more module parameters from checkpoint tensors."""

    target: str  # first target parameter name (a converter may produce several)
    sources: list[TensorInfo] = field(default_factory=list)
    source_patterns: list[str] = field(default_factory=list)
    converter: WeightConverter | None = None  # None: a plain (possibly renamed) copy
    decode: GGUFDecode | None = None  # a GGUF tensor's: its blocks as read -> its values


    @property
    def is_plain(self) -> bool:
        return self.converter is None and self.decode is None and len(self.sources) == 1

    @property
    def reads_by_rows(self) -> bool:
        """Whether the target is its one source's rows as they lie (any range of rows read and converted alone):
        a plain copy, or a GGUF tensor with no row reordering or offset."""
        if self.decode is not None:
            return self.decode.head_rows is None and not self.decode.norm_offset
        return self.is_plain


def build_recipes(model: torch.nn.Module, infos: dict[str, TensorInfo]) -> dict[str, Recipe]:
    """Map every checkpoint tensor onto the meta model's parameters, as from_pretrained would."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    recipes: dict[str, Recipe] = {}
    for key in sorted(infos, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if target not in meta_state and key in meta_state:
            target, pattern = rename_source_key(key, [], [], prefix, meta_state)
        if target not in meta_state:
            continue  # e.g. a stale rotary buffer saved by an old version; from_pretrained ignores it too
        recipe = recipes.setdefault(target, Recipe(target=target))
        if pattern is not None and pattern in converter_by_pattern:
            recipe.converter = converter_by_pattern[pattern]
            recipe.source_patterns.append(pattern)
        else:
            recipe.source_patterns.append(key)
        recipe.sources.append(infos[key])
    return recipes


def realize(recipe: Recipe, tensors: list[torch.Tensor], model, config) -> dict[str, torch.Tensor]:
    """Run a recipe over already-read source tensors; returns target name -> tensor."""
    if recipe.converter is None:
        return {recipe.target: tensors[0]}
    converter = copy.deepcopy(recipe.converter)
    for info, pattern, tensor in zip(recipe.sources, recipe.source_patterns, tensors):
        converter.add_tensor(recipe.target, info.name, pattern, lambda t=tensor: t)
    produced = converter.convert(recipe.target, model=model, config=config)
    return {name: (value[0] if isinstance(value, list) else value) for name, value in produced.items()}


def tensor_from_bytes(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """View a uint8 buffer holding one tensor's bytes as that tensor (copying only if misaligned); a GGUF tensor's
    blocks stay bytes, for its recipe's decode."""
    if isinstance(info, GGUFTensorInfo):
        return raw
    dtype = SAFETENSORS_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointError(f"{info.file}: tensor {info.name} has dtype {info.dtype}, which batchrun cannot read")
    element = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % element:
        raw = raw.clone()
    return raw.view(dtype).reshape(info.shape)


def read_into(fd: int, target: memoryview, offset: int, path) -> None:
    """Fill `target` from the file at `offset` with large positional reads (no memory map, no page faults)."""
    needed = len(target)
    done = 0
    while done < needed:
        try:
            n = os.preadv(fd, [target[done:]], offset + done)
        except OSError as error:  # a failing disk or a file gone from a network mount: name the file, not a traceback
            raise CheckpointError(f"{path}: could not read bytes {offset + done}..{offset + needed} "
                                  f"({error.strerror or error})") from error
        if n == 0:
            raise CheckpointError(f"{path}: file ended while reading bytes {offset + done}..{offset + needed}; "
                                  "the shard is truncated")
        done += n


def coalesce(infos: list[TensorInfo], max_gap: int = 1 << 20) -> list[tuple[int, int, list[TensorInfo]]]:
    """Group one shard's tensors into contiguous byte spans: (start, end, members), few large reads."""
    spans: list[tuple[int, int, list[TensorInfo]]] = []
    for info in sorted(infos, key=lambda i: i.offset):
        end = info.offset + info.nbytes
        if spans and info.offset - spans[-1][1] <= max_gap:
            start, last_end, members = spans[-1]
            spans[-1] = (start, max(last_end, end), members + [info])
        else:
            spans.append((info.offset, end, [info]))
    return spans
