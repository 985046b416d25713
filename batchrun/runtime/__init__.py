"""Running a model: resident or streamed layer by layer from safetensors or GGUF, the layer loader, micro-batches
taking turns, prefill with a shared prefix, scoring choices or generating tokens, and GGUF blocks dequantized. Needs
torch.
"""
from batchrun.runtime.dequantize_tally import dequantized, dequantized_since
from batchrun.runtime.gguf_blocks import dequantize, read_gguf_blocks, read_gguf_rows, undo_qk_permutation
from batchrun.runtime.gguf_weights import GGUFDecode, gguf_recipes, load_gguf_model, model_config
from batchrun.runtime.devices import check_device, default_device, default_dtype
from batchrun.runtime.handle import ModelHandle, open_model
from batchrun.runtime.prefill import cache_argument, output_cache
from batchrun.runtime.prefix_attention import attends_through_sdpa, reads_prefix_in_place, sdpa_groups_one_token_queries
from batchrun.runtime.resident import ResidentModel
from batchrun.runtime.score import Answer, GreedyPool, PoolPlan, eos_token_ids, generation_answer, score_choices
from batchrun.runtime.stream import LayerReads, StreamedModel

__all__ = ["Answer", "GGUFDecode", "GreedyPool", "LayerReads", "ModelHandle", "PoolPlan", "ResidentModel",
           "StreamedModel", "attends_through_sdpa", "cache_argument", "check_device", "default_device", "default_dtype",
           "dequantize", "dequantized", "dequantized_since", "eos_token_ids", "generation_answer", "gguf_recipes",
           "load_gguf_model", "model_config", "open_model", "output_cache", "read_gguf_blocks", "read_gguf_rows",
           "reads_prefix_in_place", "score_choices", "sdpa_groups_one_token_queries", "undo_qk_permutation"]
