"""batchrun submit end to end, checked against plain transformers computed independently, one row at a time."""
from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchrun.plan.batching import RowCost, passes_for
from batchrun.errors import OutputRefused
from batchrun.job.execute import submit
from batchrun.job.prepare import JobOptions
from batchrun.plan.refill import refill_schedule
from batchrun.store.database import Store

REVIEWS = [
    "The blender is loud but it crushes ice in seconds.",
    "Terrible battery, it died after two days.",
    "Lovely hotel, friendly staff and a quiet room.",
    "The app crashes whenever I open the camera.",
    "Great value for the price, I would buy it again.",
    "The soup was cold and the waiter ignored us for an hour, which ruined the evening.",
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def choice_spec(tmp_path, choices=("positive", "negative")):
    rows = [{"id": f"r{i}", "prompt": f"Review: {text}\nIs it positive or negative?", "choices": list(choices)}
            for i, text in enumerate(REVIEWS)]
    return write_jsonl(tmp_path / "choices.jsonl", rows)


def generation_spec(tmp_path, max_new_tokens=6):
    rows = [{"id": i, "prompt": f"Summarise: {text}", "max_new_tokens": max_new_tokens}
            for i, text in enumerate(REVIEWS)]
    return write_jsonl(tmp_path / "gen.jsonl", rows)


def reference_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def prompt_ids(tokenizer, prompt):
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_choice_probs(model, tokenizer, prompt, choices):
    """Independent: one sequence per choice, batch of one, sum of log-probs of the choice tokens."""
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


def reference_generation(model, tokenizer, prompt, max_new_tokens):
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


def run(spec, tmp_path, model, name, on_plan=None, **options):
    out = tmp_path / f"{name}.parquet"
    summary = submit(spec, options=JobOptions(model=str(model), **options), output=out, db=tmp_path / f"{name}.db",
                     on_plan=on_plan)
    return summary, pq.read_table(out).to_pylist()


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mixtral"])
@pytest.mark.parametrize("streaming,batch_size", [("never", 1), ("never", None), ("always", 1), ("always", None)])
def test_choice_answers_equal_reference(tmp_path, tiny_checkpoint, arch, streaming, batch_size):
    path = tiny_checkpoint(arch)
    model, tokenizer = reference_model(path)
    summary, rows = run(choice_spec(tmp_path), tmp_path, path, "out", streaming=streaming, batch_size=batch_size)
    assert summary.mode == ("resident" if streaming == "never" else "streamed")
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(len(REVIEWS))]
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        assert row["finish_reason"] == "choice"
        got = dict(row["choice_probs"])
        for choice, p in expected.items():
            assert got[choice] == pytest.approx(p, abs=1e-4)
        assert row["answer"] == max(expected, key=expected.get)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("streaming,batch_size", [("never", None), ("always", 1), ("always", None)])
def test_generation_equals_greedy_generate(tmp_path, tiny_checkpoint, arch, streaming, batch_size):
    path = tiny_checkpoint(arch)
    model, tokenizer = reference_model(path)
    summary, rows = run(generation_spec(tmp_path), tmp_path, path, "gen", streaming=streaming,
                        batch_size=batch_size)
    for row, text in zip(rows, REVIEWS):
        answer, finish = reference_generation(model, tokenizer, f"Summarise: {text}", 6)
        assert (row["answer"], row["finish_reason"]) == (answer, finish)
    if batch_size is None:
        assert summary.passes_now == 6  # every row in one batch: one pass per new token


def test_answers_of_different_lengths_share_batches_with_their_own_kind(tmp_path, tiny_checkpoint):
    """Rows asking for 1 and for 5 new tokens, two a batch: packed by answer length, two 1-token rows share a pass and
    the rest make two batches of 5 passes (11 passes), where batches by prompt length alone made 15 here, each
    waiting for a 5-token answer. Answers unchanged."""
    path = tiny_checkpoint("llama")
    model, tokenizer = reference_model(path)
    budgets = [5, 1, 5, 1, 5, 1]
    spec = write_jsonl(tmp_path / "mixed.jsonl", [{"id": i, "prompt": f"Summarise: {text}", "max_new_tokens": n}
                                                   for i, (text, n) in enumerate(zip(REVIEWS, budgets))])
    plans = []
    summary, rows = run(spec, tmp_path, path, "mixed", streaming="always", batch_size=2, on_plan=plans.append)
    assert summary.passes_now == plans[0].passes == 1 + 5 + 5
    for row, text, budget in zip(rows, REVIEWS, budgets):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, f"Summarise: {text}",
                                                                             budget)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("batch_size", [1, None])
