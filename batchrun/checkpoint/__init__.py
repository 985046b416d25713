"""Checkpoints: resolving a directory or hub id, safetensors headers, sizes read from the files themselves, the
default model and the tokenizer. No torch at import.
"""
from batchrun.checkpoint.files import (DTYPE_BITS, CheckpointError, TensorInfo, load_config, read_tensor_infos,
                                       storage_dtype, tensor_index, weight_sample_digest)
from batchrun.checkpoint.provision import DefaultModelError, default_model
from batchrun.checkpoint.resolve import resolve_checkpoint
from batchrun.checkpoint.sizes import (DTYPE_CODES, CheckpointSizes, attended_positions, checkpoint_sizes,
                                       kv_bytes_for_sequence, kv_bytes_per_token_per_layer)
from batchrun.checkpoint.tokenizer import TokenizerOnDemand, load_tokenizer

__all__ = ["CheckpointError", "CheckpointSizes", "DTYPE_BITS", "DTYPE_CODES", "DefaultModelError", "TensorInfo",
           "TokenizerOnDemand", "attended_positions", "checkpoint_sizes", "default_model", "kv_bytes_for_sequence",
           "kv_bytes_per_token_per_layer", "load_config", "load_tokenizer", "read_tensor_infos", "resolve_checkpoint",
           "storage_dtype", "tensor_index", "weight_sample_digest"]
