"""A transformers model built on meta, given its weights one tensor at a time: what a streamed model's resident
tensors and a GGUF model's every tensor are loaded through."""
from __future__ import annotations

import torch

from batchrun.checkpoint import CheckpointError


def set_tensor(model: torch.nn.Module, target: str, value: torch.Tensor, device: torch.device, where) -> None:
    """Put `value` in the model's parameter or buffer `target`, on `device` at the dtype the model built it with
    (floating point; others keep their own); a shape the model does not expect is refused, naming `where`."""
    module_path, _, name = target.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    current = getattr(module, name)
    value = value.to(device=device, dtype=current.dtype if current.is_floating_point() else value.dtype)
    if tuple(value.shape) != tuple(current.shape):
        raise CheckpointError(f"{where}: tensor for {target} has shape {tuple(value.shape)}, "
                              f"the model expects {tuple(current.shape)}")
    if name in module._buffers:
        module._buffers[name] = value
    else:
        param = torch.nn.Parameter(value, requires_grad=False)
        param._is_hf_initialized = True
        module._parameters[name] = param


def materialise_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Give non-persistent buffers (rotary inv_freq, embedding scales) their real values.

    They are computed, not saved, so they are still on meta: allocate them, then let the model's own
    `initialize_weights` fill them. Parameters already loaded are flagged initialised and are skipped; parameters
    still on meta (a streamed model's decoder layers) are left alone by the init functions.
    """
    for name, buffer in list(model.named_non_persistent_buffers()):
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        module._buffers[attr] = torch.empty_like(buffer, device=device)
    for _, param in model.named_parameters():
        param._is_hf_initialized = True
    model.initialize_weights()