def test_a_bf16_checkpoint_streamed_in_float32_generates_as_in_memory(tmp_path, tiny_checkpoint, arch, batch_size,
                                                                     monkeypatch):
    """Decode passes multiply the checkpoint's bf16 linear weights as they lie (linear_kernels.widening_linear), the
    prefill the weights widened in their slots: the answers are plain transformers' in float32."""
    from batchrun.runtime import linear_kernels

    path = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch), dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_checkpoint(arch)).save_pretrained(path)
    model, tokenizer = reference_model(path)
    narrow_calls = []  # the tile workers each narrow linear shared its tiles among
    real = linear_kernels.widening_linear
    def recording(*args):
        narrow_calls.append(getattr(linear_kernels._sharing, "workers", 1))
        return real(*args)

    monkeypatch.setattr(linear_kernels, "widening_linear", recording)
    threads = torch.get_num_threads()
    summary, rows = run(generation_spec(tmp_path), tmp_path, path, "gen", streaming="always", batch_size=batch_size,
                        dtype="float32")
    assert summary.mode == "streamed" and set(narrow_calls) == {threads}  # every core, the reader's too
    for row, text in zip(rows, REVIEWS):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, f"Summarise: {text}", 6)


def test_numeric_choices_get_a_probability_weighted_score(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path, choices=("1", "2", "3", "4", "5"))
    _, rows = run(spec, tmp_path, tiny_checkpoint("llama"), "score")
    for row in rows:
        probs = dict(row["choice_probs"])
        assert row["score"] == pytest.approx(sum(float(c) * p for c, p in probs.items()), abs=1e-9)
        assert sum(probs.values()) == pytest.approx(1.0)


def test_multi_token_choices_are_scored_over_all_their_tokens(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = reference_model(path)
    choices = ["very positive indeed", "negative", "it is hard to say"]
    assert any(len(tokenizer.encode(c, add_special_tokens=False)) > 1 for c in choices)
    _, rows = run(choice_spec(tmp_path, choices), tmp_path, path, "multi", streaming="always")
    for row, text in zip(rows, REVIEWS):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?", choices)
        got = dict(row["choice_probs"])
        assert all(got[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())


@pytest.mark.parametrize("choices", [("yes", "no"), ("very positive indeed", "no")])
def test_plan_shares_the_prefix_the_run_shares(tmp_path, tiny_checkpoint, monkeypatch, choices):
    """Rows with the same prompt share all of it but the positions whose logits the pass keeps (the longest choice
    + 1 when a choice has several tokens): the plan sizes memory for the prefix the run really shares."""
    shared_at_run = record_shared_prefixes(monkeypatch)
    prompt = "Review: " + " ".join(REVIEWS) + "\nIs it positive or negative?"
    # the choices in two orders: otherwise the rows would repeat each other, and be computed once
    spec = write_jsonl(tmp_path / "same.jsonl", [{"id": i, "prompt": prompt, "choices": list(choices)[::(-1) ** i]}
                                                 for i in range(4)])
    planned = []
    submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=tmp_path / "o.parquet",
           db=tmp_path / "j.db", on_plan=planned.append)
    assert shared_at_run and planned[0].shared_prefix_tokens == shared_at_run[0] > 16


def test_rerun_resumes_and_recomputes_nothing(tmp_path, tiny_checkpoint):
    spec = generation_spec(tmp_path)
    first = submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=tmp_path / "a.parquet",
                   db=tmp_path / "j.db")
    again = submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama")), batch_size=2, memory_gb=3),
                   output=tmp_path / "b.parquet", db=tmp_path / "j.db")
    assert again.job_id == first.job_id
    assert again.rows_computed_now == 0 and again.passes_now == 0
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))


def test_a_setting_that_changes_no_row_keeps_the_job(tmp_path, tiny_checkpoint):
    """--max-new-tokens cannot change a choice row, --choices cannot change rows that set their own."""
    spec = choice_spec(tmp_path)
    model = str(tiny_checkpoint("llama"))
    first = submit(spec, options=JobOptions(model=model), output=tmp_path / "a.parquet", db=tmp_path / "j.db")
    again = submit(spec, options=JobOptions(model=model, max_new_tokens=99, choices=("yes", "no")),
                   output=tmp_path / "b.parquet", db=tmp_path / "j.db")
    assert (again.job_id, again.rows_computed_now) == (first.job_id, 0)
    generation = write_jsonl(tmp_path / "open.jsonl", [{"id": i, "prompt": f"Summarise: {text}"}
                                                        for i, text in enumerate(REVIEWS)])  # the option's limit
    short = submit(generation, options=JobOptions(model=model, max_new_tokens=3), output=tmp_path / "c.parquet",
                   db=tmp_path / "j.db")
    longer = submit(generation, options=JobOptions(model=model, max_new_tokens=4), output=tmp_path / "d.parquet",
                    db=tmp_path / "j.db")
    assert longer.job_id != short.job_id and longer.rows_computed_now == len(REVIEWS)


