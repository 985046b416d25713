"""Documented `batchrun` options run end to end through click's CliRunner on a tiny checkpoint: each changes what
its help says it changes, and the answers a user gets stay those of the plain run."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import Result

from batchrun.runtime import open_model
from tests.support import invoke, write_jsonl

REVIEWS = ["great soup, friendly staff", "the parcel came late and broken", "fair price for what it is",
           "too loud to talk", "the app crashes when I open it", "lovely quiet room"]


@pytest.fixture
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture
def spec(tmp_path) -> Path:
    """Generation rows of similar length (so a pass can put several in one forward call) and a choice row."""
    rows = [{"id": f"g{i}", "prompt": f"Summarise: {text}", "max_new_tokens": 4} for i, text in enumerate(REVIEWS)]
    rows.append({"id": "c", "prompt": "Is it positive? great soup", "choices": ["yes", "no"]})
    return write_jsonl(tmp_path / "notes.jsonl", rows)


def run(spec: Path, model: Path, tmp_path: Path, name: str, *options) -> tuple[Result, dict]:
    """Submit `spec` with `options` into its own database; the exit status and the answers by id."""
    out = tmp_path / f"{name}.parquet"
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / f"{name}.db", "--output", out, *options)
    assert result.exit_code == 0, result.output
    return result, {row["id"]: row for row in pq.read_table(out).to_pylist()}


def assert_same_answers(got: dict, expected: dict) -> None:
    """The same texts, finish reasons and token counts; log-probs and choice probabilities to float32 rounding
    (another micro-batching or read-ahead changes the order of additions, not the answer)."""
    assert list(got) == list(expected)
    for row_id, row in got.items():
        want = expected[row_id]
        assert row["error"] is None and want["error"] is None
        for key in ("answer", "finish_reason", "output_tokens", "prompt_tokens"):
            assert row[key] == want[key], (row_id, key)
        assert row["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        if want["choice_probs"] is not None:
            assert dict(row["choice_probs"]) == pytest.approx(dict(want["choice_probs"]), abs=1e-5)


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every model the run opens (execute.open_model), to read what it was built with after the run."""
    real = open_model
    handles: list = []
    monkeypatch.setattr("batchrun.job.execute.open_model", lambda *a, **k: handles.append(real(*a, **k)) or handles[-1])
    return handles


# ---- --bandwidth -----------------------------------------------------------------------------------------------


def test_a_declared_bandwidth_is_what_the_plan_uses_even_over_a_measured_one(tmp_path, spec, model):
    checkpoint = Path(shutil.copytree(model, tmp_path / "checkpoint"))
    measured = invoke("disk", "--model", checkpoint, "--json")  # a cached measurement of this disk...
    assert measured.exit_code == 0, measured.output
    assert json.loads(measured.stdout)["basis"] == "measured"

    plans = {}
    for declared in ("2.5", "0.25"):
        result = invoke("plan", spec, "--model", checkpoint, "--streaming", "always", "--bandwidth", declared, "--json")
        assert result.exit_code == 0, result.output
        plans[declared] = json.loads(result.stdout)["candidates"][0]
    # ...gives way to the declaration
    assert plans["2.5"]["read_bandwidth_bytes_per_s"] == 2.5e9 and plans["2.5"]["bandwidth_basis"] == "declared"
    assert plans["0.25"]["read_bandwidth_bytes_per_s"] == 0.25e9
    assert "--bandwidth" in plans["2.5"]["bandwidth_how"]
    # the plan's read time of a streamed pass follows the declared speed
    assert plans["0.25"]["io_seconds_per_pass"] > plans["2.5"]["io_seconds_per_pass"] > 0

    text = invoke("plan", spec, "--model", checkpoint, "--streaming", "always", "--bandwidth", "2.5")
    assert re.search(r"^read bandwidth\s+2\.50 GB/s \(declared", text.stdout + text.stderr, re.M), text.output


