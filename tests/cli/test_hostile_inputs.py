"""What a demanding user throws at batchrun, and the one promise that covers all of it: every failure ends in one
`Error:` line (and one JSON object with --json, wherever --json stands), never a Python traceback. A failure
batchrun did not foresee says so, keeps its traceback in a log file under the state directory that the line names,
marks the run failed with its reason and keeps every committed pass. Then the inputs that once raised tracebacks or
told something untrue: a damaged gzip spec, infinite budgets, a job none of whose rows can run, a second Ctrl-C,
a two-line hub error, a calibration note only --json showed, conversion bars under -q."""
from __future__ import annotations

import gzip
import json
import math
import os
import re
import signal
import zlib
from pathlib import Path

import click
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchrun.cli import cli
from batchrun.errors import SettingRefused
from batchrun.job import JobOptions
from batchrun.report import is_report
from batchrun.store import Store
from tests.support import invoke, write_jsonl

# Every command `batchrun --help` lists (groups opened), with the arguments that take it to its own code.
COMMAND_ARGS = {
    ("submit",): ["{spec}"], ("plan",): ["{spec}"], ("compare",): ["{spec}"], ("report",): [], ("status",): [],
    ("jobs",): [], ("results",): ["-o", "{tmp}/answers.csv"], ("disk",): [], ("db", "check"): [],
    ("db", "salvage"): ["-o", "{tmp}/salvaged.db"], ("quantize",): ["{tmp}", "-o", "{tmp}/model.gguf"],
}
# A failure batchrun foresees, per command: (arguments, the error's kind, what its message says).
FORESEEN = {
    ("submit",): (["{tmp}/bad.jsonl", "--model", "{tmp}"], "SpecError", "bad.jsonl:line 1: malformed JSON"),
    ("plan",): (["{tmp}/bad.jsonl"], "SpecError", "bad.jsonl:line 1: malformed JSON"),
    ("compare",): (["{tmp}/bad.jsonl", "-m", "{tmp}/a", "-m", "{tmp}/b"], "SpecError",
                   "bad.jsonl:line 1: malformed JSON"),
    ("report",): (["--db", "{tmp}/none.db"], "JobNotFound", "no jobs recorded"),
    ("status",): (["--db", "{tmp}/none.db"], "JobNotFound", "no jobs recorded"),
    ("jobs",): (["--db", "{tmp}/none.db"], "JobNotFound", "no database at"),
    ("results",): (["--db", "{tmp}/none.db", "-o", "{tmp}/a.csv"], "JobNotFound", "no jobs recorded"),
    ("disk",): (["-m", "{tmp}/no-such-model"], "CheckpointError", "no such checkpoint directory"),
    ("db", "check"): (["--db", "{tmp}/bad.jsonl"], "DatabaseUnreadable", "is not a SQLite database"),
    ("db", "salvage"): (["--db", "{tmp}/j.db", "-o", "{tmp}/bad.jsonl"], "OutputRefused", "already exists"),
    ("quantize",): (["{tmp}/no-such-model", "-o", "{tmp}/model.gguf"], "CheckpointError",
                    "not a safetensors checkpoint directory"),
}


