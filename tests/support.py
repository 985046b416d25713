"""Helpers the test modules share: spec files, CLI calls and child processes, jobs and rows in a progress store,
edited copies of checkpoints, end-to-end runs checked against plain transformers, the streamed model's inputs and
in-memory logits, and the checkpoints and settings the plan tests size.

Test modules import helpers from here (or tests/reference.py, tests/tiny_models.py), never from one another, so a
test file can be split, renamed or removed without breaking another. torch and transformers load inside the
helpers that need them: spec and plan tests stay light.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from batchrun.checkpoint import sizes_from_config
from batchrun.plan import Bandwidth, PlanRequest, Rates, RowCost, make_plan
from batchrun.spec import SpecError, read_spec
from batchrun.store import RowResult, Store

if TYPE_CHECKING:
    import torch

# The checkout: test modules sit at different depths under tests/, so they find the repository's files from here.
REPO_ROOT = Path(__file__).resolve().parent.parent

# ---- spec files -------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list) -> Path:
    """`rows` as JSON lines at `path`: dicts dumped as JSON, strings written verbatim (a malformed line on
    purpose)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows),
                    encoding="utf-8")
    return path


def problems_of(path: Path, **options) -> list[str]:
    """What read_spec refuses the spec for, one line a problem."""
    with pytest.raises(SpecError) as caught:
        read_spec(path, **options)
    return caught.value.problems


def only_problem(path: Path, **options) -> str:
    problems = problems_of(path, **options)
    assert len(problems) == 1, problems
    return problems[0]


def openai_line(custom_id: str, content: str = "hi", **body) -> dict:
    """One line of an OpenAI batch file, its body's parameters overridden by `body`."""
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}}


# ---- the CLI, and Python in a child process ---------------------------------------------------------------------


def invoke(*args):
    """`batchrun ARGS...` through click's CliRunner; paths and numbers may be passed as they are."""
    from click.testing import CliRunner

    from batchrun.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def start_python(code: str, *args: str) -> subprocess.Popen:
    """`python -c CODE ARGS...` in the background, importing this checkout's batchrun, its stdin, stdout and stderr
    piped as text."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ---- the progress store -----------------------------------------------------------------------------------------

FINGERPRINT = "0123456789abcdef" + "0" * 48


def make_job(store: Store, n: int = 5, fingerprint: str = FINGERPRINT, ids=None) -> str:
    """A job of `n` rows doc-0, doc-1... (or of `ids`) recorded in `store`; its id."""
    ids = ids if ids is not None else [f"doc-{i}" for i in range(n)]
    return store.ensure_job(fingerprint, spec_path="jobs/docs.jsonl", model="tiny", settings={"max_tokens": 4},
                            rows=list(enumerate(ids)))


def answer(idx: int, row_id="x", text="yes", tokens=(5, 6)) -> RowResult:
    """Row `idx` answered: a generation that stopped."""
    return RowResult(idx=idx, id=row_id, answer=text, choice_probs=None, score=None, logprob=-0.5,
                     prompt_tokens=12, output_tokens=len(tokens), finish_reason="stop", error=None,
                     token_ids=list(tokens))


def failure(idx: int, message="prompt has 9000 tokens; the context holds 8192") -> RowResult:
    """Row `idx` failed with `message`."""
    return RowResult(idx=idx, id="x", answer=None, choice_probs=None, score=None, logprob=None,
                     prompt_tokens=None, output_tokens=None, finish_reason="error", error=message)


def integrity_ok(path: Path | str) -> bool:
    """SQLite's integrity check on a database file, opened read-only; False if missing or not a database."""
    try:
        conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return False
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    except sqlite3.DatabaseError:
        return False
    finally:
        conn.close()


# ---- edited copies of checkpoints -------------------------------------------------------------------------------


