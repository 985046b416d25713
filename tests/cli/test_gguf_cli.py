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
        # one batch size for the three: the plan's own choice follows the memory free at the time, and rows batched
        # with other rows (other padding, other matrix shapes) may differ in the last bits
        result = invoke("submit", reviews, "--model", model, "--db", tmp_path / f"{name}.db", "--output", out,
                        "--streaming", streaming, "--dtype", "float32", "--calibrate", "none", "--batch-size", "8",
                        "--json")
        assert result.exit_code == 0, result.output
        runs[name] = (json.loads(result.stdout), pq.read_table(out).to_pydict())
    expected = runs["converted"][1]
    for name in ("gguf streamed", "gguf resident"):
        answers = runs[name][1]
        assert answers["answer"] == expected["answer"] and answers["choice_probs"] == expected["choice_probs"], name
    # the job names the bytes it ran on: the GGUF's job is another than the conversion's
    assert runs["gguf streamed"][0]["job_id"] == runs["gguf resident"][0]["job_id"] != runs["converted"][0]["job_id"]


def test_plan_of_the_default_model_runs_its_gguf_and_says_why_float32(reviews, default_by_name):
    result = invoke("plan", reviews, "--json")
    assert result.exit_code == 0, result.output
    (candidate,) = json.loads(result.stdout)["candidates"]
    assert candidate["model"] == "default (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    assert candidate["checkpoint_bytes"] == checkpoint_sizes(default_by_name).checkpoint_bytes
    assert candidate["compute_dtype"] == "float32"
    assert candidate["compute_dtype_reason"].startswith("auto: float32, in which the GGUF's dequantized weights are "
                                                        "exact")
    table = invoke("plan", reviews, "--model", "smollm2-135m").stdout
    assert "model           default (SmolLM2-135M-Instruct, Q4_1 GGUF)" in table
    assert "(auto: float32, in which the GGUF's dequantized weights are exact" in table


def test_plan_of_default_converted_runs_the_default_models_conversion(reviews, default_by_name, default_checkpoint):
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL

    (default_by_name.parent.parent / DEFAULT_REGISTRY_MODEL.directory).symlink_to(default_checkpoint,
                                                                                  target_is_directory=True)
    result = invoke("plan", reviews, "--model", "default:converted", "--json")
    assert result.exit_code == 0, result.output
    (candidate,) = json.loads(result.stdout)["candidates"]
    assert candidate["model"] == "smollm2-135m:converted (SmolLM2-135M-Instruct, float32 conversion)"
    assert candidate["checkpoint_bytes"] == checkpoint_sizes(default_checkpoint).checkpoint_bytes


def test_a_job_begun_on_the_conversion_is_not_resumed_on_the_gguf_and_the_run_says_so(
        reviews, default_by_name, default_checkpoint, tmp_path, monkeypatch):
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL
    from batchrun.host import faults

    models = default_by_name.parent.parent
    (models / DEFAULT_REGISTRY_MODEL.directory).symlink_to(default_checkpoint, target_is_directory=True)
    db = tmp_path / "j.db"
    reached = faults.reached

    def interrupted_after_the_first_commit(point: str) -> None:
        reached(point)
        if point == "committed":
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # a run on the conversion stopped after its first pass (4 of 8 rows)
        patch.setattr(faults, "reached", interrupted_after_the_first_commit)
        stopped = invoke("submit", reviews, "--model", "smollm2-135m:converted", "--db", db, "--batch-size", 4,
                         "-o", tmp_path / "converted.parquet", "--json")
    assert stopped.exit_code == 130, stopped.output

    on_gguf = invoke("submit", reviews, "--db", db, "-o", tmp_path / "gguf.parquet", "--json")
    assert on_gguf.exit_code == 0, on_gguf.output
    summary = json.loads(on_gguf.stdout)
    first = invoke("jobs", "--db", db, "--json")
    converted_job = next(job for job in json.loads(first.stdout) if job["id"] != summary["job_id"])
    assert converted_job["rows_pending"] == 4 and summary["rows_done"] == 8  # a job of its own, from scratch
    assert (f"job {converted_job['id']} of this spec ran on smollm2-135m:converted (SmolLM2-135M-Instruct, float32 "
            f"conversion) and has 4 row(s) pending; this run is another job ({summary['job_id']}, on default "
            f"(SmolLM2-135M-Instruct, Q4_1 GGUF)) and starts afresh: `--model smollm2-135m:converted` resumes that "
            "one") in summary["notes"]
    provenance = pq.read_metadata(tmp_path / "gguf.parquet").metadata  # the answers name the file they came from
    assert str(default_by_name.resolve()).encode() in b"".join(provenance.values())

    resumed = invoke("submit", reviews, "--model", "smollm2-135m:converted", "--db", db, "--json",
                     "-o", tmp_path / "converted.parquet")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["job_id"] == converted_job["id"]
    answers = [pq.read_table(tmp_path / f"{name}.parquet").column("answer").to_pylist()
               for name in ("converted", "gguf")]
    assert answers[0] == answers[1]

