"""Job specs: reading JSONL / Parquet / OpenAI batch lines, validating rows, templates, and encoding prompts into
token ids. No torch.
"""
from batchrun.spec.encode import (EncodedRow, choice_sequences, encode_requests, kept_positions,
                                  shortest_first_pass_sequence, uses_chat_template)
from batchrun.spec.files import kind
from batchrun.spec.read import JobSpec, read_spec
from batchrun.spec.template import SpecError

__all__ = ["EncodedRow", "JobSpec", "SpecError", "choice_sequences", "encode_requests", "kept_positions", "kind",
           "read_spec", "shortest_first_pass_sequence", "uses_chat_template"]