def test_changed_setting_is_a_new_job(tmp_path, tiny_checkpoint):
    spec = generation_spec(tmp_path)
    model = str(tiny_checkpoint("llama"))
    first = submit(spec, options=JobOptions(model=model), output=tmp_path / "a.parquet", db=tmp_path / "j.db")
    other = submit(spec, options=JobOptions(model=model, system="Be brief."), output=tmp_path / "b.parquet",
                   db=tmp_path / "j.db")
    assert other.job_id != first.job_id and other.rows_computed_now == len(REVIEWS)


def _copy_checkpoint(source, target, *, weights=None, chat_template=None):
    """A copy of `source` at `target`, with its tensors passed through `weights` and/or its chat template replaced."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if weights is not None:
        for shard in target.glob("*.safetensors"):
            tensors = {name: weights(name, t) for name, t in load_file(shard).items()}
            save_file(tensors, shard, metadata={"format": "pt"})
    if chat_template is not None:
        for name in ("chat_template.jinja", "chat_template.json"):
            (target / name).unlink(missing_ok=True)
        config = json.loads((target / "tokenizer_config.json").read_text())
        config["chat_template"] = chat_template
        (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_job_is_the_model_not_its_path(tmp_path, tiny_checkpoint):
    """Same config and shapes, other weights (a fine-tune) or another chat template: a new job, never the first
    model's answers. The same checkpoint copied elsewhere: the same job, resumed."""
    spec = generation_spec(tmp_path, max_new_tokens=3)
    base = tiny_checkpoint("llama")

    def job(model, name):
        return submit(spec, options=JobOptions(model=str(model)), output=tmp_path / f"{name}.parquet",
                      db=tmp_path / "j.db")

    first = job(base, "base")
    copied = job(_copy_checkpoint(base, tmp_path / "copy"), "copy")
    assert (copied.job_id, copied.rows_computed_now) == (first.job_id, 0)
    tuned = _copy_checkpoint(base, tmp_path / "tuned",
                             weights=lambda name, t: t + 0.01 if name.endswith("layers.1.mlp.down_proj.weight") else t)
    fine_tune = job(tuned, "tuned")
    assert fine_tune.job_id != first.job_id and fine_tune.rows_computed_now == len(REVIEWS)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    templated = job(_copy_checkpoint(base, tmp_path / "templated", chat_template=template), "templated")
    assert templated.job_id not in (first.job_id, fine_tune.job_id) and templated.rows_computed_now == len(REVIEWS)


def test_existing_output_is_not_overwritten_without_force(tmp_path, tiny_checkpoint):
    from batchrun.errors import OutputRefused

    spec = generation_spec(tmp_path)
    out = tmp_path / "answers.parquet"
    out.write_bytes(b"precious")
    with pytest.raises(OutputRefused, match="--force"):
        submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=out, db=tmp_path / "j.db")
    assert out.read_bytes() == b"precious"
    submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=out, db=tmp_path / "j.db",
           force=True)
    assert pq.read_table(out).num_rows == len(REVIEWS)


def test_too_long_prompt_is_an_errored_row_never_truncated(tmp_path, tiny_checkpoint):
    rows = [{"id": "short", "prompt": "Hello there", "max_new_tokens": 2},
            {"id": "long", "prompt": "word " * 400, "max_new_tokens": 2}]
    spec = write_jsonl(tmp_path / "long.jsonl", rows)
    summary, out = run(spec, tmp_path, tiny_checkpoint("llama"), "long")
    by_id = {r["id"]: r for r in out}
    assert by_id["short"]["finish_reason"] in ("stop", "length")
    assert by_id["long"]["finish_reason"] == "error"
    assert "context is 256 tokens" in by_id["long"]["error"] and "never truncates" in by_id["long"]["error"]
    assert summary.rows_errored == 1


def test_skip_invalid_records_bad_rows_and_runs_the_rest(tmp_path, tiny_checkpoint):
    spec = tmp_path / "mixed.jsonl"
    spec.write_text('{"id": "ok", "prompt": "Hi", "max_new_tokens": 2}\n{"id": "bad", "prompt": 5}\nnot json\n'
                    '{"id": "ok", "prompt": "Hello", "max_new_tokens": 2}\n')
    summary, out = run(spec, tmp_path, tiny_checkpoint("llama"), "mixed", skip_invalid=True)
    assert [r["finish_reason"] for r in out][1:] == ["error"] * 3 and out[0]["finish_reason"] in ("length", "stop")
    assert "mixed.jsonl:2" in out[1]["error"] and "mixed.jsonl:3" in out[2]["error"]
    # The duplicate keeps no id of its own: output ids stay unique, so a join on id finds one row.
    assert out[3]["id"] == f"{spec}:4" and "duplicate id 'ok'" in out[3]["error"]
    assert [r["id"] for r in out][:2] == ["ok", "bad"] and len({r["id"] for r in out}) == 4
    assert summary.rows_done == 1 and summary.rows_errored == 3


