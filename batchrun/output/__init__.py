"""Answers out: the job's rows as the output shows them (calibrated, judged against labels) and the files they are
written to (Parquet, OpenAI Batch-format JSONL), each written atomically; and a panel of judges' combined answers.
"""
from batchrun.output.answers import (JobAnswers, OutputRow, content_free_priors, describe_calibration,
                                     describe_quality, job_answers, job_quality, output_rows, quality)
from batchrun.output.files import (CHOICE_PROBS_TYPE, OutputError, OutputExists, OutputFormatUnknown, Provenance,
                                   answers_table, atomic_write, check_output_writable, default_output_path,
                                   encode_results, job_provenance, openai_batch_line, output_format,
                                   read_parquet_results, results_table, write_jsonl, write_parquet, write_results)
from batchrun.output.pairs import PAIR_COLUMNS, PairVerdict, describe_pairs, pair_statistics
from batchrun.output.panel import (PANEL_COLUMNS, Judge, Panel, describe_panel, judge_probs, panel_figures, panel_of,
                                   panel_table, write_panel)

__all__ = ["CHOICE_PROBS_TYPE", "JobAnswers", "Judge", "OutputError", "OutputExists", "OutputFormatUnknown",
           "OutputRow", "PAIR_COLUMNS", "PANEL_COLUMNS", "PairVerdict", "Panel", "Provenance", "answers_table",
           "atomic_write", "check_output_writable", "content_free_priors", "default_output_path",
           "describe_calibration", "describe_pairs", "describe_panel", "describe_quality", "encode_results",
           "job_answers", "job_provenance", "job_quality", "judge_probs", "openai_batch_line", "output_format",
           "output_rows", "pair_statistics", "panel_figures", "panel_of", "panel_table", "quality",
           "read_parquet_results", "results_table", "write_jsonl", "write_panel", "write_parquet", "write_results"]
