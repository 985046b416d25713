"""The layer-streaming runtime: a transformers model whose decoder layers live on disk.

StreamedModel builds the model on meta (from safetensors, or from a GGUF file whose blocks are dequantized as they
load: gguf_weights.py), loads what stays resident (embeddings, final norm, head, unless the token
matrices stream: token_matrices.py) and hooks one StreamedLayer into each decoder layer (streamed_layer.py: load
before its forward, release after, accelerate's hook shape); a ReadAhead reads the layers into buffer slots on a
worker thread one or more layers ahead (read_ahead.py). transformers owns the architecture; we only discover the
decoder stack and swap weights in and out around each layer's forward.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from batchrun.checkpoint import (CheckpointError, TokenizerOnDemand, is_gguf_file, load_config, read_gguf_index,
                                 read_tensor_infos, resolve_checkpoint, storage_dtype)
from batchrun.host import keep_heap_flat
from batchrun.plan import HEAD_CHUNK_BYTES
from batchrun.runtime.devices import default_device, resolve_dtype
from batchrun.runtime.gguf_weights import gguf_recipes, model_config, read_gguf_tensor
from batchrun.runtime.linear_kernels import (PACK_MIN_ROWS, multiplying_tile_by_tile, packing_available, route_linears,
                                             routed_weight_names)
from batchrun.runtime.loader import LayerLoader, SlotPool
from batchrun.runtime.read_ahead import ReadAhead
from batchrun.runtime.skeleton import materialise_buffers, set_tensor
from batchrun.runtime.streamed_layer import PassState, StreamedLayer
from batchrun.runtime.token_matrices import (GatheredEmbedding, MatrixRows, StreamedHead, StreamedMatrices,
                                             matrix_rows, transforms_logits)
from batchrun.runtime.turns import LayerTurns, PassGroup, PassProgress, TurnCallback, run_interleaved
from batchrun.runtime.weights import Recipe, build_recipes, read_into, realize, tensor_from_bytes

log = logging.getLogger(__name__)


def find_decoder_stack(model: torch.nn.Module, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList whose length is the config's layer count (the largest one if several match)."""
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and name]
    if not found:
        raise ValueError(f"no ModuleList of {num_layers} layers in {type(model).__name__}; cannot stream it")
    return max(found, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class LayerReads:
    """How a streamed model reads its decoder layers."""
    prefetch: bool = True  # read the next layers on a thread while one computes
    depth: int = 1  # layers a prefill reads ahead of the one computing (each holds a layer in memory)
    decode_depth: int | None = None  # the same for decode passes, where the plan found room for more
    drop_page_cache: bool = True  # hand each layer's file pages back to the kernel once read
    pack_weights: bool = False  # long bfloat16 prefills multiply packed weights (measure.packs_weights)
    # The token matrices read as passes need them instead of held (token_matrices.py; the plan decides by the
    # budget): a pass's embedding rows gathered by token id, and the head read once a pass. A tied checkpoint's one
    # matrix is held unless the head streams, and then both uses read it.
    gather_embeddings: bool = False
    stream_head: bool = False


class StreamedModel(TokenizerOnDemand):
    """A causal LM whose decoder layers are read from the checkpoint's safetensors (or GGUF file) as they run.

    Embeddings, final norm and head stay resident; each decoder layer is read just before it runs (the next one
    read ahead on a thread), so a model larger than memory runs with a layer or two in memory. Called like the
    transformers model it wraps (`model(input_ids)`, `model.generate(...)`), under inference mode.

    >>> import batchrun
    >>> with batchrun.StreamedModel(batchrun.default_model(), dtype="float32") as model:
    ...     ids = model.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    ...     logits = model(ids).logits  # one pass through the decoder layers, each read from disk
    >>> logits.shape[:2] == ids.shape, model.passes, model.peak_materialised_layers <= 2
    (True, 1, True)
    """

    def __init__(self, model: str | Path, *, device: str | torch.device | None = None, dtype=None,
                 reads: LayerReads = LayerReads(), hf_token: str | None = None, trust_remote_code: bool = False,
                 max_seq_len: int | None = None):
        self.checkpoint = resolve_checkpoint(model, hf_token=hf_token)
        load_config(self.checkpoint, trust_remote_code=trust_remote_code)  # refuses remote code unless asked
        self.device = torch.device(device or default_device())
        infos = read_tensor_infos(self.checkpoint)
        self.dtype = resolve_dtype(dtype, self.device, storage_dtype(infos))
        keep_heap_flat()  # before the first weight is allocated, so no heap grows under the model
        self.config = model_config(self.checkpoint, trust_remote_code)
        _refuse_quantized(self.checkpoint, self.config)
        self.num_layers = text_config(self.config).num_hidden_layers
        self.max_seq_len = max_seq_len or getattr(text_config(self.config), "max_position_embeddings", None)
        self._trust_remote_code = trust_remote_code
        self._current = PassState()  # what run_pass tells the layers (and a streamed head) of the pass in flight
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype,
                                                          trust_remote_code=trust_remote_code)
        self.model.eval()
        self._read_generation_config()
        self.layers_path, self.layers = find_decoder_stack(self.model, self.num_layers)
        route_linears(self.model, "aten")  # routed linears take a weight a decode pass leaves narrow (run_pass)
        recipes = (gguf_recipes(self.model, read_gguf_index(self.checkpoint)) if is_gguf_file(self.checkpoint)
                   else build_recipes(self.model, infos))
        layer_recipes, resident = self._split_recipes(recipes)
        self.matrices, resident = self._place_token_matrices(resident, reads)
        self._load_resident(resident)
        meta = [dict(layer.named_parameters()) for layer in self.layers]  # every decoder parameter is on meta still
        self._check_layers_covered(layer_recipes, meta)
        self.loader = LayerLoader(layer_recipes, [f"{self.layers_path}.{i}." for i in range(self.num_layers)], meta,
                                  device=self.device, model=self.model, config=self.config,
                                  drop_page_cache=reads.drop_page_cache,
                                  narrowable=[routed_weight_names(layer) for layer in self.layers])
        self.reader = ReadAhead(self.loader, self.num_layers, prefetch=reads.prefetch, depth=reads.depth,
                                decode_depth=reads.decode_depth)
        # Whether long prefills may pack (measure.packs_weights: where the packed kernel measured faster).
        self.may_pack = reads.pack_weights
        self.passes = 0
        self._on_turn: TurnCallback | None = None
        self._streamed_layers = [StreamedLayer(index, layer, meta[index], self.reader, self._current).init()
                          for index, layer in enumerate(self.layers)]
        self._counting = self.model.register_forward_pre_hook(self._before_pass)
        self._closed = False

    # -- building ------------------------------------------------------------------------------
    def _read_generation_config(self) -> None:
        """from_config reads only config.json; generation_config.json's EOS list is what stops rows. One that does
        not parse is skipped with a warning, as from_pretrained (the resident path) does."""
        if not (self.checkpoint / "generation_config.json").is_file():
            return
        try:
            self.model.generation_config = GenerationConfig.from_pretrained(self.checkpoint)
        except (OSError, ValueError) as error:
            log.warning("%s/generation_config.json is not usable (%s); using config.json's settings",
                        self.checkpoint, error)

    def _split_recipes(self, recipes: dict[str, Recipe]) -> tuple[list[list[Recipe]], list[Recipe]]:
        per_layer: list[list[Recipe]] = [[] for _ in range(self.num_layers)]
        resident: list[Recipe] = []
        prefix = self.layers_path + "."
        for target, recipe in recipes.items():
            if target.startswith(prefix):
                index = int(target[len(prefix):].split(".", 1)[0])
                per_layer[index].append(recipe)
            else:
                resident.append(recipe)
        return per_layer, resident

    def _place_token_matrices(self, recipes: list[Recipe], reads: LayerReads
                              ) -> tuple[StreamedMatrices, list[Recipe]]:
        """The embedding and head that `reads` says are read as passes need them (token_matrices.py), hooked in
        here, and those of `recipes` that stay resident."""
        matrices = StreamedMatrices()
        embedding, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if head is None:
            return matrices, recipes
        names = {module: name for name, module in self.model.named_modules()}
        embed_target, head_target = f"{names[embedding]}.weight", f"{names[head]}.weight"
        by_target = {recipe.target: recipe for recipe in recipes}
        embed_recipe = by_target.get(embed_target)
        # tied: the checkpoint saves the one matrix, under the embedding's name (a head missing from an untied
        # checkpoint is left for the missing-tensor error below)
        tied = head_target not in by_target and bool(getattr(text_config(self.config), "tie_word_embeddings", False))
        head_recipe = embed_recipe if tied else by_target.get(head_target)
        stream_head = reads.stream_head and head_recipe is not None and head_recipe.reads_by_rows
        # a tied matrix is gathered exactly when the head streams it: held for the head, it serves both uses
        gather = ((stream_head if tied else reads.gather_embeddings) and embed_recipe is not None
                  and embed_recipe.reads_by_rows)
        if not (gather or stream_head):
            return matrices, recipes
        drop = reads.drop_page_cache
        readers = {}  # one per tensor: a tied matrix serves both uses

        def rows_of(recipe: Recipe) -> MatrixRows:
            info = recipe.sources[0]
            if info.name not in readers:
                readers[info.name] = matrix_rows(info, device=self.device, dtype=self.dtype, drop_page_cache=drop)
            return readers[info.name]

        if gather:
            matrices.gathered = GatheredEmbedding(embedding, rows_of(embed_recipe))
        if stream_head:
            matrices.head_path = names[head]
            # a chunk no larger than a decoder layer: the head never sets the run's floor
            layer_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in self.layers) * self.dtype.itemsize
            matrices.head = StreamedHead(rows_of(head_recipe), self.num_layers, lambda: self._current.group,
                                         chunk_bytes=min(HEAD_CHUNK_BYTES, layer_bytes),
                                         reduces=not transforms_logits(text_config(self.config)))
        matrices.rows = list(readers.values())
        streamed = {embed_target if gather else None, head_target if stream_head else None}
        return matrices, [recipe for recipe in recipes if recipe.target not in streamed]

    def _load_resident(self, recipes: list[Recipe]) -> None:
        """Embeddings, final norm, head: read once, cast, keep. Then buffers and tied weights."""
        for recipe in recipes:
            if recipe.decode is not None:  # a GGUF tensor, decoded chunk by chunk into its place
                self._set_tensor(recipe.target, read_gguf_tensor(recipe, self.model, self.device))
                continue
            tensors = []
            for info in recipe.sources:
                raw = torch.empty(info.nbytes, dtype=torch.uint8)
                fd = os.open(info.file, os.O_RDONLY)
                try:
                    read_into(fd, memoryview(raw.numpy()), info.offset, info.file)
                finally:
                    os.close(fd)
                tensors.append(tensor_from_bytes(raw, info))
            for target, value in realize(recipe, tensors, self.model, self.config).items():
                self._set_tensor(target, value)
        head = self.matrices.head
        if head is None:
            self.model.tie_weights()
        else:  # the streamed head takes the module's place, keeping its bias (a small resident tensor)
            bias = getattr(self.model.get_submodule(self.matrices.head_path), "bias", None)
            head.bias = None if bias is None or bias.is_meta else bias
            parent, _, attr = self.matrices.head_path.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, attr, head)
        materialise_buffers(self.model, self.device)
        missing = [name for name, p in self.model.named_parameters()
                   if p.is_meta and not name.startswith(self.layers_path + ".")]
        if missing:
            raise CheckpointError(f"{self.checkpoint}: no tensor in the checkpoint for {', '.join(missing[:5])}")

    def _set_tensor(self, target: str, value: torch.Tensor) -> None:
        set_tensor(self.model, target, value, self.device, self.checkpoint)

    def _check_layers_covered(self, layer_recipes: list[list[Recipe]], meta: list[dict]) -> None:
        for index, recipes in enumerate(layer_recipes):
            produced = {r.target for r in recipes}
            prefix = f"{self.layers_path}.{index}."
            wanted = {prefix + name for name in meta[index]}
            # A converter may produce several targets from its first one (qkv -> q, k, v), so only
            # flag a layer that has no recipe at all.
            if not produced and wanted:
                raise CheckpointError(f"{self.checkpoint}: decoder layer {index} has no tensors in the checkpoint")

    # -- passes --------------------------------------------------------------------------------
    def _before_pass(self, module, args):
        if self._current.group is None:  # else a micro-batch of a pass that run_pass already counted
            self._start_pass()

    def _start_pass(self) -> None:
        self._release_layers()  # a pass interrupted by an exception leaves layers in place
        self.passes += 1

    def _release_layers(self) -> None:
        for layer in self._streamed_layers:
            layer.release()

    def run_pass(self, calls, before_layer=None, *, light: bool = False, rows: int = 0) -> list:
        """Run forward calls as the micro-batches of ONE pass: each layer is read once for all of them.

        `before_layer(layer, micro)` runs inside the turn, before that micro-batch enters the layer.
        `light`: the calls compute little per layer (one new token per sequence), less than reading the next layer
        takes; on the CPU the forward then leaves a core to the reader and the widener, and linear weights stored
        narrower than the compute dtype stay so, widened tile by tile as they multiply (linear_kernels.widening_linear):
        a layer crosses RAM once, at its checkpoint's size, instead of being widened into its slot and read back.
        A prefill widens on the reader's thread instead, beside compute that outlasts it.
        `rows`: the token positions the calls multiply each layer by, padding included. From PACK_MIN_ROWS on, a
        bfloat16 pass on the CPU multiplies packed copies of each layer's linear weights (linear_kernels.pack_weights)
        where the model was opened with pack_weights.
        """
        current = self._current
        current.pack = self.packs_weights(rows) and not light
        self.reader.begin_pass(light)
        current.progress = PassProgress.of(self._on_turn, len(calls), self.num_layers)
        with self.reader.leaving_a_core(light), multiplying_tile_by_tile(light):
            try:
                if len(calls) == 1 and before_layer is None:
                    with torch.inference_mode():
                        return [calls[0]()]
                self._start_pass()
                current.group = PassGroup(LayerTurns(len(calls)), before_layer)
                try:
                    return run_interleaved(current.group, calls, torch.inference_mode)
                finally:
                    current.group = None
                    self._release_layers()  # after a failure, nothing stays materialised
            finally:
                current.progress = None

    def packs_weights(self, rows: int) -> bool:
        """Whether a pass multiplying each layer by `rows` positions packs its linear weights first."""
        return (self.may_pack and rows >= PACK_MIN_ROWS and self.device.type == "cpu"
                and self.dtype == torch.bfloat16 and packing_available())

    # -- public surface ------------------------------------------------------------------------
    def report_turns(self, on_turn: TurnCallback | None) -> None:
        """Tell `on_turn` of each layer turn of the passes run_pass runs from now on (turns.PassProgress)."""
        self._on_turn = on_turn

    def use_prefill_read_ahead_in_decode(self) -> None:
        """Decode passes read ahead only as far as a prefill: the plan sized a deeper read-ahead for them on keys and
        values read in place, which this model's attention does not do."""
        self.reader.decode_depth = self.reader.prefill_depth

    @property
    def prefetching(self) -> bool:
        return self.reader.prefetching

    @property
    def prefetch_depth(self) -> int:
        return self.reader.prefill_depth

    @property
    def decode_prefetch_depth(self) -> int:
        return self.reader.decode_depth

    @property
    def slots(self) -> SlotPool:
        return self.reader.slots

    @property
    def peak_materialised_layers(self) -> int:
        return self.reader.slots.peak_in_use

    @property
    def bytes_read(self) -> int:
        return self.loader.bytes_read + self.matrices.bytes_read

    def forward(self, *args, **kwargs):
        self._current.pack = False
        self.reader.begin_pass(light=False)
        with torch.inference_mode():
            return self.model(*args, **kwargs)

    __call__ = forward

    def generate(self, *args, **kwargs):
        self._current.pack = False
        self.reader.begin_pass(light=False)
        with torch.inference_mode():
            return self.model.generate(*args, **kwargs)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.reader.stop()
        for layer in self._streamed_layers:
            layer.detach()
        self._counting.remove()
        self.model.register_forward_pre_hook(_refuse_closed)  # not a device error from the meta layers
        self.loader.close()
        self.matrices.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _refuse_closed(module, args):
    raise RuntimeError("this StreamedModel is closed: its layers are no longer read from disk; open a new one")


def _refuse_quantized(checkpoint: Path, config) -> None:
    """from_config would build plain layers: packed weights would be read without their scales."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None))
        raise CheckpointError(f"{checkpoint}: quantized checkpoint ({method or 'unknown method'}); streaming reads "
                              "unquantized safetensors only: run it resident or use an unquantized checkpoint")