def test_stop_string_ends_generation_and_is_cut(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = reference_model(path)
    free, _ = reference_generation(model, tokenizer, "Summarise: " + REVIEWS[0], 8)
    stop = free.strip()[2:4] if len(free.strip()) >= 4 else None
    if not stop:
        pytest.skip("the tiny model's free answer is too short to cut")
    rows = [{"id": 0, "prompt": "Summarise: " + REVIEWS[0], "max_new_tokens": 8, "stop": [stop]}]
    _, out = run(write_jsonl(tmp_path / "stop.jsonl", rows), tmp_path, path, "stop")
    assert out[0]["finish_reason"] == "stop"
    assert out[0]["answer"] == free[:free.find(stop)]


def test_store_keeps_every_row_once(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path)
    summary = submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama")), batch_size=2),
                     output=tmp_path / "o.parquet", db=tmp_path / "j.db")
    with Store(tmp_path / "j.db") as store:
        status = store.status(summary.job_id)
    assert status["rows_done"] == len(REVIEWS) and status["rows_pending"] == 0
    # --batch-size counts sequences; a row of multi-token choices scores each choice as its own sequence
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    single = all(len(tokenizer.encode(c, add_special_tokens=False)) == 1 for c in ("positive", "negative"))
    rows_per_pass = 2 if single else 1
    assert status["passes"] == math.ceil(len(REVIEWS) / rows_per_pass)  # one pass per batch, no decode


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_default_model_answers_equal_reference(tmp_path, default_checkpoint, streaming):
    """The real default model (SmolLM2-135M-Instruct): choice probabilities and greedy answers vs plain transformers."""
    model, tokenizer = reference_model(default_checkpoint)
    rows = [{"id": f"c{i}", "prompt": f"Review: {text}\nIs it positive or negative?",
             "choices": ["positive", "negative"]} for i, text in enumerate(REVIEWS[:3])]
    rows += [{"id": f"g{i}", "prompt": f"Summarise in a few words: {text}", "max_new_tokens": 6}
             for i, text in enumerate(REVIEWS[:2])]
    spec = write_jsonl(tmp_path / "default.jsonl", rows)
    _, out = run(spec, tmp_path, default_checkpoint, "default", streaming=streaming)
    by_id = {r["id"]: r for r in out}
    for i, text in enumerate(REVIEWS[:3]):
        expected = reference_choice_probs(model, tokenizer, f"Review: {text}\nIs it positive or negative?",
                                          ["positive", "negative"])
        got = dict(by_id[f"c{i}"]["choice_probs"])
        assert all(got[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())
    for i, text in enumerate(REVIEWS[:2]):
        answer, finish = reference_generation(model, tokenizer, f"Summarise in a few words: {text}", 6)
        assert (by_id[f"g{i}"]["answer"], by_id[f"g{i}"]["finish_reason"]) == (answer, finish)


@pytest.mark.parametrize("device, storage, cpu_feature, dtype", [
    ("cpu", "BF16", None, "float32"), ("cpu:0", "BF16", None, "float32"),
    ("cpu", "BF16", "avx512_bf16", "bfloat16"), ("cpu:0", "BF16", "amx_bf16", "bfloat16"),
    ("cpu", "F32", "avx512_bf16", "float32"), ("cpu", "F16", "avx512_bf16", "float32"),
    ("mps", "F32", None, "float16"), ("cuda", "F32", "bf16 card", "bfloat16"), ("cuda:1", "BF16", "bf16 card", "bfloat16"),
    ("cuda", "BF16", None, "float16")])
def test_the_default_compute_dtype_follows_the_device_and_the_checkpoint(device, storage, cpu_feature, dtype,
                                                                         monkeypatch):
    """auto: on a CUDA card bfloat16 where it has bfloat16 units, else float16; float16 on MPS; on the CPU a bfloat16
    checkpoint's own dtype only where the CPU has bfloat16 units (host/compute_dtype.py). The plan and the runtime
    share the rule. An explicit --dtype always wins."""
    from batchrun.host import compute_dtype
    from batchrun.job.prepare import compute_dtype_for

    monkeypatch.setattr(compute_dtype, "cpu_bfloat16_feature", lambda: cpu_feature)
    monkeypatch.setattr(compute_dtype, "_cuda_has_bfloat16", lambda device: cpu_feature == "bf16 card")
    assert compute_dtype_for(JobOptions(), device, storage) == dtype
    assert compute_dtype_for(JobOptions(dtype="auto"), device, storage) == dtype
    assert compute_dtype_for(JobOptions(dtype="float32"), device, storage) == "float32"
    assert compute_dtype_for(JobOptions(dtype="bfloat16"), device, storage) == "bfloat16"


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_eos_ids_from_generation_config_stop_rows_in_both_modes(tmp_path, tiny_checkpoint, streaming):
    """generation_config.json may list EOS ids config.json lacks (Llama 3's <|eot_id|>): both modes stop there."""
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    model, tokenizer = reference_model(path)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids(tokenizer, f"Summarise: {REVIEWS[0]}")])
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
    stop_at = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])
    eos_ids = [tokenizer.eos_token_id, greedy[stop_at]]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    spec = write_jsonl(tmp_path / "one.jsonl", [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 6}])
    _, rows = run(spec, tmp_path, path, "eos", streaming=streaming)
    assert rows[0]["finish_reason"] == "stop"
    assert rows[0]["answer"] == tokenizer.decode(greedy[:stop_at], skip_special_tokens=True)


