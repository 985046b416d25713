"""One decoder layer of a streamed model: its weights put in place before its forward and taken off after it.

The shape is accelerate's ModelHook (init / pre_forward / post_forward / detach), on torch's own module hooks:
transformers runs the layer's forward as it is, and only the tensors under it change.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.host import faults, return_freed_memory
from batchrun.runtime.linear_kernels import attach_quantized, detach_quantized, drop_packed_weights, pack_weights
from batchrun.runtime.loader import LayerWeights
from batchrun.runtime.read_ahead import ReadAhead
from batchrun.runtime.turns import PassGroup, PassProgress


@dataclass
class PassState:
    """The pass in flight, as its layers see it (StreamedModel.run_pass sets it)."""

    group: PassGroup | None = None  # its micro-batches taking turns; None: one plain forward call
    progress: PassProgress | None = None  # told of each layer turn
    pack: bool = False  # the layers multiply packed copies of their linear weights (StreamedModel.packs_weights)


class StreamedLayer:
    """Decoder layer `index`'s load, run and release. `init` hooks it into its module; `pre_forward` takes its
    weights from the read-ahead (read already, or read now) and puts them in place of the meta parameters, once for
    all the pass's micro-batches; `post_forward` puts the meta parameters back after the last micro-batch and gives
    the slot back; `detach` unhooks it, releasing whatever a failed pass left in place."""

    def __init__(self, index: int, module: torch.nn.Module, meta: dict[str, torch.nn.Parameter], reader: ReadAhead,
                 current: PassState):
        self.index, self.module, self.reader, self.current = index, module, reader, current
        self.meta = meta  # relative name -> the meta parameter it leaves in place between passes
        self.weights: LayerWeights | None = None  # in place now
        self._handles: list = []

    def init(self) -> StreamedLayer:
        self._handles = [self.module.register_forward_pre_hook(self.pre_forward),
                         self.module.register_forward_hook(self.post_forward)]
        return self

    def pre_forward(self, module, args) -> None:
        group = self.current.group
        if group is not None:
            group.turns.wait(self.index, group.micro)
        if group is None or group.micro == 0:  # load once; later micro-batches reuse the weights
            self.load()
        if group is not None and group.before_layer is not None:
            group.before_layer(self.index, group.micro)

    def load(self) -> None:
        weights = self.reader.take(self.index)
        for name, tensor in weights.tensors.items():
            assign(self.module, name, tensor)
        for name, quantized in weights.quantized.items():  # the weight stays meta; the linear multiplies the blocks
            attach_quantized(self.module.get_submodule(name.rpartition(".")[0]), quantized)
        self.weights = weights
        if self.current.pack:
            pack_weights(self.module)
        self.reader.ask_ahead_of(self.index)

    def post_forward(self, module, args, output) -> None:
        group = self.current.group
        if group is None or group.last_micro:
            self.release()
            self.reader.ask_after(self.index)
            faults.reached("layer")
        if self.reader.device.type == "cpu":
            return_freed_memory()  # before the next turn: its activations are the next resident ones
        if self.current.progress is not None:
            self.current.progress.turn_done()
        if group is not None:
            group.turns.advance(self.index, group.micro)

    def release(self) -> None:
        """Meta parameters back in place, the slot back to the read-ahead; nothing to do when nothing is in place."""
        weights, self.weights = self.weights, None
        if weights is None:
            return
        drop_packed_weights(self.module)
        for name in weights.tensors:
            assign(self.module, name, self.meta[name])
        for name in weights.quantized:
            detach_quantized(self.module.get_submodule(name.rpartition(".")[0]))
        self.reader.give(weights)

    def detach(self) -> None:
        self.release()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def assign(module: torch.nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    """`tensor` as the parameter or buffer `dotted` (relative to `module`), without a copy."""
    path, _, name = dotted.rpartition(".")
    owner = module.get_submodule(path) if path else module
    if name in owner._parameters:
        if isinstance(tensor, torch.nn.Parameter):
            owner._parameters[name] = tensor
        else:
            owner._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[name] = tensor
