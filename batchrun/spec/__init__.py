"""Job specs: reading JSONL / Parquet / OpenAI batch lines, validating rows, templates, and encoding prompts into
token ids. No torch.
"""
from batchrun.spec.content_free import CONTENT_FREE_VALUES, content_free_rows
from batchrun.spec.encode import (TRUNCATE_SIDES, EncodedRow, choice_sequences, encode_requests, kept_positions,
                                  shortest_first_pass_sequence, uses_chat_template)
from batchrun.spec.files import kind
from batchrun.spec.pairs import PAIR_LABELS, PairOrder
from batchrun.spec.read import JobSpec, SpecSettings, read_spec
from batchrun.spec.rows import Request
from batchrun.spec.structure import Structure, sample_instance, structure_problem
from batchrun.spec.template import SpecError
from batchrun.spec.verdicts import Verdict, cued_answer, verdict_request

__all__ = ["CONTENT_FREE_VALUES", "TRUNCATE_SIDES", "EncodedRow", "JobSpec", "PAIR_LABELS", "PairOrder",
           "Request", "SpecError", "SpecSettings", "Structure", "Verdict",
           "choice_sequences", "content_free_rows", "cued_answer", "encode_requests", "kept_positions", "kind",
           "read_spec", "sample_instance", "shortest_first_pass_sequence", "structure_problem", "uses_chat_template",
           "verdict_request"]
