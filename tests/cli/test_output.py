"""Answers out: Parquet schema and order, OpenAI Batch JSONL, no silent overwrite, atomic writes on a full disk."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.output import (
    OutputError,
    OutputExists,
    atomic_write,
    default_output_path,
    read_parquet_results,
    write_jsonl,
    write_parquet,
)
from batchrun.store import RowResult
from tests.support import REPO_ROOT


def generated(idx: int, row_id, text: str = "Paris", reason: str = "stop") -> RowResult:
    return RowResult(idx=idx, id=row_id, answer=text, choice_probs=None, score=None, logprob=-1.25,
                     prompt_tokens=20, output_tokens=3, finish_reason=reason, error=None)


def chosen(idx: int, row_id) -> RowResult:
    return RowResult(idx=idx, id=row_id, answer="positive", choice_probs={"positive": 0.75, "negative": 0.25},
                     score=0.75, logprob=-0.29, prompt_tokens=40, output_tokens=None, finish_reason="choice",
                     error=None)


def failed(idx: int, row_id) -> RowResult:
    return RowResult(idx=idx, id=row_id, answer=None, choice_probs=None, score=None, logprob=None,
                     prompt_tokens=None, output_tokens=None, finish_reason="error",
                     error="prompt has 9000 tokens; the context holds 8192")


def write_answers(path: Path, writer: str, results, *, force: bool = False) -> Path:
    if writer == "parquet":
        return write_parquet(path, results, force=force)
    return write_jsonl(path, results, model="m", force=force)


def test_default_output_path_sits_beside_the_spec():
    assert default_output_path(Path("/data/reviews.jsonl")) == Path("/data/reviews.answers.parquet")


def test_parquet_columns_types_and_input_order(tmp_path):
    path = write_parquet(tmp_path / "out.parquet", [failed(2, 30), chosen(1, 20), generated(0, 10)])
    schema = pq.read_schema(path)
    assert schema.names == ["id", "answer", "choice_probs", "calibrated_probs", "score", "logprob", "prompt_tokens",
                            "output_tokens", "finish_reason", "error", "label", "correct"]
    assert schema.field("id").type == pa.int64()
    assert schema.field("choice_probs").type == pa.map_(pa.string(), pa.float64())
    assert schema.field("prompt_tokens").type == pa.int64() and schema.field("score").type == pa.float64()
    rows = read_parquet_results(path)
    assert [row["id"] for row in rows] == [10, 20, 30]
    assert rows[0]["choice_probs"] is None and rows[0]["answer"] == "Paris"
    assert rows[1]["choice_probs"] == {"positive": 0.75, "negative": 0.25} and rows[1]["output_tokens"] is None
    assert rows[2]["finish_reason"] == "error" and rows[2]["error"].startswith("prompt has 9000 tokens")


def test_parquet_ids_become_strings_when_any_id_is_a_string(tmp_path):
    path = write_parquet(tmp_path / "out.parquet", [generated(0, 7), generated(1, "doc-b")])
    assert pq.read_schema(path).field("id").type == pa.string()
    assert [row["id"] for row in read_parquet_results(path)] == ["7", "doc-b"]


@pytest.mark.parametrize("writer", ["parquet", "jsonl"])
def test_an_existing_file_is_replaced_only_with_force(tmp_path, writer):
    path = tmp_path / f"answers.{writer}"
    path.write_bytes(b"yesterday's answers")
    with pytest.raises(OutputExists, match=f"{path.name} exists; pass --force to overwrite"):
        write_answers(path, writer, [generated(0, 1)])
    assert path.read_bytes() == b"yesterday's answers"
    write_answers(path, writer, [generated(0, 1)], force=True)
    assert path.read_bytes() != b"yesterday's answers"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left behind


def test_jsonl_follows_the_openai_batch_output_format(tmp_path):
    path = write_jsonl(tmp_path / "out.jsonl", [failed(2, "c"), chosen(1, 2), generated(0, "a", reason="length")],
                       model="SmolLM2-135M-Instruct")
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [line["custom_id"] for line in lines] == ["a", "2", "c"]
    assert len({line["id"] for line in lines}) == 3 and all(line["id"].startswith("batch_req_") for line in lines)

    generation = lines[0]
    assert generation["error"] is None and generation["response"]["status_code"] == 200
    body = generation["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Paris"},
                                "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}
    assert "choice_probs" not in body and "score" not in body and body["logprob"] == -1.25

    choice_body = lines[1]["response"]["body"]
    assert choice_body["choices"][0]["message"]["content"] == "positive"
    assert choice_body["choices"][0]["finish_reason"] == "stop"
    assert choice_body["choice_probs"] == {"positive": 0.75, "negative": 0.25}
    assert (choice_body["score"], choice_body["logprob"]) == (0.75, -0.29)  # what the Parquet columns carry

    assert lines[2]["response"] is None
    assert lines[2]["error"] == {"code": "row_failed", "message": "prompt has 9000 tokens; the context holds 8192"}


def test_a_failing_writer_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "answers.parquet"
    path.write_text("old")

    def write_half_then_fail(temp: Path) -> None:
        temp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="answers.parquet.*No space left on device"):
        atomic_write(path, write_half_then_fail, force=True)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["answers.parquet"]


FILL_DISK = """
    import os, resource, signal, sys
    from pathlib import Path
    from batchrun.output import OutputError, write_jsonl, write_parquet
    from batchrun.store import RowResult
    path, writer = Path(sys.argv[1]), sys.argv[2]
    # Random text does not compress: 300 rows x 8 KB is ~2.4 MB against a 256 KB file-size limit.
    rows = [RowResult(i, i, os.urandom(4096).hex(), None, None, None, 1, 1, "stop", None) for i in range(300)]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so write() fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    try:
        if writer == "parquet":
            write_parquet(path, rows, force=True)
        else:
            write_jsonl(path, rows, model="m", force=True)
    except OutputError as error:
        print(error)
        sys.exit(0)
    sys.exit("the oversized write did not fail")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("writer", ["parquet", "jsonl"])
def test_a_full_disk_raises_output_error_and_keeps_the_previous_file(tmp_path, writer):
    path = tmp_path / f"answers.{writer}"
    write_answers(path, writer, [generated(0, 1, text="kept")])
    before = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    filler = subprocess.run([sys.executable, "-c", textwrap.dedent(FILL_DISK), str(path), writer],
                            env=env, capture_output=True, text=True, timeout=60)
    assert filler.returncode == 0, filler.stderr
    assert str(path) in filler.stdout and "previous file, if any, is unchanged" in filler.stdout
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