def copy_checkpoint(source: Path, target: Path, *, config: dict | None = None, weights=None,
                    chat_template: str | None = None) -> Path:
    """A copy of `source` at `target`: `config` merged into its config.json (another sliding window, say), its
    tensors passed through `weights(name, tensor)`, and/or its chat template replaced."""
    shutil.copytree(source, target)
    if config is not None:
        original = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps(original | config))
    if weights is not None:
        from safetensors.torch import load_file, save_file

        for shard in target.glob("*.safetensors"):
            tensors = {name: weights(name, t) for name, t in load_file(shard).items()}
            save_file(tensors, shard, metadata={"format": "pt"})
    if chat_template is not None:
        for name in ("chat_template.jinja", "chat_template.json"):
            (target / name).unlink(missing_ok=True)
        tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = chat_template
        (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return target


def bfloat16_copy(source: Path, target: Path) -> Path:
    """`source` stored in bfloat16 at `target`, with its tokenizer, as most open checkpoints are."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


# ---- end-to-end runs, checked against plain transformers --------------------------------------------------------

REVIEWS = [
    "The blender is loud but it crushes ice in seconds.",
    "Terrible battery, it died after two days.",
    "Lovely hotel, friendly staff and a quiet room.",
    "The app crashes whenever I open the camera.",
    "Great value for the price, I would buy it again.",
    "The soup was cold and the waiter ignored us for an hour, which ruined the evening.",
]


def choice_spec(tmp_path: Path, choices=("positive", "negative")) -> Path:
    """One choice row a review, ids r0..r5."""
    rows = [{"id": f"r{i}", "prompt": f"Review: {text}\nIs it positive or negative?", "choices": list(choices)}
            for i, text in enumerate(REVIEWS)]
    return write_jsonl(tmp_path / "choices.jsonl", rows)


def generation_spec(tmp_path: Path, max_new_tokens: int = 6) -> Path:
    """One summary a review, ids 0..5."""
    rows = [{"id": i, "prompt": f"Summarise: {text}", "max_new_tokens": max_new_tokens}
            for i, text in enumerate(REVIEWS)]
    return write_jsonl(tmp_path / "gen.jsonl", rows)


def plain_transformers(path):
    """(model, tokenizer): the plain transformers reference of the checkpoint (tests/reference.py) and its tokenizer,
    to compute expected answers independently of batchrun."""
    from transformers import AutoTokenizer

    from tests.reference import reference_model

    return reference_model(path), AutoTokenizer.from_pretrained(path)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids of `prompt` as one user message through the chat template, ready for the answer; a tokenizer
    without a template (a base model) takes the prompt raw, with its own special tokens (Gemma's BOS)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_choice_probs(model, tokenizer, prompt: str, choices) -> dict[str, float]:
    """Independent: one sequence per choice, batch of one, sum of log-probs of the choice tokens."""
    import torch

    base = prompt_ids(tokenizer, prompt)
    sums = []
    for choice in choices:
        tokens = tokenizer.encode(choice, add_special_tokens=False)
        ids = torch.tensor([base + tokens])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), -1)
        sums.append(sum(logprobs[len(base) - 1 + j, t].item() for j, t in enumerate(tokens)))
    top = max(sums)
    total = sum(math.exp(s - top) for s in sums)
    return {c: math.exp(s - top) / total for c, s in zip(choices, sums)}


def reference_generation(model, tokenizer, prompt: str, max_new_tokens: int) -> tuple[str, str]:
    """(answer, finish reason) of greedy generate() on `prompt` alone."""
    import torch

    ids = torch.tensor([prompt_ids(tokenizer, prompt)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    finish = "stop" if eos in new else "length"
    if eos in new:
        new = new[:new.index(eos)]
    return tokenizer.decode(new, skip_special_tokens=True), finish


def record_shared_prefixes(monkeypatch) -> list[int]:
    """The length of every prefix a pass shares, as the run computes it."""
    from batchrun.runtime import prefill as prefill_module

    shared_at_run = []
    real = prefill_module.SharedPrefix.__init__

    def record(self, model, prefix, device):
        shared_at_run.append(len(prefix))
        real(self, model, prefix, device)

    monkeypatch.setattr(prefill_module.SharedPrefix, "__init__", record)
    return shared_at_run


def run_job(spec: Path, tmp_path: Path, model, name: str, on_plan=None, **options):
    """(summary, answer rows): `spec` submitted with JobOptions(**options) into its own database and output."""
    import pyarrow.parquet as pq

    from batchrun.job import JobOptions, submit

    out = tmp_path / f"{name}.parquet"
    summary = submit(spec, options=JobOptions(model=str(model), **options), output=out, db=tmp_path / f"{name}.db",
                     on_plan=on_plan)
    return summary, pq.read_table(out).to_pylist()


# ---- the streamed model against the plain one in memory ---------------------------------------------------------


def sample_ids(vocab: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    """[batch, length] random token ids below `vocab`, the same every call."""
    import torch

    # longer than the tiny Gemma 3 sliding window, so windowed layers really differ from full ones
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def in_memory_logits(path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, logits): sample ids for the checkpoint at `path` and what the plain reference model gives for them."""
    import torch

    from tests.reference import reference_model

    model = reference_model(path)
    ids = sample_ids(model.config.vocab_size)
    with torch.inference_mode():
        return ids, model(ids).logits


# ---- what the plan tests size -----------------------------------------------------------------------------------

CONFIGS = Path(__file__).parent / "configs"
GiB = 1 << 30
LLAMA_70B = sizes_from_config(json.loads((CONFIGS / "llama-3-70b.json").read_text()), "BF16")
GEMMA_1B = sizes_from_config(json.loads((CONFIGS / "gemma-3-1b.json").read_text()), "BF16")
TINY = sizes_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
                          "vocab_size": 256, "max_position_embeddings": 2048, "tie_word_embeddings": True}, "F32")
MEASURED = Bandwidth(1.0e9, "measured", "sequential reads after posix_fadvise(DONTNEED) of 1 GiB")
# Choice and generation rows of several lengths, one of multi-token choices.
MIXED = [RowCost(100, 8), RowCost(50, 4), RowCost(200, 0, (1, 1)), RowCost(120, 0, (2, 3, 1)), RowCost(80, 2)]

DEFAULTS = dict(model="m", device="cpu", compute_dtype="bfloat16", memory_budget_bytes=24 * GiB, streaming="auto",
                bandwidth=MEASURED, compute_flops_per_s=4e11, disk_free_bytes=None, checkpoint_is_local=True,
                runtime_overhead_bytes=600 << 20)


def records(**overrides):
    """(PlanRequest, Rates, the job's own keywords) from one set of keywords over DEFAULTS."""
    options = DEFAULTS | overrides
    picked = [{f.name: options.pop(f.name) for f in fields(record) if f.name in options}
              for record in (PlanRequest, Rates)]
    return PlanRequest(**picked[0]), Rates(**picked[1]), options


def plan(sizes=LLAMA_70B, rows=(RowCost(300, 8),), **overrides):
    """make_plan's candidate for `rows` on `sizes`, every setting DEFAULTS' unless overridden."""
    request, rates, job = records(**overrides)
    return make_plan(sizes, list(rows), request, rates, **job)