@pytest.mark.parametrize("arch,streaming", [("llama", "always"), ("llama", "never"), ("gpt_neox", "always"),
                                             ("phi3", "always"), ("gemma3", "always")])
def test_places_of_rows_that_stop_early_are_taken_by_waiting_rows(tmp_path, tiny_checkpoint, arch, streaming):
    """Two rows a pass, 18 rows of up to 8 new tokens, several of which reach an end-of-sequence token early:
    each pass admits the next waiting row into a place a row left (refill.py), so the job takes the passes of that
    schedule, fewer than batches that each wait for their last row, and every answer is the one generate() gives."""
    import shutil

    path = shutil.copytree(tiny_checkpoint(arch), tmp_path / arch)
    model, tokenizer = reference_model(path)
    prompts = [f"You are a careful assistant. Read the customer review below and summarise it in a few words, "
               f"nothing else. Review: {text} {extra}" for text in REVIEWS for extra in ("Briefly.", "In one line.",
                                                                                        "Now.")]
    greedy = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)])
            greedy.append(model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                                         pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist())
    # a token some rows emit early (not first) and others not at all: as an end-of-sequence token it stops the first
    stopped_by = {token: sum(token in tokens[1:5] and token != tokens[0] for tokens in greedy)
                  for tokens in greedy for token in tokens[1:5]}
    stop = max(stopped_by, key=lambda token: min(stopped_by[token], len(greedy) - stopped_by[token]))
    eos_ids = [tokenizer.eos_token_id, stop]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    lengths = [next((k + 1 for k, t in enumerate(tokens) if t in eos_ids), 8) for tokens in greedy]
    assert sum(n < 8 for n in lengths) >= 2
    spec = write_jsonl(tmp_path / "early.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 8}
                                                   for i, p in enumerate(prompts)])
    plans = []
    summary, rows = run(spec, tmp_path, path, "early", streaming=streaming, batch_size=2, on_plan=plans.append)
    # Later rows attend to the prefix the first pass computed; the tiny Gemma 3's sliding window is shorter than
    # these rows, so it shares none and refills without one.
    assert (plans[0].shared_prefix_tokens >= 16) == (arch != "gemma3")
    for row, tokens, length in zip(rows, greedy, lengths):
        stopped = tokens[length - 1] in eos_ids
        assert row["finish_reason"] == ("stop" if stopped else "length")
        assert row["answer"] == tokenizer.decode(tokens[:length - 1 if stopped else length], skip_special_tokens=True)
    actual = [RowCost(1, n) for n in lengths]
    order = [i for batch in plans[0].batches for i in batch]
    if arch == "gemma3":  # rows past its window cannot decode in one call once admitted apart: batch after batch
        assert summary.passes_now == passes_for(actual, plans[0].batches) < plans[0].passes == 9 * 8
        return
    assert summary.passes_now == len(refill_schedule(actual, order, 2, 10**9)) < plans[0].passes == 9 * 8
    assert summary.passes_now < passes_for(actual, plans[0].batches)  # batches waiting for their last row


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
    _, out = run(write_jsonl(tmp_path / "t.jsonl", rows), tmp_path, path, "tpl")
    by_id = {r["id"]: r for r in out}
    assert by_id["plain"]["finish_reason"] in ("length", "stop") and by_id["plain"]["error"] is None
    for row_id in ("sys", "sys-choice"):
        assert by_id[row_id]["finish_reason"] == "error"
        assert "chat template refuses this row: System role not supported" in by_id[row_id]["error"]

    empty = [{"id": "empty", "messages": [{"role": "user", "content": ""}], "max_new_tokens": 3},
             {"id": "fine", "prompt": "Summarise: it works", "max_new_tokens": 3}]
    _, out = run(write_jsonl(tmp_path / "e.jsonl", empty), tmp_path, path, "empty", raw=True)
    by_id = {r["id"]: r for r in out}
    assert by_id["empty"]["finish_reason"] == "error" and "encodes to no tokens" in by_id["empty"]["error"]
    assert by_id["fine"]["error"] is None


