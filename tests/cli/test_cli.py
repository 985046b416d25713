"""Every `batchrun` command through click's CliRunner: what a user types and what they read back."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchrun.output import read_parquet_results
from batchrun.store import Store
from tests.support import copy_checkpoint, invoke, write_jsonl

PROMPTS = ["Summarise: the parcel came late.", "Summarise: great soup.", "Summarise: the app crashes.",
           "Summarise: friendly staff.", "Summarise: too loud.", "Summarise: fair price."]
PLAN_KEYS = ("rows", "invalid_rows", "prompt_tokens_total", "prompt_tokens_max", "new_tokens_max", "candidates")
CANDIDATE_KEYS = (
    "model", "mode", "reason", "checkpoint_bytes", "layers", "largest_layer_bytes", "non_decoder_bytes",
    "kv_bytes_per_token", "compute_dtype", "memory_budget_bytes", "peak_memory_bytes", "batch_size", "passes",
    "read_bandwidth_bytes_per_s", "bandwidth_basis", "seconds_per_pass", "eta_seconds", "eta_human",
    "disk_free_bytes", "fits", "blockers", "caveats", "linear_kernel",
)


@pytest.fixture
def spec(tmp_path) -> Path:
    return write_jsonl(tmp_path / "notes.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 4}
                                                  for i, p in enumerate(PROMPTS)])


@pytest.fixture
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


def submitted(spec: Path, model: Path, db: Path, *extra) -> dict:
    """Run a job to the end and return its JSON summary."""
    result = invoke("submit", spec, "--model", model, "--db", db, "--json", *extra)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---- submit --------------------------------------------------------------------------------------------


def test_submit_prints_plan_progress_and_a_one_line_summary(tmp_path, spec, model):
    out = tmp_path / "answers.parquet"
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--output", out)
    assert result.exit_code == 0, result.output
    summary = re.fullmatch(r"job ([0-9a-f]{16}): 6 answered, 0 errored of 6; 6 computed now in (\d+) pass(?:es)?, "
                           r"[0-9.]+ s -> (.+)\n", result.stdout)
    assert summary, result.stdout
    assert Path(summary.group(3)) == out and pq.read_table(out).num_rows == 6
    assert re.search(r"^passes\s+\d+ \(lower bound \d+\)", result.stderr, re.M)  # the plan, before the run
    assert re.search(r"^compute\s+float32 on cpu, (aten|onednn) linears$", result.stderr, re.M)
    assert f"batchrun {summary.group(1)[:8]}" in result.stderr  # the progress bar


def test_submit_json_summary(tmp_path, spec, model):
    out = tmp_path / "answers.parquet"
    summary = submitted(spec, model, tmp_path / "j.db", "--output", out, "--batch-size", "2")
    assert (summary["state"], summary["rows_total"], summary["rows_done"], summary["rows_errored"]) == ("done", 6, 6, 0)
    assert summary["rows_computed_now"] == 6
    assert 3 <= summary["passes_now"] <= 3 * 4  # 3 batches of 2 rows, each at most 4 passes (4 new tokens)
    assert summary["batch_size"] == 2 and summary["mode"] == "resident"
    assert summary["output"] == str(out) and summary["notes"] == []
    assert re.fullmatch(r"[0-9a-f]{16}", summary["job_id"])


def test_submit_quiet_prints_only_the_summary(tmp_path, spec, model):
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--quiet",
                    "--output", tmp_path / "a.parquet")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("job ") and result.stdout.count("\n") == 1
    assert "lower bound" not in result.stderr and "batchrun " not in result.stderr


def test_submit_refuses_to_overwrite_output_without_force(tmp_path, spec, model):
    out = tmp_path / "answers.parquet"
    out.write_bytes(b"yesterday's answers")
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--output", out)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "--force" in result.stderr and str(out) in result.stderr
    assert "Traceback" not in result.output
    assert out.read_bytes() == b"yesterday's answers"
    assert invoke("jobs", "--db", tmp_path / "j.db").stdout == "no jobs yet\n"  # a refused new job leaves no trace
    forced = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--output", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert pq.read_table(out).num_rows == 6


def test_an_unwritable_output_is_refused_before_the_run(tmp_path, spec, model):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for output, reason in ((blocker / "answers.parquet", f"{blocker} is a file, not a directory"),
                           (blocker / "deeper" / "answers.parquet", f"{blocker} is a file, not a directory"),
                           (tmp_path, "it is a directory"), (spec, "it is the job spec itself"),
                           (tmp_path / "answers.xlsx", "cannot tell the format from the extension")):
        result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--output", output)
        assert result.exit_code == 1 and result.stderr.startswith(f"Error: {output}"[:7]), result.output
        assert reason in result.stderr and "Traceback" not in result.output
        assert "lower bound" not in result.stderr  # refused before the plan, so before any work
    assert not (tmp_path / "j.db").exists()
    bad_spec = write_jsonl(tmp_path / "bad.jsonl", ["not json"])  # refused after the output check: no trace left
    refused = invoke("submit", bad_spec, "--model", model, "--db", tmp_path / "j.db", "-o", tmp_path / "new" / "a.pq")
    assert refused.exit_code == 1 and not (tmp_path / "new").exists()


def test_the_jobs_own_spec_and_database_are_never_an_output_even_with_force(tmp_path, spec, model):
    db = tmp_path / "j.db"
    refused = invoke("submit", spec, "--model", model, "--db", db, "-o", db, "--force")
    assert refused.exit_code == 1 and "it is the job database" in refused.stderr, refused.output
    assert not db.exists()  # refused before any work
    done = submitted(spec, model, db)
    spec_bytes, db_bytes = spec.read_bytes(), db.read_bytes()
    for output, reason in ((spec, "it is the job spec itself"), (db, "it is the job database"),
                           (Path(f"{db}-wal"), "it is the job database")):
        result = invoke("results", done["job_id"], "--db", db, "-o", output, "--force", "--format", "jsonl")
        assert result.exit_code == 1 and reason in result.stderr, result.output
    assert spec.read_bytes() == spec_bytes and db.read_bytes() == db_bytes


def test_status_says_why_a_job_failed(tmp_path, spec, model):
    """The morning after, the terminal that showed the error is gone: status keeps the reason."""
    failed = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--memory", "0.001")
    assert failed.exit_code == 1 and "the plan refuses this job" in failed.stderr
    status = invoke("status", "--db", tmp_path / "j.db")
    assert re.search(r"^job [0-9a-f]{16}: failed$", status.stdout, re.M), status.stdout
    assert re.search(r"^  failed   PlanRefused: the plan refuses this job: does not fit", status.stdout, re.M)
    done = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db")
    assert done.exit_code == 0
    assert "failed " not in invoke("status", "--db", tmp_path / "j.db").stdout  # the last run's, not history


def test_results_know_the_jobs_spec_from_any_directory(tmp_path, model, monkeypatch):
    """A spec given as a relative path is the file in the directory submit ran in, not in the one results runs in."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "a" / "job.jsonl", [{"id": 1, "prompt": "Summarise: hi", "max_new_tokens": 2}])
    monkeypatch.chdir(tmp_path / "a")
    assert invoke("submit", "job.jsonl", "--model", model, "--db", tmp_path / "j.db").exit_code == 0
    monkeypatch.chdir(tmp_path / "b")
    elsewhere = invoke("results", "--db", tmp_path / "j.db", "-o", "job.jsonl")
    assert elsewhere.exit_code == 0, elsewhere.output  # b/job.jsonl is another file
    spec_bytes = (tmp_path / "a" / "job.jsonl").read_bytes()
    real = invoke("results", "--db", tmp_path / "j.db", "-o", "../a/job.jsonl", "--force")
    assert real.exit_code == 1 and "it is the job spec itself" in real.stderr
    assert (tmp_path / "a" / "job.jsonl").read_bytes() == spec_bytes