def test_submit_with_a_declared_bandwidth_shows_it_in_the_plan_and_answers_as_without(tmp_path, spec, model):
    _, plain = run(spec, model, tmp_path, "plain", "--streaming", "always")
    declared, answers = run(spec, model, tmp_path, "declared", "--streaming", "always", "--bandwidth", "2.5")
    assert re.search(r"^read bandwidth\s+2\.50 GB/s \(declared", declared.stderr, re.M), declared.stderr
    assert_same_answers(answers, plain)


# ---- --no-prefetch, --prefetch-depth, --micro-batch ------------------------------------------------------------


def test_no_prefetch_streams_one_layer_at_a_time_with_the_same_answers(tmp_path, spec, model, opened):
    _, plain = run(spec, model, tmp_path, "plain", "--streaming", "always")
    assert opened[-1].prefetching and opened[-1].peak_materialised_layers == 2  # the default reads one ahead
    result, answers = run(spec, model, tmp_path, "no-prefetch", "--streaming", "always", "--no-prefetch")
    handle = opened[-1]
    assert not handle.prefetching and handle.prefetch_depth == 0
    assert handle.peak_materialised_layers == 1  # what the option is for: one layer in memory, none read ahead
    assert not re.search(r"^read ahead", result.stderr, re.M)  # the plan printed counts no read-ahead either
    assert_same_answers(answers, plain)


def test_a_deeper_read_ahead_is_planned_and_run_with_the_same_answers(tmp_path, spec, model, opened):
    _, plain = run(spec, model, tmp_path, "plain", "--streaming", "always")
    result, answers = run(spec, model, tmp_path, "depth-2", "--streaming", "always", "--prefetch-depth", "2")
    assert re.search(r"^read ahead\s+2 layers", result.stderr, re.M), result.stderr
    assert opened[-1].prefetch_depth == 2
    assert_same_answers(answers, plain)


def test_token_matrices_streamed_is_planned_and_run_with_the_same_answers(tmp_path, spec, model, opened):
    _, plain = run(spec, model, tmp_path, "plain", "--streaming", "always", "--token-matrices", "held")
    result, answers = run(spec, model, tmp_path, "streamed", "--streaming", "always", "--token-matrices", "streamed")
    assert re.search(r"^token matrices\s+streamed \(asked\)", result.stderr, re.M), result.stderr
    floor = re.search(r"^floor\s+(.*)$", result.stderr, re.M).group(1)
    assert "head chunk" in floor and "embedding" not in floor
    handle = opened[-1]
    assert handle.matrices.head is not None and handle.matrices.gathered is not None  # neither matrix held
    assert_same_answers(answers, plain)
    refused = invoke("plan", spec, "--model", model, "--token-matrices", "some")
    assert refused.exit_code == 2 and "--token-matrices" in refused.output


def test_micro_batch_one_prefills_each_sequence_in_its_own_forward_call_with_the_same_answers(tmp_path, spec, model,
                                                                                               monkeypatch):
    """--micro-batch sets the sequences per prefill (and choice scoring) call; decode steps, one token per sequence,
    keep the plan's decode micro-batches."""
    widths: list[list[int]] = []
    real = open_model

    def spied(*args, **kwargs):
        handle = real(*args, **kwargs)
        seen: list[int] = []
        widths.append(seen)

        def record(module, positional, named):
            hidden = positional[0] if positional else named["hidden_states"]
            if hidden.shape[1] > 1:  # a call over prompt tokens, not a decode step
                seen.append(hidden.shape[0])

        handle.layers[0].register_forward_pre_hook(record, with_kwargs=True)
        return handle

    monkeypatch.setattr("batchrun.job.execute.open_model", spied)
    _, plain = run(spec, model, tmp_path, "plain")
    _, answers = run(spec, model, tmp_path, "micro-1", "--micro-batch", "1")
    default_widths, micro_widths = widths
    assert max(default_widths) > 1  # the plain run prefills several sequences in one call...
    assert len(micro_widths) > len(default_widths) and set(micro_widths) == {1}  # ...--micro-batch 1 never does
    assert_same_answers(answers, plain)