def test_an_output_made_while_the_job_ran_is_kept_and_the_answers_are_exportable(tmp_path, tiny_checkpoint):
    out, spec = tmp_path / "answers.parquet", generation_spec(tmp_path, max_new_tokens=2)

    def someone_writes_the_output(plan):  # after the pre-run check, before the final write
        out.write_bytes(b"theirs")

    with pytest.raises(OutputRefused, match="appeared while the job ran.*batchrun results"):
        submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=out, db=tmp_path / "j.db",
               on_plan=someone_writes_the_output)
    assert out.read_bytes() == b"theirs"
    with Store(tmp_path / "j.db") as store:
        (job,) = store.jobs()
        assert store.status(job["id"])["state"] == "done"


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_run_loads_the_tokenizer_once_and_plans_for_its_memory(tmp_path, tiny_checkpoint, monkeypatch, streaming):
    """Gemma's 262k-entry tokenizer holds ~330 MB: the model handles must not load a second copy, and the plan must
    count the one the job holds."""
    from batchrun.job import prepare
    from batchrun.checkpoint import tokenizer

    def second_copy(*args, **kwargs):
        raise AssertionError("the model handle loaded its own tokenizer")

    monkeypatch.setattr(tokenizer, "load_tokenizer", second_copy)  # what a handle's .tokenizer calls
    readings = iter([1 << 30, (1 << 30) + (300 << 20)])  # resident memory around the tokenizer's load
    monkeypatch.setattr(prepare, "resident_bytes", lambda: next(readings, None))
    planned = []
    summary = submit(generation_spec(tmp_path, max_new_tokens=2), output=tmp_path / "o.parquet", db=tmp_path / "j.db",
                     options=JobOptions(model=str(tiny_checkpoint("llama")), streaming=streaming),
                     on_plan=planned.append)
    assert summary.rows_done == len(REVIEWS)
    assert planned[0].runtime_overhead_bytes >= (300 << 20) + prepare.measure.runtime_overhead_bytes()