def listed_commands(group: click.Group = cli, prefix: tuple[str, ...] = ()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from listed_commands(command, prefix + (name,))
        else:
            yield prefix + (name,)


def command_object(path: tuple[str, ...]) -> click.Command:
    command = cli
    for name in path:
        command = command.commands[name]
    return command


def filled(args: list[str], tmp_path: Path) -> list[str]:
    return [arg.format(tmp=tmp_path, spec=tmp_path / "reviews.jsonl") for arg in args]


def only_json_object(stdout: str) -> dict:
    (line,) = stdout.splitlines()
    return json.loads(line)


def error_line(stderr: str) -> str:
    """The one line a failure prints: no traceback, nothing else."""
    assert "Traceback" not in stderr
    (line,) = [line for line in stderr.splitlines() if line.strip()]
    assert line.startswith("Error: ")
    return line


@pytest.fixture
def model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture
def reviews(tmp_path) -> Path:
    return write_jsonl(tmp_path / "reviews.jsonl", [
        {"id": f"r{i}", "prompt": f"Review {i}: it works. Positive?", "choices": ["yes", "no"]} for i in range(6)])


@pytest.fixture
def failing_inputs(tmp_path) -> Path:
    write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": '])
    Store(tmp_path / "j.db").close()
    return tmp_path


def test_the_cases_below_cover_every_command():
    assert set(listed_commands()) == set(COMMAND_ARGS) == set(FORESEEN)


# ---- the guard at the CLI's edge ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS), ids=" ".join)
def test_an_unforeseen_failure_is_one_line_naming_its_traceback_file(command, tmp_path, reviews, monkeypatch,
                                                                     isolated_state):
    def broken(**params):  # stands in for any fault of batchrun's own, wherever a command meets it
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(command_object(command), "callback", broken)
    result = invoke(*command, *filled(COMMAND_ARGS[command], tmp_path), "--json")
    assert result.exit_code == 1
    line = error_line(result.stderr)
    assert line.startswith("Error: unexpected ZeroDivisionError: division by zero (a fault in batchrun; its "
                           "traceback is in ")
    found = only_json_object(result.stdout)
    assert (found["kind"], found["exit_code"]) == ("internal", 1) and found["error"] == line.removeprefix("Error: ")
    log = Path(found["log"])
    assert log.parent == isolated_state / "logs" and str(log) in line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise ZeroDivisionError("division by zero")' in text


def test_a_traceback_log_never_holds_the_hub_token(tmp_path, reviews, monkeypatch, isolated_state):
    def broken(**params):
        raise RuntimeError(f"the hub refused {params['hf_token']}")

    monkeypatch.setattr(command_object(("plan",)), "callback", broken)
    result = invoke("plan", reviews, "--hf-token", "hf_SECRET_token_123", "--json")
    log = Path(only_json_object(result.stdout)["log"])
    assert "hf_SECRET_token_123" not in log.read_text() and "the hub refused ***" in log.read_text()
    assert "hf_SECRET_token_123" not in result.output and "the hub refused ***" in error_line(result.stderr)


@pytest.mark.parametrize("command", sorted(FORESEEN), ids=" ".join)
@pytest.mark.parametrize("first", [True, False], ids=["json-first", "json-last"])
def test_a_foreseen_failure_prints_its_json_wherever_json_stands(command, first, failing_inputs):
    args, kind, says = FORESEEN[command]
    args = filled(args, failing_inputs)
    result = invoke(*command, *(["--json", *args] if first else [*args, "--json"]))
    assert result.exit_code == 1, result.output
    found = only_json_object(result.stdout)
    assert set(found) == {"error", "kind", "exit_code"} and found["kind"] == kind and says in found["error"]
    assert error_line(result.stderr) == f"Error: {found['error']}"


@pytest.mark.parametrize("command", sorted(COMMAND_ARGS), ids=" ".join)
@pytest.mark.parametrize("order", [("--bogus", "--json"), ("--json", "--bogus")], ids=["bogus-first", "json-first"])
def test_a_usage_error_prints_its_json_whatever_the_argument_order(command, order, tmp_path, reviews):
    result = invoke(*command, *filled(COMMAND_ARGS[command], tmp_path), *order)
    assert result.exit_code == 2
    assert only_json_object(result.stdout) == {"error": "No such option '--bogus'.", "kind": "usage",
                                               "exit_code": 2}


# ---- the guard at the run's edge ---------------------------------------------------------------------------------


def test_an_unforeseen_failure_in_a_run_marks_it_failed_and_keeps_its_committed_passes(
        tmp_path, reviews, model, monkeypatch, isolated_state):
    from batchrun.runtime import score_choices as real_score

    scored = []

    def fails_in_the_second_pass(model, batch, *args, **kwargs):
        scored.append(len(batch))
        if len(scored) == 2:
            raise AssertionError("Padding_idx must be within num_embeddings")  # a fault deep in a pass
        return real_score(model, batch, *args, **kwargs)

    monkeypatch.setattr("batchrun.job.verdicts.score_choices", fails_in_the_second_pass)
    db = tmp_path / "j.db"
    args = ("submit", reviews, "--model", model, "--db", db, "--batch-size", "2", "-q")
    failed = invoke(*args)
    assert failed.exit_code == 1
    line = error_line(failed.stderr)
    assert line.startswith("Error: unexpected AssertionError: Padding_idx must be within num_embeddings (a fault in "
                           "batchrun; its traceback is in ")
    assert line.endswith("Answers committed before the failure are kept")
    (log,) = (isolated_state / "logs").iterdir()
    assert str(log) in line and "fails_in_the_second_pass" in log.read_text()

    status = json.loads(invoke("status", "--db", db, "--json").stdout)
    committed = scored[0]  # the first pass's rows
    assert status["state"] == "failed" and status["rows_done"] == committed < 6
    assert status["last_error"] == ("AssertionError: Padding_idx must be within num_embeddings (unexpected; "
                                    f"traceback in {log})")

    monkeypatch.undo()
    resumed = invoke(*args, "--json")
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.stdout)
    assert (summary["rows_done"], summary["rows_computed_now"]) == (6, 6 - committed)  # none computed twice


