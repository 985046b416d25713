"""One entry point for the executor: a model that runs resident when it fits, streamed when not."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from batchrun.checkpoint import load_config, read_tensor_infos
from batchrun.devices import resolve_dtype
from batchrun.stream import StreamedModel, text_config
from batchrun.tokenizer import load_tokenizer


class ResidentModel:
    """The plain transformers model, weights loaded once. Same surface as StreamedModel."""

    def __init__(self, checkpoint: Path, *, device: str, dtype=None, trust_remote_code: bool = False):
        load_config(checkpoint, trust_remote_code=trust_remote_code)
        read_tensor_infos(checkpoint)  # same refusals as streaming: pickle-only, truncated, missing shards
        self.checkpoint = Path(checkpoint)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=self.dtype,
                                                          trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval()
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.checkpoint, trust_remote_code)
        self.passes = 0
        self.bytes_read = 0
        self._hook = self.model.register_forward_pre_hook(self._count_pass)

    def _count_pass(self, module, args):
        self.passes += 1

    @property
    def max_seq_len(self) -> int | None:
        return getattr(text_config(self.config), "max_position_embeddings", None)

    def __call__(self, *args, **kwargs):
        with torch.inference_mode():
            return self.model(*args, **kwargs)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def open_model(checkpoint: Path, *, mode: str, device: str, dtype=None, prefetching: bool = True,
               prefetch_depth: int = 1, trust_remote_code: bool = False):
    if mode == "resident":
        return ResidentModel(checkpoint, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    return StreamedModel(checkpoint, device=device, dtype=dtype, prefetching=prefetching,
                         prefetch_depth=prefetch_depth, trust_remote_code=trust_remote_code)
