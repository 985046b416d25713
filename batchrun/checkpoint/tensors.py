"""What every checkpoint reader shares, safetensors and GGUF alike: the error a checkpoint raises and where one
tensor lies in its file. No torch."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import BatchrunError

GGUF_SUFFIX = ".gguf"


class CheckpointError(BatchrunError, ValueError):
    """A checkpoint that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors code: "F32", "BF16", "F8_E4M3", ...; a GGUF tensor's ggml type: "Q4_K", ...
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`: 8 + header length + data_offsets[0]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)