def test_a_second_ctrl_c_while_the_run_stops_still_leaves_its_record_and_report(tmp_path, reviews, model,
                                                                                 monkeypatch):
    from batchrun.runtime import score_choices as real_score

    scored = []
    real_release = Store.release

    def ctrl_c_in_the_second_pass(model, batch, *args, **kwargs):
        scored.append(len(batch))
        if len(scored) == 2:
            raise KeyboardInterrupt
        return real_score(model, batch, *args, **kwargs)

    def ctrl_c_again(self, *args, **kwargs):  # the impatient second press, a real SIGINT, as the run stops
        os.kill(os.getpid(), signal.SIGINT)
        return real_release(self, *args, **kwargs)

    monkeypatch.setattr("batchrun.job.verdicts.score_choices", ctrl_c_in_the_second_pass)
    monkeypatch.setattr(Store, "release", ctrl_c_again)
    db = tmp_path / "j.db"
    result = invoke("submit", reviews, "--model", model, "--db", db, "--batch-size", "2", "-q")
    assert result.exit_code == 130 and "Interrupted; committed passes are kept" in result.stderr
    assert "Traceback" not in result.stderr
    report = tmp_path / "reviews.report.html"
    assert report.exists() and is_report(report)
    monkeypatch.undo()
    status = json.loads(invoke("status", "--db", db, "--json").stdout)
    assert status["state"] == "interrupted" and status["rows_done"] == scored[0]


# ---- inputs that once raised a traceback -------------------------------------------------------------------------


