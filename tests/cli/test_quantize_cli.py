"""`batchrun quantize CHECKPOINT -o FILE.gguf --type ...` through the CLI: the file written and then run by `plan`
and `submit --model FILE.gguf`; refusals as one `Error:` line."""
from __future__ import annotations

import json

from batchrun.checkpoint import checkpoint_sizes
from tests.support import invoke


def test_quantize_writes_a_gguf_that_batchrun_then_runs(tmp_path, tiny_checkpoint):
    source, out = tiny_checkpoint("llama"), tmp_path / "llama.q4_0.gguf"
    result = invoke("quantize", source, "-o", out, "--type", "q4_0", "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout)
    assert written["output"] == str(out) and written["type"] == "q4_0" and written["pre_tokenizer"] == "gpt-2"
    assert written["written_bytes"] == out.stat().st_size < written["source_bytes"] / 3
    assert checkpoint_sizes(out).storage_dtype == "Q4_0"
    spec = tmp_path / "rows.jsonl"
    spec.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Review {i}: the order was late.",
                                        "choices": ["positive", "negative"]}) + "\n" for i in range(3)))
    ran = invoke("submit", spec, "--model", out, "--db", tmp_path / "jobs.db", "--calibrate", "none", "--json")
    assert ran.exit_code == 0, ran.output
    assert json.loads(ran.stdout)["rows_done"] == 3


def test_quantize_refuses_in_one_error_line(tmp_path, tiny_checkpoint):
    out = tmp_path / "taken.gguf"
    out.write_text("mine")
    result = invoke("quantize", tiny_checkpoint("llama"), "-o", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip() == f"Error: {out}: exists; pass --force to replace it"
    result = invoke("quantize", tiny_checkpoint("qwen2"), "-o", tmp_path / "qwen2.gguf", "--type", "q8_0")
    assert result.exit_code == 1 and "its NFC normalizer has no GGUF key" in result.stderr
    assert not (tmp_path / "qwen2.gguf").exists()
    result = invoke("quantize", tiny_checkpoint("qwen2"), "-o", tmp_path / "qwen2.gguf", "--allow-nfc-loss", "-q")
    assert result.exit_code == 0, result.output
    assert "as q8_0, tokenizer.ggml.pre 'qwen2'" in result.stdout
