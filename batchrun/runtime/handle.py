"""A model opened to run, resident or streamed: what both offer (ModelHandle), and open_model, the executor's one
entry point, which opens the one the plan chose."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from batchrun.runtime.linear_kernels import route_linears
from batchrun.runtime.resident import ResidentModel
from batchrun.runtime.stream import LayerReads, StreamedModel
from batchrun.runtime.turns import TurnCallback


@runtime_checkable
class ModelHandle(Protocol):
    """What the executor and the passes (prefill.py, score.py) use of an opened model. ResidentModel and
    StreamedModel both offer it; nothing outside the runtime sets their attributes, it asks through these methods."""

    checkpoint: Path
    model: torch.nn.Module  # the transformers model: a pass's forward calls call it
    config: object  # the transformers config
    device: torch.device
    dtype: torch.dtype
    layers: torch.nn.ModuleList  # the decoder layers
    passes: int  # passes run so far: each run_pass, and each forward call outside one

    @property
    def tokenizer(self): ...

    @property
    def bytes_read(self) -> int:
        """Checkpoint bytes read since the model was opened."""

    @property
    def max_seq_len(self) -> int | None: ...

    def run_pass(self, calls: list[Callable[[], object]], before_layer: Callable[[int, int], None] | None = None, *,
                 light: bool = False, rows: int = 0) -> list:
        """The calls' results, run as the micro-batches of one pass (see StreamedModel.run_pass)."""

    def report_turns(self, on_turn: TurnCallback | None) -> None:
        """Tell `on_turn` of each layer turn of the passes run_pass runs from now on."""

    def use_prefill_read_ahead_in_decode(self) -> None:
        """Decode passes read no further ahead than a prefill does."""

    def __call__(self, *args, **kwargs): ...

    def close(self) -> None: ...

    def __enter__(self) -> ModelHandle: ...

    def __exit__(self, *exc) -> bool: ...


def open_model(checkpoint: Path, *, mode: str, device: str, dtype=None, trust_remote_code: bool = False,
               linear_kernel: str = "aten", reads: LayerReads = LayerReads()) -> ModelHandle:
    """The model as the plan chose to run it: `mode` "resident" or "streamed" (its layers read as `reads` says).
    `linear_kernel`: what computes the model's nn.Linear layers (linear_kernels.py; measure.linear_kernel picks)."""
    if mode == "resident":
        model = ResidentModel(checkpoint, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = StreamedModel(checkpoint, device=device, dtype=dtype, reads=reads, trust_remote_code=trust_remote_code)
    route_linears(model.model, linear_kernel)
    return model