# ---- -q ----------------------------------------------------------------------------------------------------------


def test_the_short_quiet_flag_prints_neither_plan_nor_progress_bar(tmp_path, spec, model):
    loud, _ = run(spec, model, tmp_path, "loud")
    job = loud.stdout.split()[1].rstrip(":")
    assert f"batchrun {job[:8]}" in loud.stderr and "lower bound" in loud.stderr  # what -q leaves out...
    quiet, _ = run(spec, model, tmp_path, "quiet", "-q")
    assert f"batchrun {job[:8]}" not in quiet.stderr and "lower bound" not in quiet.stderr  # ...both
    assert not re.search(r"^(passes|compute|memory)\s", quiet.stderr, re.M)
    assert re.fullmatch(rf"job {job}: 7 answered, 0 errored of 7; .+ -> .+quiet\.parquet\n", quiet.stdout)


# ---- corpus mode -------------------------------------------------------------------------------------------------


CORPUS = {"id": ["a7", "b3", "c9", "d1"], "text": REVIEWS[:4], "stars": [5, 1, 3, 2]}


def write_corpus(path: Path) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.table(CORPUS), path)
        return path
    rows = [dict(zip(CORPUS, values)) for values in zip(*CORPUS.values())]
    return write_jsonl(path, rows)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_corpus_mode_through_submit_keys_answers_by_the_id_column(tmp_path, model, suffix):
    """A table of columns, a template and an id column: one row per record, answered as the prompt the template
    makes from it, under the record's own id and in the table's order."""
    corpus = write_corpus(tmp_path / f"reviews{suffix}")
    _, answers = run(corpus, model, tmp_path, "corpus", "--template", "Review: {text}", "--id-column", "id",
                     "--max-new-tokens", "4")
    assert list(answers) == CORPUS["id"]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"id": row_id, "prompt": f"Review: {text}", "max_new_tokens": 4}
                                                       for row_id, text in zip(CORPUS["id"], CORPUS["text"])])
    _, expected = run(prompts, model, tmp_path, "prompts")
    assert_same_answers(answers, expected)


# ---- where state lives without BATCHRUN_HOME -------------------------------------------------------------------


@pytest.mark.parametrize("fallback", ["xdg", "home"])
def test_without_batchrun_home_jobs_and_submit_use_the_users_cache_directory(tmp_path, spec, model, monkeypatch,
                                                                              machine_measurements, fallback):
    """BATCHRUN_HOME unset: $XDG_CACHE_HOME/batchrun, or ~/.cache/batchrun where XDG_CACHE_HOME is unset too."""
    home = tmp_path / "user"
    monkeypatch.delenv("BATCHRUN_HOME")
    monkeypatch.setenv("HOME", str(home))
    if fallback == "xdg":
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        state, elsewhere = tmp_path / "xdg" / "batchrun", home / ".cache" / "batchrun"
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        state, elsewhere = home / ".cache" / "batchrun", tmp_path / "xdg"

    listing = invoke("jobs")
    assert listing.exit_code == 0 and listing.stdout == "no jobs yet\n"
    assert not state.exists()  # listing reads; it creates no state directory

    # the session's machine measurements, so the run does not spend seconds measuring them again
    state.mkdir(parents=True)
    shutil.copy(machine_measurements, state / machine_measurements.name)
    submitted = invoke("submit", spec, "--model", model, "--output", tmp_path / "a.parquet", "--json", "-q")
    assert submitted.exit_code == 0, submitted.output
    job = json.loads(submitted.stdout)["job_id"]
    assert (state / "batchrun.db").is_file() and not elsewhere.exists()

    listing = invoke("jobs")
    assert listing.exit_code == 0 and re.search(rf"^{job}\s+done\s+7/7\s", listing.stdout, re.M), listing.output
    status = invoke("status")
    assert status.exit_code == 0 and f"job {job}: done" in status.stdout
