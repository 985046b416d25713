"""Settings and refusals around a run: the compute dtype, one tokenizer counted in the plan, the default
model, the errors scripts catch, plan warnings, and rows that cannot run (errored, never truncated)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from batchrun.job import JobOptions, submit
from tests.support import REVIEWS, generation_spec, run_job, write_jsonl


@pytest.mark.parametrize("device, storage, cpu_feature, dtype", [
    ("cpu", "BF16", None, "float32"), ("cpu:0", "BF16", None, "float32"),
    ("cpu", "BF16", "avx512_bf16", "bfloat16"), ("cpu:0", "BF16", "amx_bf16", "bfloat16"),
    ("cpu", "F32", "avx512_bf16", "float32"), ("cpu", "F16", "avx512_bf16", "float32"),
    ("mps", "F32", None, "float16"), ("cuda", "F32", "bf16 card", "bfloat16"),
    ("cuda:1", "BF16", "bf16 card", "bfloat16"), ("cuda", "BF16", None, "float16")])
def test_the_default_compute_dtype_follows_the_device_and_the_checkpoint(device, storage, cpu_feature, dtype,
                                                                         monkeypatch):
    """auto: on a CUDA card bfloat16 where it has bfloat16 units, else float16; float16 on MPS; on the CPU a bfloat16
    checkpoint's own dtype only where the CPU has bfloat16 units (host/compute_dtype.py). The plan and the runtime
    share the rule. An explicit --dtype always wins."""
    from batchrun.job.prepare import compute_dtype_for

    monkeypatch.setattr("batchrun.host.compute_dtype.cpu_bfloat16_feature", lambda: cpu_feature)
    monkeypatch.setattr("batchrun.host.compute_dtype._cuda_has_bfloat16", lambda device: cpu_feature == "bf16 card")
    assert compute_dtype_for(JobOptions(), device, storage) == dtype
    assert compute_dtype_for(JobOptions(dtype="auto"), device, storage) == dtype
    assert compute_dtype_for(JobOptions(dtype="float32"), device, storage) == "float32"
    assert compute_dtype_for(JobOptions(dtype="bfloat16"), device, storage) == "bfloat16"


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_run_loads_the_tokenizer_once_and_plans_for_its_memory(tmp_path, tiny_checkpoint, monkeypatch, streaming):
    """Gemma's 262k-entry tokenizer holds ~330 MB: the model handles must not load a second copy, and the plan must
    count the one the job holds."""
    from batchrun.job import prepare

    def second_copy(*args, **kwargs):
        raise AssertionError("the model handle loaded its own tokenizer")

    monkeypatch.setattr("batchrun.checkpoint.tokenizer.load_tokenizer", second_copy)  # what a handle's .tokenizer calls
    readings = iter([1 << 30, (1 << 30) + (300 << 20)])  # resident memory around the tokenizer's load
    monkeypatch.setattr(prepare, "resident_bytes", lambda: next(readings, None))
    planned = []
    summary = submit(generation_spec(tmp_path, max_new_tokens=2), output=tmp_path / "o.parquet", db=tmp_path / "j.db",
                     options=JobOptions(model=str(tiny_checkpoint("llama")), streaming=streaming),
                     on_plan=planned.append)
    assert summary.rows_done == len(REVIEWS)
    runtime = prepare.measure.runtime_overhead_bytes(planned[0].compute_dtype)
    rows = dict(planned[0].memory.memory_floor)["job rows"]
    assert planned[0].memory.runtime_overhead_bytes == (300 << 20) + runtime + rows
    assert dict(planned[0].memory.memory_floor)["tokenizer"] == 300 << 20


def test_an_unreadable_generation_config_is_skipped_in_both_modes(tmp_path, tiny_checkpoint, caplog):
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    (path / "generation_config.json").write_text('{"eos_token_id": [2,')
    spec = generation_spec(tmp_path, max_new_tokens=2)
    answers = [[r["answer"] for r in run_job(spec, tmp_path, path, mode, streaming=mode)[1]]
               for mode in ("never", "always")]
    assert answers[0] == answers[1] and len(answers[0]) == len(REVIEWS)
    assert "generation_config.json is not usable" in caplog.text


def test_the_default_model_is_also_named_default(tmp_path, default_checkpoint, monkeypatch):
    """`--model default` names it beside another model in `plan`; a directory called "default" still wins."""
    from batchrun.job import prepare

    monkeypatch.setattr(prepare, "default_model", lambda: default_checkpoint)
    monkeypatch.chdir(tmp_path)
    assert prepare.resolve_model("default", JobOptions()) == default_checkpoint
    assert prepare.prepare_model("default", JobOptions()).name == prepare.DEFAULT_MODEL_LABEL
    (tmp_path / "default").mkdir()
    assert not prepare.names_default_model("default")


def test_script_errors_are_exported_and_options_are_checked_like_the_cli_does():
    import batchrun
    from batchrun.errors import SettingRefused

    for name in ("SpecError", "CheckpointError", "DefaultModelError", "PlanRefused", "SettingRefused", "OutputRefused",
                 "OutputExists", "OutputError", "OutputFormatUnknown", "JobLocked", "JobNotFound", "StoreError"):
        assert issubclass(getattr(batchrun, name), batchrun.BatchrunError), name
    assert batchrun.user_errors() == (batchrun.BatchrunError,)
    for bad in (dict(dtype="float8"), dict(streaming="sometimes"), dict(batch_size=0), dict(memory_gb=-1.0)):
        with pytest.raises(SettingRefused):
            JobOptions(**bad)


def test_the_plan_warns_when_choices_would_glue_to_a_raw_prompt(tmp_path, tiny_checkpoint):
    from batchrun.job import plan_report

    glued = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "Is it good? Answer:", "choices": ["yes", "no"]}])
    spaced = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Is it good? Answer:", "choices": [" yes", " no"]}])
    model = str(tiny_checkpoint("llama"))
    caveats = {name: plan_report(spec, [model], JobOptions(model=model, raw=True))["candidates"][0]["caveats"]
               for name, spec in (("glued", glued), ("spaced", spaced))}
    assert any("text right after the prompt" in c for c in caveats["glued"])
    assert not any("text right after the prompt" in c for c in caveats["spaced"])
    templated = plan_report(glued, [model], JobOptions(model=model))["candidates"][0]["caveats"]
    assert not any("text right after the prompt" in c for c in templated)  # the chat template separates them


def test_too_long_prompt_is_an_errored_row_never_truncated(tmp_path, tiny_checkpoint):
    rows = [{"id": "short", "prompt": "Hello there", "max_new_tokens": 2},
            {"id": "long", "prompt": "word " * 400, "max_new_tokens": 2}]
    spec = write_jsonl(tmp_path / "long.jsonl", rows)
    summary, out = run_job(spec, tmp_path, tiny_checkpoint("llama"), "long")
    by_id = {r["id"]: r for r in out}
    assert by_id["short"]["finish_reason"] in ("stop", "length")
    assert by_id["long"]["finish_reason"] == "error"
    assert "context is 256 tokens" in by_id["long"]["error"] and "never truncates" in by_id["long"]["error"]
    assert summary.rows_errored == 1


def test_skip_invalid_records_bad_rows_and_runs_the_rest(tmp_path, tiny_checkpoint):
    spec = tmp_path / "mixed.jsonl"
    spec.write_text('{"id": "ok", "prompt": "Hi", "max_new_tokens": 2}\n{"id": "bad", "prompt": 5}\nnot json\n'
                    '{"id": "ok", "prompt": "Hello", "max_new_tokens": 2}\n')
    summary, out = run_job(spec, tmp_path, tiny_checkpoint("llama"), "mixed", skip_invalid=True)
    assert [r["finish_reason"] for r in out][1:] == ["error"] * 3 and out[0]["finish_reason"] in ("length", "stop")
    assert "mixed.jsonl:2" in out[1]["error"] and "mixed.jsonl:3" in out[2]["error"]
    # The duplicate keeps no id of its own: output ids stay unique, so a join on id finds one row.
    assert out[3]["id"] == f"{spec}:4" and "duplicate id 'ok'" in out[3]["error"]
    assert [r["id"] for r in out][:2] == ["ok", "bad"] and len({r["id"] for r in out}) == 4
    assert summary.rows_done == 1 and summary.rows_errored == 3


REFUSES_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}"
                  "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>")


def test_rows_the_chat_template_refuses_or_that_encode_to_nothing_are_errored_rows(tmp_path, tiny_checkpoint):
    """A template that raises on one row (Gemma's "System role not supported") must not sink the job's other rows."""
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = REFUSES_SYSTEM
    tokenizer.save_pretrained(path)
    rows = [{"id": "plain", "prompt": "Summarise: it works", "max_new_tokens": 3},
            {"id": "sys", "prompt": "Summarise: it works", "system": "Be brief.", "max_new_tokens": 3},
            {"id": "sys-choice", "prompt": "Good?", "system": "Be brief.", "choices": ["yes", "no"]}]
    _, out = run_job(write_jsonl(tmp_path / "t.jsonl", rows), tmp_path, path, "tpl")
    by_id = {r["id"]: r for r in out}
    assert by_id["plain"]["finish_reason"] in ("length", "stop") and by_id["plain"]["error"] is None
    for row_id in ("sys", "sys-choice"):
        assert by_id[row_id]["finish_reason"] == "error"
        assert "chat template refuses this row: System role not supported" in by_id[row_id]["error"]

    empty = [{"id": "empty", "messages": [{"role": "user", "content": ""}], "max_new_tokens": 3},
             {"id": "fine", "prompt": "Summarise: it works", "max_new_tokens": 3}]
    _, out = run_job(write_jsonl(tmp_path / "e.jsonl", empty), tmp_path, path, "empty", raw=True)
    by_id = {r["id"]: r for r in out}
    assert by_id["empty"]["finish_reason"] == "error" and "encodes to no tokens" in by_id["empty"]["error"]
    assert by_id["fine"]["error"] is None


def test_a_job_none_of_whose_rows_can_run_is_refused_naming_why(tmp_path, tiny_checkpoint, capfd):
    """Every prompt longer than the model's context (a spec meant for another model): `plan` says it cannot run
    and `submit` refuses, naming the rows and why, rather than 'complete' a job of errors with exit code 0. No
    tokenizer warning about indexing errors either: batchrun checks the context itself."""
    from batchrun.errors import PlanRefused
    from batchrun.job import plan_report

    long_text = " ".join(REVIEWS * 20)
    spec = write_jsonl(tmp_path / "long.jsonl", [{"id": "a", "prompt": long_text, "max_new_tokens": 4},
                                                 {"id": "b", "prompt": long_text, "choices": ["yes", "no"]}])
    options = JobOptions(model=str(tiny_checkpoint("llama")))
    candidate = plan_report(spec, [options.model], options)["candidates"][0]
    assert not candidate["fits"] and any("none of the 2 rows can run" in b for b in candidate["blockers"])
    with pytest.raises(PlanRefused, match=r"none of the 2 rows can run on this model: .*long.jsonl:1: .*context"):
        submit(spec, options=options, output=tmp_path / "o.parquet", db=tmp_path / "j.db")
    assert not (tmp_path / "o.parquet").exists()
    assert "indexing errors" not in capfd.readouterr().err


def test_a_run_peaking_far_over_its_plan_has_the_runtimes_memory_measured_again(tmp_path, tiny_checkpoint):
    """A runtime figure cached too low (a library upgraded in place, say) leaves every plan short: the run's first
    pass, peaking over 1.25x the plan, marks it disputed, and the next plan probes it again. In a process of its
    own: the first pass must set the process's peak (this test process peaked higher long ago)."""
    import subprocess
    import sys

    from batchrun import measure
    from batchrun.measure import cache
    from tests.support import choice_spec

    entry = cache.cached("runtime_overhead", sys.executable)
    cache.store("runtime_overhead", sys.executable, {**entry, "bytes": 1 << 20, "float32_kernel_bytes": 0,
                                                     "half_kernel_bytes": 0})  # 1 MiB: far too little
    done = subprocess.run([sys.executable, "-m", "batchrun", "submit", str(choice_spec(tmp_path)), "--model",
                           str(tiny_checkpoint("llama")), "--streaming", "never", "--db", str(tmp_path / "j.db"),
                           "--output", str(tmp_path / "o.parquet"), "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    disputed = cache.load()["runtime_overhead"][sys.executable]["disputed"]
    assert disputed["peak_bytes"] > 1.25 * disputed["planned_peak_bytes"]
    assert measure.runtime_overhead_bytes() > 100 << 20  # probed again, not the disputed figure
    assert "disputed" not in cache.load()["runtime_overhead"][sys.executable]


def test_a_run_whose_pass_disagrees_with_the_cached_compute_rate_has_the_rate_measured_again(tmp_path, tiny_checkpoint,
                                                                                          monkeypatch):
    """A compute rate cached while the machine was busy prices every later pass too long: the run's resident choice
    pass, far quicker than planned, marks it disputed, and the next plan measures it again."""
    import torch

    from batchrun import measure
    from batchrun.measure import cache
    from tests.support import choice_spec

    key = cache.compute_key("float32", "cpu", torch.get_num_threads())
    entry = cache.cached("compute", key)
    cache.store("compute", key, {**entry, "flops_per_s": entry["flops_per_s"] / 1e5})  # a badly disturbed figure
    planned = []
    run_job(choice_spec(tmp_path), tmp_path, tiny_checkpoint("llama"), "slow", streaming="never",
            on_plan=lambda plan: planned.append(plan.time.pass_seconds[0]))
    disputed = cache.load()["compute"][key]["disputed"]
    assert disputed["planned_seconds"] == pytest.approx(planned[0], rel=1e-3) and planned[0] >= 2.0
    assert disputed["pass_seconds"] < planned[0] / 1.5
    remeasured = []
    monkeypatch.setattr(measure.compute, "measure_compute_rate",
                        lambda dtype, device: remeasured.append(dtype) or entry["flops_per_s"])
    run_job(choice_spec(tmp_path), tmp_path, tiny_checkpoint("llama"), "next", streaming="never")
    assert remeasured  # the next plan measured the rate instead of trusting the disputed one


def test_generation_passes_far_quicker_than_planned_have_their_rates_measured_again(tmp_path, tiny_checkpoint,
                                                                                     monkeypatch):
    """A layer call's cost cached while the machine was busy prices every decode pass far too long; nothing a
    choice pass does heals it. The run's generation passes, adding up to a judgeable time far from their plan,
    dispute every rate that priced them, and the next plan measures them again."""
    import torch

    from batchrun import measure
    from batchrun.measure import cache

    key = cache.compute_key("float32", "cpu", torch.get_num_threads())
    cache.store("layer_call", key, {"seconds": 0.5})  # half a second a layer call: a badly disturbed figure
    planned = []
    run_job(generation_spec(tmp_path, max_new_tokens=6), tmp_path, tiny_checkpoint("llama"), "slow",
            streaming="never", on_plan=lambda plan: planned.append(sum(plan.time.pass_seconds)))
    disputed = cache.load()["layer_call"][key]["disputed"]
    assert planned[0] >= 2.0 and disputed["generation_seconds"] < disputed["planned_seconds"] / 1.5
    remeasured = []
    monkeypatch.setattr(measure.layer_call, "seconds_per_layer_call", lambda device: remeasured.append(device) or 2e-4)
    run_job(generation_spec(tmp_path, max_new_tokens=6), tmp_path, tiny_checkpoint("llama"), "next",
            streaming="never")
    assert remeasured == ["cpu"]  # the next plan measured the cost instead of trusting the disputed figure
    assert cache.load()["layer_call"][key]["seconds"] == 2e-4


def test_a_submit_records_its_own_start_in_the_import_time_later_etas_count(tmp_path, tiny_checkpoint):
    """An import time probed while the machine was busy would stay in every later ETA: each `batchrun submit` records
    how long its own imports took, and the figure is the median of recent starts. A fresh process: only a command
    run right after its own imports times them (a test runner's long-lived process would not)."""
    import subprocess
    import sys

    from batchrun import measure
    from batchrun.measure import cache
    from tests.support import choice_spec

    measure.runtime_overhead_bytes()  # the probe's entry, as a plan leaves it
    entry = cache.cached("runtime_overhead", sys.executable)
    cache.store("runtime_overhead", sys.executable, {**entry, "import_seconds": 90.0})
    submit = [sys.executable, "-m", "batchrun", "submit", str(choice_spec(tmp_path)), "--model",
              str(tiny_checkpoint("llama")), "--streaming", "never", "--db", str(tmp_path / "j.db"), "--output",
              str(tmp_path / "o.parquet"), "--quiet", "--force"]
    for _ in range(2):
        done = subprocess.run(submit, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    recorded = cache.load()["runtime_overhead"][sys.executable]
    probed, *started = recorded["import_observed"]
    assert probed == 90.0 and len(started) == 2 and max(started) < 60
    assert recorded["import_seconds"] == max(started)  # two real starts outvote the busy probe
    assert recorded["bytes"] == entry["bytes"] and "disputed" not in recorded  # no probe again: memory untouched


def test_the_rows_a_job_holds_are_part_of_its_floor_and_its_peak(tmp_path, tiny_checkpoint):
    """A large spec's rows stay in memory as the run goes (each request and its prompt's token ids), repeats of one
    prompt included: the plan counts them in the floor, so a spec of many rows plans a higher peak than a few of the
    same rows, by what they hold."""
    from batchrun.job import plan_report
    from batchrun.job.prepare import HELD_BYTES_PER_PROMPT_TOKEN, HELD_BYTES_PER_ROW

    def planned(rows: int) -> dict:
        spec = write_jsonl(tmp_path / f"{rows}.jsonl", [{"id": f"r{i}", "prompt": f"Review: {REVIEWS[i % 4]}",
                                                          "choices": ["positive", "negative"]} for i in range(rows)])
        options = JobOptions(model=str(tiny_checkpoint("llama")), streaming="never", batch_size=1)
        return plan_report(spec, [options.model], options)

    few, many = planned(10), planned(1000)
    floor_few, floor_many = (dict(report["candidates"][0]["memory_floor"])["job rows"] for report in (few, many))
    assert floor_few == 10 * HELD_BYTES_PER_ROW + few["prompt_tokens_total"] * HELD_BYTES_PER_PROMPT_TOKEN
    assert floor_many == 1000 * HELD_BYTES_PER_ROW + many["prompt_tokens_total"] * HELD_BYTES_PER_PROMPT_TOKEN
    peaks = [report["candidates"][0]["peak_memory_bytes"] for report in (few, many)]
    assert peaks[1] - peaks[0] == floor_many - floor_few