def damaged_gzip(rows: list[dict]) -> bytes:
    """A gzip file with one byte of its deflate stream flipped where zlib itself refuses it (zlib.error, neither an
    OSError nor an EOFError; many flips give gzip's clean CRC error instead)."""
    data = gzip.compress("".join(json.dumps(row) + "\n" for row in rows * 20).encode(), mtime=0)
    for position in range(len(data) // 2, len(data) - 8):
        damaged = data[:position] + bytes([data[position] ^ 0x10]) + data[position + 1:]
        try:
            gzip.decompress(damaged)
        except zlib.error:
            return damaged
        except (OSError, EOFError):
            continue
    raise AssertionError("no flipped byte makes zlib refuse the stream")


def test_a_damaged_gzip_spec_is_refused_from_a_file_and_from_stdin(tmp_path):
    rows = [{"id": "a", "prompt": "Review: fine. Positive?", "choices": ["yes", "no"]}]
    spec = tmp_path / "reviews.jsonl.gz"
    spec.write_bytes(damaged_gzip(rows))
    from_file = invoke("plan", spec, "--json")
    from_stdin = CliRunner().invoke(cli, ["plan", "-", "--json"], input=damaged_gzip(rows))
    for result in (from_file, from_stdin):
        assert result.exit_code == 1
        found = only_json_object(result.stdout)
        assert found["kind"] == "SpecError" and "cannot decompress the file (gzip: " in found["error"]
        assert "cut short or damaged?" in error_line(result.stderr)


@pytest.mark.parametrize("command", ["plan", "submit"])
@pytest.mark.parametrize("option", ["--memory", "--pass-minutes", "--bandwidth"])
@pytest.mark.parametrize("value", ["inf", "1e400", "nan"])
def test_a_budget_without_bound_is_a_usage_error(command, option, value, tmp_path, reviews):
    database = ["--db", tmp_path / "j.db"] if command == "submit" else []
    result = invoke(command, reviews, option, value, *database, "--json")
    assert result.exit_code == 2
    found = only_json_object(result.stdout)
    assert found["kind"] == "usage" and found["error"] == (f"Invalid value for '{option}': {value} is not a finite "
                                                           "number; give a number above 0")
    assert not (tmp_path / "j.db").exists()  # refused before any job is recorded


@pytest.mark.parametrize("name", ["memory_gb", "pass_minutes", "bandwidth_gbps"])
def test_a_script_giving_an_infinite_budget_is_refused_as_the_cli_refuses_it(name):
    with pytest.raises(SettingRefused, match=f"{name} must be a positive finite number, got inf"):
        JobOptions(**{name: math.inf})


# ---- messages that told something untrue -------------------------------------------------------------------------


def test_a_job_that_computed_nothing_reports_no_rate(tmp_path, model):
    spec = write_jsonl(tmp_path / "allbad.jsonl", [{"id": "a", "prompt": 5}, {"id": "b", "prompt": ["x"]}])
    db = tmp_path / "j.db"
    refused = invoke("submit", spec, "--model", model, "--db", db, "--skip-invalid", "-q")
    assert refused.exit_code == 1 and "none of the 2 rows can run on this model" in error_line(refused.stderr)
    page = tmp_path / "allbad.html"
    assert invoke("report", "--db", db, "-o", page).exit_code == 0
    rate = re.search(r"<th>Rows finished per hour</th><td>([^<]*)</td>", page.read_text()).group(1)
    assert rate == "none computed yet (no pass has finished a row)"


@pytest.mark.parametrize("spellings", [
    ("default", "smollm2-135m"),
    ("smollm2-135m", "{home}/models/{gguf_directory}/{gguf_file}"),  # the registry model's GGUF, by its path
    ("smollm2-135m:converted", "{home}/models/{default_directory}"),  # its conversion's folder, by its path
    ("{model}", "{tmp}/linked"),  # a link to the same directory
    ("{model}", "{model}/."),
], ids=["default-and-its-registry-name", "registry-name-and-its-file", "conversion-and-its-folder", "link",
        "same-directory"])
def test_compare_refuses_one_model_under_two_names_before_running_anything(spellings, tmp_path, reviews, model,
                                                                            isolated_state):
    from batchrun.checkpoint import DEFAULT_REGISTRY_MODEL, registry_directory, registry_gguf

    registry_directory(DEFAULT_REGISTRY_MODEL).mkdir(parents=True)  # as if provisioned: nothing is downloaded here
    registry_gguf(DEFAULT_REGISTRY_MODEL).parent.mkdir(parents=True)
    registry_gguf(DEFAULT_REGISTRY_MODEL).write_bytes(b"GGUF")
    (tmp_path / "linked").symlink_to(model, target_is_directory=True)
    first, second = (spelling.format(home=isolated_state, default_directory=DEFAULT_REGISTRY_MODEL.directory,
                                     gguf_directory=DEFAULT_REGISTRY_MODEL.gguf_directory,
                                     gguf_file=DEFAULT_REGISTRY_MODEL.gguf_file, model=model, tmp=tmp_path)
                     for spelling in spellings)
    db = tmp_path / "j.db"
    result = invoke("compare", reviews, "-m", first, "-m", second, "--db", db, "--json")
    assert result.exit_code == 1, result.output
    found = only_json_object(result.stdout)
    assert found["kind"] == "SettingRefused"
    assert found["error"].startswith(f"--model {first} and --model {second} are the same model (")
    assert found["error"].endswith("compare judges different models against each other: give another --model")
    assert error_line(result.stderr) == f"Error: {found['error']}"
    assert not db.exists()  # refused before the spec is read or any job recorded


def test_compare_takes_different_models_past_the_same_model_check(tiny_checkpoint):
    from batchrun.job import refuse_one_model_twice

    refuse_one_model_twice([None, str(tiny_checkpoint("llama")), str(tiny_checkpoint("qwen2")), "gemma3-270m",
                            "smollm2-135m:converted"])  # the default's GGUF and its conversion: two models


def test_a_failed_corpus_row_keeps_its_kept_columns_in_the_output(tmp_path, model):
    corpus = [{"doc": f"d{i}", "text": f"it works {i}", "site": f"site-{i}", "stars": i} for i in range(3)]
    corpus[1]["text"] = None  # the template's field is null: this row cannot run
    spec = write_jsonl(tmp_path / "corpus.jsonl", corpus)
    out = tmp_path / "answers.parquet"
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "-o", out, "-q",
                    "--template", "Review: {text}\nPositive?", "--choices", "yes,no", "--keep-columns", "*",
                    "--skip-invalid")
    assert result.exit_code == 0, result.output
    rows = sorted(pq.read_table(out).to_pylist(), key=lambda row: row["id"])  # the line numbers
    assert [row["doc"] for row in rows] == ["d0", "d1", "d2"]
    assert [row["error"] is not None for row in rows] == [False, True, False]
    for row, given in zip(rows, corpus):
        assert {name: row[name] for name in given} == given