def test_results_refuse_a_format_the_file_name_contradicts(tmp_path, spec, model):
    done = submitted(spec, model, tmp_path / "j.db")
    result = invoke("results", done["job_id"], "--db", tmp_path / "j.db", "-o", tmp_path / "a.parquet",
                    "--format", "jsonl")
    assert result.exit_code == 1 and "the name says parquet but --format jsonl" in result.stderr, result.output
    assert not (tmp_path / "a.parquet").exists()
    ok = invoke("results", done["job_id"], "--db", tmp_path / "j.db", "-o", tmp_path / "a.txt", "--format", "jsonl")
    assert ok.exit_code == 0 and (tmp_path / "a.txt").read_text().count("\n") == 6


def test_submit_writes_openai_batch_jsonl_for_a_jsonl_name(tmp_path, spec, model):
    out = tmp_path / "answers.JSONL"
    submitted(spec, model, tmp_path / "j.db", "--output", out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [str(i) for i in range(6)]
    assert all(line["response"]["status_code"] == 200 for line in lines)


def test_a_failed_write_after_the_run_keeps_the_job_done_and_says_where_the_answers_are(tmp_path, spec, model,
                                                                                      monkeypatch):
    from batchrun import output

    def disk_full(path, write, *, force=False):
        raise output.OutputError(path, "No space left on device")

    monkeypatch.setattr("batchrun.output.files.atomic_write", disk_full)
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "--output", tmp_path / "a.parquet")
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    # the export command names the database it was given, so it works when copied
    job_id = re.search(rf"`batchrun results ([0-9a-f]{{16}}) --db {re.escape(str(tmp_path / 'j.db'))} -o FILE`",
                       result.stderr).group(1)
    status = json.loads(invoke("status", "--db", tmp_path / "j.db", "--json").stdout)
    assert (status["id"], status["state"], status["rows_done"]) == (job_id, "done", 6)


