"""`submit` writes the job's report beside its answers after every run, and leaves a file of the user's alone."""
from __future__ import annotations

from tests.job.test_resume import choice_spec, job_status, run_killed, run_to_end, submit_args


def test_submit_writes_the_report_beside_the_answers_after_every_run(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path / "reviews.jsonl", rows=6)
    args = submit_args(spec, tiny_checkpoint("llama"), tmp_path / "j.db", tmp_path / "reviews.answers.parquet",
                       "--batch-size", "2")
    report = tmp_path / "reviews.report.html"
    run_killed(args, "committed:1", tmp_path / "killed.log")  # SIGKILL: no report, nothing runs after the kill
    assert not report.exists() and job_status(tmp_path / "j.db")["rows_pending"] > 0
    run_to_end(args)
    html = report.read_text()
    assert '<meta name="generator" content="batchrun">' in html and "6 of 6 rows finished" in html


def test_a_file_of_the_users_where_the_report_goes_is_left_alone(tmp_path, tiny_checkpoint):
    spec = choice_spec(tmp_path / "reviews.jsonl", rows=2)
    mine = tmp_path / "mine.report.html"
    mine.write_text("<p>my notes</p>")
    summary = run_to_end(submit_args(spec, tiny_checkpoint("llama"), tmp_path / "j.db", tmp_path / "mine.parquet"))
    assert summary["rows_done"] == 2 and mine.read_text() == "<p>my notes</p>"
