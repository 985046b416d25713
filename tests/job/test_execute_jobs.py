"""Jobs across runs: a rerun resumes, a setting or model that changes the answers is a new job, outputs are
never overwritten unasked, an edited spec computes only its changed rows, a stop while writing keeps the job."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from batchrun.errors import OutputRefused
from batchrun.job import JobOptions, submit
from batchrun.store import Store
from tests.support import REVIEWS, choice_spec, copy_checkpoint, generation_spec, write_jsonl


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


def test_job_is_the_model_not_its_path(tmp_path, tiny_checkpoint):
    """Same config and shapes, other weights (a fine-tune) or another chat template: a new job, never the first
    model's answers. The same checkpoint copied elsewhere: the same job, resumed."""
    spec = generation_spec(tmp_path, max_new_tokens=3)
    base = tiny_checkpoint("llama")

    def job(model, name):
        return submit(spec, options=JobOptions(model=str(model)), output=tmp_path / f"{name}.parquet",
                      db=tmp_path / "j.db")

    first = job(base, "base")
    copied = job(copy_checkpoint(base, tmp_path / "copy"), "copy")
    assert (copied.job_id, copied.rows_computed_now) == (first.job_id, 0)
    tuned = copy_checkpoint(base, tmp_path / "tuned",
                            weights=lambda name, t: t + 0.01 if name.endswith("layers.1.mlp.down_proj.weight") else t)
    fine_tune = job(tuned, "tuned")
    assert fine_tune.job_id != first.job_id and fine_tune.rows_computed_now == len(REVIEWS)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    templated = job(copy_checkpoint(base, tmp_path / "templated", chat_template=template), "templated")
    assert templated.job_id not in (first.job_id, fine_tune.job_id) and templated.rows_computed_now == len(REVIEWS)


def test_existing_output_is_not_overwritten_without_force(tmp_path, tiny_checkpoint):
    spec = generation_spec(tmp_path)
    out = tmp_path / "answers.parquet"
    out.write_bytes(b"precious")
    with pytest.raises(OutputRefused, match="--force"):
        submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=out, db=tmp_path / "j.db")
    assert out.read_bytes() == b"precious"
    submit(spec, options=JobOptions(model=str(tiny_checkpoint("llama"))), output=out, db=tmp_path / "j.db",
           force=True)
    assert pq.read_table(out).num_rows == len(REVIEWS)


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