def test_typed_escapes_in_stop_strings_mean_what_they_do_in_a_json_spec(spec, model, monkeypatch):
    """`--stop "\\n"` in a shell passes a backslash and an n: it must stop at a newline, as "\\n" does in JSONL. A
    template or system message keeps its backslashes (LaTeX, Windows paths), with a warning for a typed \\n."""
    seen = {}

    def capture(spec_path, *, options, **kw):
        seen["options"] = options
        raise KeyboardInterrupt  # as if Ctrl-C came during the run

    monkeypatch.setattr("batchrun.job.execute.submit", capture)
    result = invoke("submit", spec, "--model", model, "--stop", "\\n", "--stop", "a\\\\nb\\q", "--system",
                    "C:\\temp", "--template", "$\\theta$ {text}\\nIs it positive?")
    options = seen["options"]
    assert options.stop == ("\n", "a\\nb\\q")  # a typed double backslash is one; an unknown escape stays
    assert options.system == "C:\\temp" and options.template == "$\\theta$ {text}\\nIs it positive?"
    assert "Warning: --template holds a backslash followed by n, kept as typed" in result.stderr
    assert "--system holds" not in result.stderr
    assert result.exit_code == 130 and "Interrupted; committed passes are kept" in result.stderr
    assert "Traceback" not in result.output and "Aborted" not in result.output


def test_submit_bad_spec_lists_every_bad_row_and_runs_nothing(tmp_path, model):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"id": 1, "prompt": "fine"}, {"id": 2}, "not json",
                                               {"id": 3, "prompt": "x", "choices": []}])
    result = invoke("submit", bad, "--model", model, "--db", tmp_path / "j.db")
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    for line, reason in ((2, "missing prompt"), (3, "malformed JSON"), (4, "choices is empty")):
        assert re.search(rf"bad\.jsonl:line {line}: {reason}", result.stderr), result.stderr
    assert "bad.jsonl:line 1" not in result.stderr
    assert not (tmp_path / "bad.answers.parquet").exists()


@pytest.mark.parametrize("command", ["submit", "plan"])
def test_streaming_typo_is_a_usage_error_naming_the_accepted_words(tmp_path, spec, model, command):
    result = invoke(command, spec, "--model", model, "--streaming", "alwayz")
    assert result.exit_code == 2
    assert "'alwayz'" in result.stderr and "accepted: auto, always, never" in result.stderr
    assert not (tmp_path / "notes.answers.parquet").exists()


def test_submit_takes_one_model(tmp_path, spec, model):
    result = invoke("submit", spec, "--model", model, "--model", model)
    assert result.exit_code == 2 and "submit takes one --model" in result.stderr


# ---- plan ----------------------------------------------------------------------------------------------


