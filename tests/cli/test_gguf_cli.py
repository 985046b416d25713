"""`--model FILE.gguf` through the CLI: planned from the file's index, refused by `plan` where batchrun cannot read it,
and run with the answers of the model's float32 conversion."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchrun.checkpoint import checkpoint_sizes, read_gguf_index
from tests.gguf_files import write_gguf
from tests.support import invoke

JOBS = Path(__file__).resolve().parents[2] / "jobs"


@pytest.fixture
def reviews(tmp_path) -> Path:
    """The first 8 rows of the review job: choice rows, one pass."""
    spec = tmp_path / "reviews.jsonl"
    spec.write_text("".join((JOBS / "review-sentiment.jsonl").read_text().splitlines(keepends=True)[:8]))
    return spec


def test_plan_reads_a_gguf_models_quantized_sizes(reviews, default_gguf, default_checkpoint):
    file = default_gguf[0]
    result = invoke("plan", reviews, "--model", file, "--streaming", "always", "--json")
    assert result.exit_code == 0, result.output
    (candidate,) = json.loads(result.stdout)["candidates"]
    sizes = checkpoint_sizes(file)
    assert candidate["fits"] is True and candidate["mode"] == "streamed" and candidate["compute_dtype"] == "float32"
    assert candidate["checkpoint_bytes"] == sizes.checkpoint_bytes
    assert sizes.checkpoint_bytes < checkpoint_sizes(default_checkpoint).checkpoint_bytes / 5
    assert candidate["largest_layer_bytes"] == sizes.largest_layer_bytes
    assert candidate["compute_dtype_reason"].startswith("auto: float32, in which the GGUF's dequantized weights are "
                                                        "exact")
    # a streamed head reads the tied matrix's quantized bytes each pass besides the layers
    asked = json.loads(invoke("plan", reviews, "--model", file, "--streaming", "always", "--token-matrices",
                              "streamed", "--json").stdout)["candidates"][0]
    assert asked["fits"] is True and asked["token_matrices"] == "streamed"
    assert sizes.head_bytes == sizes.embedding_bytes == read_gguf_index(file).tensors["token_embd.weight"].nbytes


def test_plan_refuses_an_unsupported_type_naming_the_tensor(tmp_path, reviews):
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": ("Q8_0", rng.integers(0, 256, (4, 34), dtype=np.uint8)),
               "blk.0.ffn_up.weight": ("IQ4_NL", rng.integers(0, 256, (4, 18), dtype=np.uint8))}
    (file,) = write_gguf(tmp_path / "iq4.gguf", tensors, metadata={"llama.block_count": 1})
    result = invoke("plan", reviews, "--model", file)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert re.search(r"iq4.gguf: the checkpoint cannot be used\n.*\n.*iq4.gguf: tensor 'blk.0.ffn_up.weight' is of "
                     r"ggml type IQ4_NL, which batchrun cannot dequantize", result.stdout), result.stdout


def test_a_job_on_the_gguf_answers_as_on_its_float32_conversion(tmp_path, reviews, default_gguf, default_checkpoint):
    file, converted = default_gguf
    runs = {}
    for name, model, streaming in (("gguf streamed", file, "always"), ("gguf resident", file, "never"),
                                   ("converted", converted, "never")):
        out = tmp_path / f"{name}.parquet"
        result = invoke("submit", reviews, "--model", model, "--db", tmp_path / f"{name}.db", "--output", out,
                        "--streaming", streaming, "--dtype", "float32", "--calibrate", "none", "--json")
        assert result.exit_code == 0, result.output
        runs[name] = (json.loads(result.stdout), pq.read_table(out).to_pydict())
    expected = runs["converted"][1]
    for name in ("gguf streamed", "gguf resident"):
        answers = runs[name][1]
        assert answers["answer"] == expected["answer"] and answers["choice_probs"] == expected["choice_probs"], name
    # the job names the bytes it ran on: the GGUF's job is another than the conversion's
    assert runs["gguf streamed"][0]["job_id"] == runs["gguf resident"][0]["job_id"] != runs["converted"][0]["job_id"]