def test_an_unreadable_generation_config_is_skipped_in_both_modes(tmp_path, tiny_checkpoint, caplog):
    import shutil

    path = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama")
    (path / "generation_config.json").write_text('{"eos_token_id": [2,')
    spec = generation_spec(tmp_path, max_new_tokens=2)
    answers = [[r["answer"] for r in run(spec, tmp_path, path, mode, streaming=mode)[1]]
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


def test_answers_empty_at_their_first_token_are_counted_and_explained(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model, tokenizer = reference_model(path)
    first = reference_generation(model, tokenizer, f"Summarise: {REVIEWS[0]}", 1)[0]
    assert first  # its first token has text: make that text the stop
    rows = [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 3, "stop": [first]}]
    summary, out = run(write_jsonl(tmp_path / "s.jsonl", rows), tmp_path, path, "empty")
    assert out[0]["answer"] == "" and out[0]["finish_reason"] == "stop"
    assert summary.empty_answers == 1 and any("answer(s) are empty" in note for note in summary.notes)
    assert not any("base model" in note for note in summary.notes)  # a chat template ran: no base-model hint
    raw_first = tokenizer.decode(model.generate(torch.tensor([tokenizer(f"Summarise: {REVIEWS[0]}")["input_ids"]]),
                                                max_new_tokens=1, do_sample=False)[0, -1:])
    rows = [{"id": 0, "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 3, "stop": [raw_first]}]
    summary, out = run(write_jsonl(tmp_path / "r.jsonl", rows), tmp_path, path, "raw-empty", raw=True)
    assert out[0]["answer"] == "" and any("base model" in note for note in summary.notes)


def test_the_plan_warns_when_choices_would_glue_to_a_raw_prompt(tmp_path, tiny_checkpoint):
    from batchrun.job.prepare import plan_report

    glued = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "Is it good? Answer:", "choices": ["yes", "no"]}])
    spaced = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "Is it good? Answer:", "choices": [" yes", " no"]}])
    model = str(tiny_checkpoint("llama"))
    caveats = {name: plan_report(spec, [model], JobOptions(model=model, raw=True))["candidates"][0]["caveats"]
               for name, spec in (("glued", glued), ("spaced", spaced))}
    assert any("text right after the prompt" in c for c in caveats["glued"])
    assert not any("text right after the prompt" in c for c in caveats["spaced"])
    templated = plan_report(glued, [model], JobOptions(model=model))["candidates"][0]["caveats"]
    assert not any("text right after the prompt" in c for c in templated)  # the chat template separates them


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_sliding_window_model_shares_the_prefix_of_rows_that_fit_its_window(tmp_path, tiny_checkpoint, monkeypatch,
                                                                              streaming):
    """Gemma-style models (sliding and full layers) share an instruction head when every row, answer included, fits
    the smallest window, where windowed layers attend like full ones: the answers stay the reference's. Rows that
    reach past the window compute the head each, and the plan says why."""
    import shutil

    shared_at_run = record_shared_prefixes(monkeypatch)
    wide = shutil.copytree(tiny_checkpoint("gemma3"), tmp_path / "gemma3-window-128")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(config | {"sliding_window": 128}))
    instruction = "Read the customer review below and decide whether the customer is happy with the product. "
    choices, generations = [], []
    for i, text in enumerate(REVIEWS):
        choices.append({"id": f"c{i}", "prompt": instruction + text, "choices": ["positive", "negative"]})
        generations.append({"id": f"g{i}", "prompt": instruction + text, "max_new_tokens": 6})
    model, tokenizer = reference_model(wide)
    planned = []
    summary, rows = run(write_jsonl(tmp_path / "c.jsonl", choices), tmp_path, wide, "c", streaming=streaming,
                        on_plan=planned.append)
    assert planned[0].shared_prefix_tokens == shared_at_run[0] > 16
    for row, spec_row in zip(rows, choices):
        expected = reference_choice_probs(model, tokenizer, spec_row["prompt"], spec_row["choices"])
        assert all(dict(row["choice_probs"])[c] == pytest.approx(p, abs=1e-4) for c, p in expected.items())
    shared_at_run.clear()
    _, rows = run(write_jsonl(tmp_path / "g.jsonl", generations), tmp_path, wide, "g", streaming=streaming)
    assert shared_at_run and shared_at_run[0] > 16
    for row, spec_row in zip(rows, generations):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, spec_row["prompt"], 6)
    # The tiny model's own window (8 tokens) is shorter than any row: nothing shared, and the plan says why.
    shared_at_run.clear()
    planned.clear()
    run(write_jsonl(tmp_path / "c8.jsonl", choices), tmp_path, tiny_checkpoint("gemma3"), "c8", streaming=streaming,
        on_plan=planned.append)
    assert not shared_at_run and planned[0].shared_prefix_tokens == 0
    assert any("sliding window" in caveat and "prompt head" in caveat for caveat in planned[0].caveats)


def test_a_job_none_of_whose_rows_can_run_is_refused_naming_why(tmp_path, tiny_checkpoint, capfd):
    """Every prompt longer than the model's context (a spec meant for another model): `plan` says it cannot run
    and `submit` refuses, naming the rows and why, rather than 'complete' a job of errors with exit code 0. No
    tokenizer warning about indexing errors either: batchrun checks the context itself."""
    from batchrun.errors import PlanRefused
    from batchrun.job.prepare import plan_report

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


def test_an_edited_spec_computes_only_its_changed_rows(tmp_path, tiny_checkpoint):
    """A blank line, an edited prompt and an appended row make a new job (the spec's bytes changed), which takes the
    answers of the unchanged rows from the earlier job and computes the other two; the output is what a fresh run
    of the edited spec gives."""
    path = tiny_checkpoint("llama")
    rows = [{"id": i, "prompt": f"Summarise: {text}", "max_new_tokens": 4} for i, text in enumerate(REVIEWS)]
    spec = write_jsonl(tmp_path / "gen.jsonl", rows)
    db = tmp_path / "j.db"
    first = submit(spec, options=JobOptions(model=str(path)), output=tmp_path / "a.parquet", db=db)
    rows[2]["prompt"] = "Summarise: the lift was out of order all week."
    rows.append({"id": "new", "prompt": "Summarise: fast delivery, well packed.", "max_new_tokens": 4})
    write_jsonl(spec, rows)
    spec.write_text(spec.read_text() + "\n")  # and a trailing blank line
    second = submit(spec, options=JobOptions(model=str(path)), output=tmp_path / "b.parquet", db=db)
    assert second.job_id != first.job_id and second.rows_computed_now == 2
    assert any(f"5 answer(s) taken from earlier job(s) {first.job_id}" in note for note in second.notes)
    fresh = submit(spec, options=JobOptions(model=str(path)), output=tmp_path / "c.parquet", db=tmp_path / "f.db")
    assert fresh.rows_computed_now == 7
    got, expected = (pq.read_table(tmp_path / name).to_pylist() for name in ("b.parquet", "c.parquet"))
    assert [(r["id"], r["answer"], r["finish_reason"]) for r in got] == [
        (r["id"], r["answer"], r["finish_reason"]) for r in expected]