def test_plan_table_names_mode_memory_passes_and_eta(spec, model):
    result = invoke("plan", spec, "--model", model)
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("job ") and "6 rows" in text and "up to 4 new tokens per row" in text
    assert re.search(rf"^model\s+{re.escape(str(model))}$", text, re.M)
    assert re.search(r"^mode\s+resident \(auto: the model fits", text, re.M)
    assert re.search(r"^fits\s+yes$", text, re.M)
    for label in ("memory", "batches", "read bandwidth", "per pass", "ETA", "disk"):
        assert re.search(rf"^{label}\s+\S", text, re.M), label
    assert re.search(r"^passes\s+4 \(lower bound 4\)$", text, re.M)  # one batch, 4 new tokens


@pytest.mark.parametrize("kernel", ["aten", "onednn"])
def test_plan_names_the_kernel_the_linears_will_run_on(spec, model, monkeypatch, kernel):
    monkeypatch.setenv("BATCHRUN_LINEAR_KERNEL", kernel)
    result = invoke("plan", spec, "--model", model)
    assert result.exit_code == 0, result.output
    assert re.search(rf"^compute\s+float32 on cpu, {kernel} linears$", result.stdout, re.M)


def test_an_unknown_linear_kernel_is_refused_by_name_without_a_traceback(spec, model, monkeypatch):
    monkeypatch.setenv("BATCHRUN_LINEAR_KERNEL", "mkl")
    result = invoke("plan", spec, "--model", model)
    assert result.exit_code != 0
    assert "BATCHRUN_LINEAR_KERNEL='mkl': expected one of aten, onednn" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", ["plan", "submit"])
def test_a_device_torch_cannot_use_is_refused_in_one_line(spec, model, command):
    import torch

    unusable = "cuda" if not torch.cuda.is_available() else "cuda:99"
    for device, reason in (("foo", "not a device torch knows"), (unusable, "this torch .* cannot use cuda here|only")):
        result = invoke(command, spec, "--model", model, "--device", device)
        assert result.exit_code == 1, result.output
        assert re.search(rf"^Error: --device {device}: ({reason})", result.output, re.M), result.output
        assert "Traceback" not in result.output


def test_plan_json_has_every_field_a_script_needs(tmp_path, model):
    spec = write_jsonl(tmp_path / "mixed.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 4}
                                                  for i, p in enumerate(PROMPTS)] + ["not json"])
    result = invoke("plan", spec, "--model", model, "--skip-invalid", "--streaming", "always", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(PLAN_KEYS) <= set(report), set(PLAN_KEYS) - set(report)
    assert (report["rows"], report["invalid_rows"], report["new_tokens_max"]) == (7, 1, 4)
    assert 0 < report["prompt_tokens_max"] <= report["prompt_tokens_total"] <= 6 * report["prompt_tokens_max"]
    (candidate,) = report["candidates"]
    assert set(CANDIDATE_KEYS) <= set(candidate), set(CANDIDATE_KEYS) - set(candidate)
    assert candidate["model"] == str(model) and candidate["mode"] == "streamed" and candidate["fits"] is True
    assert candidate["layers"] == 2 and candidate["passes"] == 4 and candidate["blockers"] == []
    layers_bytes = candidate["checkpoint_bytes"] - candidate["non_decoder_bytes"]
    assert candidate["largest_layer_bytes"] <= layers_bytes <= 2 * candidate["largest_layer_bytes"]
    assert candidate["peak_memory_bytes"] <= candidate["memory_budget_bytes"]


def test_plan_compares_two_models_side_by_side(spec, tiny_checkpoint):
    llama, qwen = tiny_checkpoint("llama"), tiny_checkpoint("qwen2")
    result = invoke("plan", spec, "--model", llama, "--model", qwen)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if str(llama) in line)
    assert str(qwen) in header  # one column per model
    for label, values in (("mode", r"resident\s+resident"), ("fits", r"yes\s+yes"), ("passes", r"4\s+4")):
        assert re.search(rf"^{label}\s+{values}$", result.stdout, re.M), label
    as_json = json.loads(invoke("plan", spec, "--model", llama, "--model", qwen, "--json").stdout)
    assert [c["model"] for c in as_json["candidates"]] == [str(llama), str(qwen)]
    # each model's caveats follow the table, named by model (here: bandwidth not measured for --streaming always)
    streamed = invoke("plan", spec, "--model", llama, "--model", qwen, "--streaming", "always")
    caveats = {c["model"]: c["caveats"] for c in json.loads(invoke(
        "plan", spec, "--model", llama, "--model", qwen, "--streaming", "always", "--json").stdout)["candidates"]}
    for name in (llama, qwen):
        if caveats[str(name)]:
            assert f"{name} caveats:" in streamed.stdout and caveats[str(name)][0] in streamed.stdout
    assert any(caveats.values())


