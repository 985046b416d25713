"""Corrupt or hostile checkpoints are refused by `batchrun plan` and `batchrun submit` before any weight is used:
one message naming the file and the problem, no traceback, no job recorded, no output written."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Callable

import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from tests.procs import mixed_job
from tests.tiny_models import build_sharded_checkpoint


def copy_model(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def rewrite_header(shard: Path, change: Callable[[dict], None]) -> None:
    """Edit a safetensors header in place, keeping the tensor data as it is."""
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + length]), raw[8 + length:]
    change(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header to 8 bytes
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_config(model: Path, **fields) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(fields)
    (model / "config.json").write_text(json.dumps(config))


def truncated_shard(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    model = copy_model(tiny_checkpoint("llama"), tmp / "truncated")
    shard = model / "model.safetensors"
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size * 2 // 3)  # an interrupted download
    return model, str(shard), "the shard is truncated"


def offsets_past_the_end(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    model = copy_model(tiny_checkpoint("llama"), tmp / "offsets")
    shard = model / "model.safetensors"

    def push_past_the_end(header: dict) -> None:
        start, end = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [start + 10**6, end + 10**6]

    rewrite_header(shard, push_past_the_end)
    return model, str(shard), "header places tensor 'model.norm.weight' at bytes"


def missing_shard(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    # Built beside the tiny checkpoints (tiny_checkpoint("llama").parent), so it is made on a fresh cache too.
    model = copy_model(build_sharded_checkpoint("llama", tiny_checkpoint("llama").parent), tmp / "missing")
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    gone = model / sorted(set(weight_map.values()))[-1]
    gone.unlink()
    return model, str(gone), "missing; model.safetensors.index.json places tensors in it"


def layer_shape_disagrees(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    model = copy_model(tiny_checkpoint("llama"), tmp / "layer-shape")
    edit_config(model, intermediate_size=96)  # the weights have 128
    return (model, str(model / "model.safetensors"),
            "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] but config.json says "
            "intermediate_size=96")


def embedding_shape_disagrees(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    model = copy_model(tiny_checkpoint("llama"), tmp / "embedding-shape")
    edit_config(model, vocab_size=600)  # the weights have 512 rows
    return model, str(model / "model.safetensors"), "has shape [512, 64] but config.json says vocab_size=600"


def remote_code(tiny_checkpoint, tmp: Path) -> tuple[Path, str, str]:
    model = copy_model(tiny_checkpoint("llama"), tmp / "remote")
    # A model_type transformers does not ship: loading it would really run the repository's Python code.
    edit_config(model, model_type="acme_remote_lm",
                auto_map={"AutoConfig": "acme.AcmeConfig", "AutoModelForCausalLM": "acme.AcmeForCausalLM"})
    return model, str(model / "config.json"), "--trust-remote-code"


CASES = [truncated_shard, offsets_past_the_end, missing_shard, layer_shape_disagrees, embedding_shape_disagrees,
         remote_code]


@pytest.mark.parametrize("make", CASES, ids=[case.__name__ for case in CASES])
def test_plan_refuses_naming_the_file_and_the_problem(tmp_path, tiny_checkpoint, make):
    model, file, problem = make(tiny_checkpoint, tmp_path)
    spec = mixed_job(tmp_path / "job.jsonl")
    result = CliRunner().invoke(cli, ["plan", str(spec), "--model", str(model)])
    assert result.exit_code == 1, result.output  # no candidate can run the job: scripts see a failure
    assert "the checkpoint cannot be used" in result.stdout
    blocker = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("- "))
    assert file in blocker and problem in blocker, result.stdout
    report = json.loads(CliRunner().invoke(cli, ["plan", str(spec), "--model", str(model), "--json"]).stdout)
    (candidate,) = report["candidates"]
    assert candidate["fits"] is False and candidate["mode"] is None


@pytest.mark.parametrize("make", CASES, ids=[case.__name__ for case in CASES])
def test_submit_refuses_before_any_pass(tmp_path, tiny_checkpoint, make):
    model, file, problem = make(tiny_checkpoint, tmp_path)
    spec = mixed_job(tmp_path / "job.jsonl")
    db, output = tmp_path / "progress.db", tmp_path / "answers.parquet"
    result = CliRunner().invoke(cli, ["submit", str(spec), "--model", str(model), "--db", str(db),
                                      "--output", str(output), "--streaming", "always"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output  # not a crash
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert file in error and problem in error, result.stderr
    assert "Traceback" not in result.output
    assert not db.exists() and not output.exists()  # refused before a job was recorded or a weight read


def test_trusting_remote_code_lifts_the_refusal(tmp_path, tiny_checkpoint):
    model, _, _ = remote_code(tiny_checkpoint, tmp_path)
    spec = mixed_job(tmp_path / "job.jsonl")
    result = CliRunner().invoke(cli, ["plan", str(spec), "--model", str(model), "--trust-remote-code", "--json"])
    (candidate,) = json.loads(result.stdout)["candidates"]
    # Trusted, the config is read and planned like any other (the weights are the tiny llama's).
    assert candidate["mode"] is not None and candidate["blockers"] == [], candidate


def test_a_quantized_checkpoint_is_not_streamed_as_if_it_were_plain(tmp_path, tiny_checkpoint):
    """Packed weights read without their scales would give wrong answers: the plan and the streamer refuse."""
    from batchrun import StreamedModel
    from batchrun.checkpoint import CheckpointError

    model = copy_model(tiny_checkpoint("llama"), tmp_path / "fp8")
    edit_config(model, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    spec = mixed_job(tmp_path / "job.jsonl")
    result = CliRunner().invoke(cli, ["plan", str(spec), "--model", str(model), "--streaming", "always", "--json"])
    (candidate,) = json.loads(result.stdout)["candidates"]
    assert candidate["fits"] is False and any("quantized (fp8)" in b for b in candidate["blockers"]), candidate
    with pytest.raises(CheckpointError, match="quantized checkpoint \\(fp8\\)"):
        StreamedModel(model, device="cpu")