def test_a_stop_while_the_output_is_written_leaves_the_job_done(tmp_path, tiny_checkpoint, monkeypatch):
    """Every answer was committed before the write began: the job is done (`results` exports it), not interrupted."""
    from batchrun.job import execute

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(execute, "_write_output", interrupted)
    with pytest.raises(KeyboardInterrupt):
        submit(choice_spec(tmp_path), options=JobOptions(model=str(tiny_checkpoint("llama"))),
               output=tmp_path / "o.parquet", db=tmp_path / "j.db")
    with Store(tmp_path / "j.db") as store:
        job = store.jobs()[0]
        assert job["state"] == "done" and job["rows_done"] == len(REVIEWS)


def test_rows_that_repeat_another_exactly_are_computed_once(tmp_path, tiny_checkpoint):
    """A corpus's repeated documents (same prompt and settings, other ids) are computed once and answered alike; a
    row that differs only in its settings is its own. The answers are plain transformers' ones."""
    path = tiny_checkpoint("llama")
    model, tokenizer = reference_model(path)
    rows = [{"id": f"g{i}", "prompt": f"Summarise: {REVIEWS[i % 2]}", "max_new_tokens": 4} for i in range(4)]
    rows += [{"id": "g-longer", "prompt": f"Summarise: {REVIEWS[0]}", "max_new_tokens": 5}]
    rows += [{"id": f"c{i}", "prompt": f"Review: {REVIEWS[2]}", "choices": ["positive", "negative"]} for i in range(3)]
    from batchrun.plan.formatting import format_plan_table
    from batchrun.job.prepare import plan_report

    spec = write_jsonl(tmp_path / "rep.jsonl", rows)
    report = plan_report(spec, [str(path)], JobOptions(model=str(path)))
    assert report["repeated_rows"] == 4 and "4 repeat another row exactly (computed once)" in format_plan_table(report)
    summary, out = run(spec, tmp_path, path, "rep")
    assert summary.rows_computed_now == 4 and summary.rows_done == 8  # g0, g1, g-longer, c0
    assert any("4 row(s) repeat another row of this job exactly" in note for note in summary.notes)
    by_id = {row["id"]: row for row in out}
    for i in range(4):
        expected = reference_generation(model, tokenizer, f"Summarise: {REVIEWS[i % 2]}", 4)
        assert (by_id[f"g{i}"]["answer"], by_id[f"g{i}"]["finish_reason"]) == expected
    assert by_id["g-longer"]["answer"] == reference_generation(model, tokenizer, f"Summarise: {REVIEWS[0]}", 5)[0]
    assert by_id["c0"]["choice_probs"] == by_id["c1"]["choice_probs"] == by_id["c2"]["choice_probs"]


@pytest.mark.parametrize("streaming", ["never", "always"])
def test_a_model_that_does_not_attend_in_place_as_planned_decodes_with_the_prefills_settings(
        tmp_path, tiny_checkpoint, monkeypatch, streaming):
    """The plan sizes decode calls as reading keys and values in place when the model's class attends through sdpa.
    Should the built model not (here: told so), the run says so, decodes with the prefill's micro-batches and
    read-ahead, which the plan sized, and its answers are still greedy generate's."""
    from batchrun.job import execute
    from batchrun.runtime import prefix_attention
    from batchrun.runtime.resident import open_model

    path = tiny_checkpoint("llama")
    instruction = "Read the customer review below and write a short summary of what the customer thinks of it."
    prompts = [f"{instruction} Summarise: {text}" for text in REVIEWS]
    spec = write_jsonl(tmp_path / "prefixed.jsonl", [{"id": i, "prompt": p, "max_new_tokens": 4}
                                                      for i, p in enumerate(prompts)])
    opened, plans = [], []
    monkeypatch.setattr(execute, "open_model", lambda *a, **k: opened.append(open_model(*a, **k)) or opened[-1])
    monkeypatch.setattr(prefix_attention, "reads_prefix_in_place", lambda model: False)
    monkeypatch.setattr(execute, "reads_prefix_in_place", lambda model: False)
    summary, rows = run(spec, tmp_path, path, "prefixed", on_plan=plans.append, streaming=streaming, micro_batch=2)
    assert plans[0].decode_in_place and plans[0].shared_prefix_tokens > 0
    assert any("does not attend through transformers' sdpa" in note for note in summary.notes)
    if streaming == "always":
        assert opened[0].decode_prefetch_depth == opened[0].prefetch_depth == 1
    model, tokenizer = reference_model(path)
    for row, prompt in zip(rows, prompts):
        assert (row["answer"], row["finish_reason"]) == reference_generation(model, tokenizer, prompt, 4)