def test_a_hub_error_spanning_lines_is_one_error_line(tmp_path, reviews, monkeypatch):
    def unreachable(repo_id, token, cache_dir, *, local_only):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to "
                      "locate the files on the Hub.")

    monkeypatch.setattr("batchrun.checkpoint.resolve._fetch_from_hub", unreachable)
    result = invoke("submit", reviews, "--model", "acme/never-seen", "--db", tmp_path / "j.db")
    assert result.exit_code == 1
    line = error_line(result.stderr)
    assert "repository acme/never-seen not found / not cached" in line
    assert "Name or service not known An error happened" in line


def test_the_too_few_labels_note_is_said_without_json(tmp_path, model, caplog):
    spec = write_jsonl(tmp_path / "few.jsonl", [{"id": f"r{i}", "prompt": f"Review {i}: fine. Positive?",
                                                  "choices": ["yes", "no"], "label": "yes"} for i in range(3)])
    result = invoke("submit", spec, "--model", model, "--db", tmp_path / "j.db", "-q")
    assert result.exit_code == 0, result.output
    warned = [record.getMessage() for record in caplog.records if record.name == "batchrun"]
    assert any("are too few to weigh the methods on" in message for message in warned), warned


@pytest.mark.parametrize("flags, shown", [((), True), (("-q",), False), (("--json",), False)])
def test_a_first_run_shows_the_models_conversion_bars_only_when_not_quiet(flags, shown, tmp_path, reviews, model,
                                                                          monkeypatch):
    from batchrun.checkpoint import bars_shown

    seen = []

    def default_model():  # where a first run provisions the default model
        seen.append(bars_shown())
        return model

    monkeypatch.setattr("batchrun.job.prepare.default_model", default_model)
    result = invoke("submit", reviews, "--db", tmp_path / "j.db", *flags)
    assert result.exit_code == 0, result.output
    assert seen == [shown]