def test_plan_shows_why_a_pickle_only_checkpoint_cannot_be_used(tmp_path, spec, model):
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(model / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle")
    result = invoke("plan", spec, "--model", model, "--model", pickled)
    assert result.exit_code == 0, result.output
    assert re.search(r"^fits\s+yes\s+NO$", result.stdout, re.M)
    assert f"{pickled} blockers:" in result.stdout
    assert "weights only as pickle (pytorch_model.bin): pickle has no tensor index" in result.stdout
    report = json.loads(invoke("plan", spec, "--model", pickled, "--json").stdout)
    (candidate,) = report["candidates"]
    assert candidate["fits"] is False and candidate["mode"] is None
    assert any("requires safetensors" in blocker for blocker in candidate["blockers"])


# ---- status, jobs, results -----------------------------------------------------------------------------


def test_status_and_jobs_of_a_finished_job(tmp_path, spec, model):
    db = tmp_path / "j.db"
    summary = submitted(spec, model, db, "--output", tmp_path / "a.parquet")
    job_id = summary["job_id"]
    info = json.loads(invoke("status", "--db", db, "--json").stdout)
    assert info["passes"] == summary["passes_now"] and info["elapsed_seconds"] > 0
    assert (info["id"], info["state"], info["rows_done"], info["rows_pending"]) == (job_id, "done", 6, 0)
    assert info["partial_tokens"] == 0 and info["running_pid"] is None
    text = invoke("status", job_id[:6], "--db", db)  # a unique prefix names the job
    assert text.exit_code == 0, text.output
    assert f"job {job_id}: done" in text.stdout and "rows     6 done, 0 errored, 0 pending of 6" in text.stdout
    assert str(model) in text.stdout and str(spec) in text.stdout
    assert "eta      none, every row is finished" in text.stdout

    listing = invoke("jobs", "--db", db)
    assert re.search(rf"^{job_id}\s+done\s+6/6\s", listing.stdout, re.M)
    assert [job["id"] for job in json.loads(invoke("jobs", "--db", db, "--json").stdout)] == [job_id]


def test_reading_commands_create_no_state_directory(tmp_path, monkeypatch):
    home = tmp_path / "fresh-home"
    monkeypatch.setenv("BATCHRUN_HOME", str(home))
    assert invoke("jobs").stdout == "no jobs yet\n"
    for command in (["status"], ["results", "-o", tmp_path / "x.parquet"]):
        result = invoke(*command)
        assert result.exit_code == 1 and "Error: no jobs recorded" in result.stderr
    assert not home.exists()


def test_status_without_jobs_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "none.db"
    empty = invoke("status", "--db", missing)
    assert empty.exit_code == 1 and "Error: no jobs recorded" in empty.stderr
    listing = invoke("jobs", "--db", missing)  # a mistyped --db is not an empty list
    assert listing.exit_code == 1 and f"Error: no database at {missing}" in listing.stderr
    gone = invoke("results", "nope", "--db", missing, "--output", tmp_path / "x.parquet")
    assert gone.exit_code == 1 and "Error: no jobs recorded" in gone.stderr
    assert not (tmp_path / "nowhere").exists()  # reading creates no database
    Store(tmp_path / "empty.db").close()
    unknown = invoke("results", "nope", "--db", tmp_path / "empty.db", "--output", tmp_path / "x.parquet")
    assert unknown.exit_code == 1 and 'Error: no job matches "nope"' in unknown.stderr


def test_results_export_parquet_and_openai_batch_jsonl(tmp_path, model):
    spec = write_jsonl(tmp_path / "mixed.jsonl", [{"id": "a", "prompt": "Hello", "max_new_tokens": 3},
                                                  {"id": "b", "prompt": 7},
                                                  {"id": "c", "prompt": "Pick one", "choices": ["x", "y"]}])
    db = tmp_path / "j.db"
    submitted(spec, model, db, "--output", tmp_path / "run.parquet", "--skip-invalid")

    parquet = invoke("results", "--db", db, "--output", tmp_path / "again.parquet")
    assert parquet.exit_code == 0 and parquet.stdout == f"3 rows -> {tmp_path / 'again.parquet'}\n"
    assert pq.read_table(tmp_path / "again.parquet").equals(pq.read_table(tmp_path / "run.parquet"))
    rows = {r["id"]: r for r in read_parquet_results(tmp_path / "run.parquet")}

    assert invoke("results", "--db", db, "--output", tmp_path / "batch.jsonl").exit_code == 0
    lines = [json.loads(line) for line in (tmp_path / "batch.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["a", "b", "c"]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["id"]
    answered, failed, chosen = lines
    assert answered["error"] is None and answered["response"]["status_code"] == 200
    body = answered["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == str(model)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": rows["a"]["answer"]}
    assert body["choices"][0]["finish_reason"] == rows["a"]["finish_reason"]
    assert body["usage"]["completion_tokens"] == rows["a"]["output_tokens"]
    assert failed["response"] is None and "mixed.jsonl:2: prompt must be a string" in failed["error"]["message"]
    assert chosen["response"]["body"]["choices"][0]["message"]["content"] == rows["c"]["answer"]
    assert chosen["response"]["body"]["choice_probs"] == pytest.approx(rows["c"]["choice_probs"])

    again = invoke("results", "--db", db, "--output", tmp_path / "batch.jsonl")
    assert again.exit_code == 1 and "--force" in again.stderr
    (tmp_path / "batch.jsonl").write_text("old\n")
    forced = invoke("results", "--db", db, "--output", tmp_path / "batch.jsonl", "--force")
    assert forced.exit_code == 0 and len((tmp_path / "batch.jsonl").read_text().splitlines()) == 3
    # the extension decides in any case; one that names no format is refused, not written as Parquet
    assert invoke("results", "--db", db, "--output", tmp_path / "b.NDJSON").exit_code == 0
    assert json.loads((tmp_path / "b.NDJSON").read_text().splitlines()[0])["custom_id"] == "a"
    xlsx = invoke("results", "--db", db, "--output", tmp_path / "b.xlsx")
    assert xlsx.exit_code == 1 and "name it .parquet, .csv or .jsonl" in xlsx.stderr
    assert not (tmp_path / "b.xlsx").exists()


# ---- disk ----------------------------------------------------------------------------------------------


def test_disk_measures_a_checkpoint_directory(tmp_path, model):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(model, checkpoint)
    result = invoke("disk", "--model", checkpoint)
    assert result.exit_code == 0, result.output
    assert re.fullmatch(r"\d+\.\d\d GB/s \(measured\): .+\n", result.stdout), result.stdout
    assert str(checkpoint / "model.safetensors") in result.stdout
    measured = json.loads(invoke("disk", "--model", checkpoint, "--json").stdout)
    assert measured["bytes_per_s"] > 0 and measured["basis"] == "measured"
    assert str(checkpoint) in measured["how"]


def test_a_window_the_config_does_not_place_on_layers_allows_sharing_only_to_rows_inside_it(tmp_path, model):
    """A window without layer types (Mistral-7B-v0.1, gemma-2) may slide on any layer: rows that fit it share their
    head (no window cuts anything there), rows that reach past it do not, and the plan says why."""
    head = "Read the following customer note carefully and say in a few words what the customer wants. " * 4
    spec = write_jsonl(tmp_path / "shared.jsonl", [{"id": i, "prompt": head + p, "max_new_tokens": 4}
                                                   for i, p in enumerate(PROMPTS)])
    candidates = {}
    for window in (None, 4096, 40):
        windowed = copy_checkpoint(model, tmp_path / f"window-{window}", config={"sliding_window": window})
        result = invoke("plan", spec, "--model", windowed, "--raw", "--json")
        assert result.exit_code == 0, result.output
        candidates[window] = json.loads(result.stdout)["candidates"][0]
    assert candidates[None]["shared_prefix_tokens"] == candidates[4096]["shared_prefix_tokens"] > 16
    assert candidates[40]["shared_prefix_tokens"] == 0
    assert any("sliding_window=4096 without layer types" in note for note in candidates[4096]["caveats"])
    assert any("40-token sliding window" in note and "prompt head" in note for note in candidates[40]["caveats"])
