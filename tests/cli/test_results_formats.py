"""`batchrun results` in every format, to a file or to stdout, with a summary for scripts; and the provenance a
Parquet file carries in its key-value metadata."""
from __future__ import annotations

import csv
import hashlib
import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun.host import package_version
from batchrun.output import read_parquet_results
from tests.support import invoke, write_jsonl


@pytest.fixture
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture
def done(tmp_path, model) -> dict:
    """A finished job of a choice row, a generation row and an invalid row, and its Parquet output."""
    spec = write_jsonl(tmp_path / "mixed.jsonl", [
        {"id": "a", "prompt": "Pick one, \"quoted\", please", "choices": ["x, or so", "y"]},
        {"id": "b", "prompt": "Say hello\nthen stop", "max_new_tokens": 3},
        {"id": "c", "prompt": 7}])
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "-o", tmp_path / "run.parquet",
                    "--skip-invalid", "--json", "-q")
    assert result.exit_code == 0, result.output
    return {"spec": spec, "db": tmp_path / "j.db", "parquet": tmp_path / "run.parquet",
            "job_id": json.loads(result.stdout)["job_id"]}


def test_results_csv_and_stdout(tmp_path, done):
    db = done["db"]
    rows = read_parquet_results(done["parquet"])
    written = invoke("results", "--db", db, "-o", tmp_path / "answers.csv")
    assert written.exit_code == 0 and written.stdout == f"3 rows -> {tmp_path / 'answers.csv'}\n"
    text = (tmp_path / "answers.csv").read_text(encoding="utf-8")
    records = list(csv.DictReader(io.StringIO(text)))
    assert list(records[0]) == pq.read_schema(done["parquet"]).names  # the Parquet columns, in order
    choice, generation, invalid = records
    assert json.loads(choice["choice_probs"]) == pytest.approx(rows[0]["choice_probs"])
    assert choice["answer"] == rows[0]["answer"] and float(choice["logprob"]) == pytest.approx(rows[0]["logprob"])
    assert generation["answer"] == rows[1]["answer"] and generation["choice_probs"] == ""
    assert invalid["finish_reason"] == "error" and "prompt must be a string" in invalid["error"]

    to_stdout = invoke("results", "--db", db, "-o", "-", "--format", "csv")
    assert to_stdout.exit_code == 0 and to_stdout.stdout == text  # the same bytes as the file
    assert "3 rows -> stdout" in to_stdout.stderr
    lines = invoke("results", "--db", db, "-o", "-").stdout.splitlines()  # JSONL unless told otherwise
    assert [json.loads(line)["custom_id"] for line in lines] == ["a", "b", "c"]
    parquet = invoke("results", "--db", db, "-o", "-", "--format", "parquet")  # stdout is not a terminal here
    assert pq.read_table(io.BytesIO(parquet.stdout_bytes)).equals(pq.read_table(done["parquet"]))

    summary = invoke("results", done["job_id"][:6], "--db", db, "-o", tmp_path / "again.jsonl", "--json")
    assert summary.exit_code == 0, summary.output
    assert json.loads(summary.stdout) == {"job_id": done["job_id"], "output": str(tmp_path / "again.jsonl"),
                                          "format": "jsonl", "rows": 3, "rows_total": 3,
                                          "bytes": (tmp_path / "again.jsonl").stat().st_size, "notes": []}
    both = invoke("results", "--db", db, "-o", "-", "--json")
    assert both.exit_code == 2 and "--json prints its summary on stdout" in both.stderr
    again = invoke("results", "--db", db, "-o", tmp_path / "answers.csv")
    assert again.exit_code == 1 and "--force" in again.stderr and (tmp_path / "answers.csv").read_text() == text
    contradicted = invoke("results", "--db", db, "-o", tmp_path / "x.csv", "--format", "parquet")
    assert contradicted.exit_code == 1 and "the name says csv but --format parquet" in contradicted.stderr


def test_parquet_carries_provenance(tmp_path, done, model):
    from batchrun.job import model_identity_parts

    metadata = {key.decode(): value.decode() for key, value in pq.read_metadata(done["parquet"]).metadata.items()
                if key.startswith(b"batchrun.")}
    identity = hashlib.sha256()
    for part in model_identity_parts(model):
        identity.update(part)
    assert metadata["batchrun.job_id"] == done["job_id"]
    assert metadata["batchrun.job_fingerprint"].startswith(done["job_id"])
    assert metadata["batchrun.model"] == str(model)
    assert metadata["batchrun.model_path"] == str(model.resolve())
    assert metadata["batchrun.model_fingerprint"] == identity.hexdigest()
    assert metadata["batchrun.spec_path"] == str(done["spec"].resolve())
    assert metadata["batchrun.spec_sha256"] == hashlib.sha256(done["spec"].read_bytes()).hexdigest()
    settings = json.loads(metadata["batchrun.settings"])
    assert settings["calibrate"] == "none" and settings["max_new_tokens"] == 16  # the job's settings as run
    assert metadata["batchrun.batchrun_version"] == package_version("batchrun")
    written = datetime.fromisoformat(metadata["batchrun.written_at"])
    assert abs(datetime.now(timezone.utc) - written) < timedelta(minutes=10)

    assert invoke("results", "--db", done["db"], "-o", tmp_path / "export.parquet").exit_code == 0
    exported = {key.decode(): value.decode() for key, value in
                pq.read_metadata(tmp_path / "export.parquet").metadata.items() if key.startswith(b"batchrun.")}
    exported.pop("batchrun.written_at"), metadata.pop("batchrun.written_at")
    assert exported == metadata  # an export later says what the run's own file said


def test_submit_writes_csv_as_results_does(tmp_path, done, model):
    """`submit -o FILE.csv`, which its --help names, writes the file `results -o FILE.csv` writes."""
    submitted = invoke("submit", done["spec"], "--model", model, "--db", done["db"], "-o", tmp_path / "run.csv",
                       "--skip-invalid", "-q")
    assert submitted.exit_code == 0, submitted.output
    exported = invoke("results", "--db", done["db"], "-o", tmp_path / "exported.csv")
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "run.csv").read_text(encoding="utf-8") == (tmp_path / "exported.csv").read_text(encoding="utf-8")
