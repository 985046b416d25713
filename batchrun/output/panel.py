"""A panel of judges: the choice rows every judge's job answered, combined row by row into the panel's answer
(quality.panel), written as a Parquet file with a job's answer columns plus each judge's answer and probabilities,
and judged: Fleiss' kappa between the judges, and each judge's and the panel's accuracy and kappa against the labels.

The panel's answers are a file, not a job of the database: a job's rows are what one model computed, and resuming,
reuse and calibration all read them as such; the panel computes nothing, and is rebuilt from its judges' jobs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.output.answers import JobAnswers, OutputRow
from batchrun.output.files import CHOICE_PROBS_TYPE, PROVENANCE_PREFIX, atomic_write, results_table
from batchrun.quality import cohen_kappa, fleiss_kappa, label_metrics, numeric_score, panel_answer

PANEL_COLUMNS = ("judge_answers", "judge_probs")


@dataclass
class Judge:
    model: str  # the label jobs and plans show
    job_id: str
    answers: JobAnswers


@dataclass
class Panel:
    method: str
    judges: list[Judge]
    rows: list[OutputRow]  # the panel's answers, as a job's output rows
    votes: list[list[OutputRow]]  # per panel row, each judge's row, in the judges' order


def judge_probs(row: OutputRow) -> dict[str, float]:
    """The probabilities a judge's answer comes from: calibrated where its job calibrates."""
    return row.calibrated_probs or row.result.choice_probs


def panel_of(method: str, judges: Sequence[Judge]) -> Panel:
    """The panel's answer to each choice row every judge answered (matched by row id; errored rows and pair rows
    left out), in the first judge's row order."""
    answered = [{row.result.id: row for row in judge.answers.rows
                 if row.pair is None and row.result.choice_probs is not None and not row.result.failed}
                for judge in judges]
    rows, votes = [], []
    for row_id, first in answered[0].items():
        if not all(row_id in rows_of for rows_of in answered):
            continue
        judged = [rows_of[row_id] for rows_of in answered]
        answer, probs = panel_answer(method, [row.answer for row in judged], [judge_probs(row) for row in judged])
        result = replace(first.result, answer=answer, choice_probs=probs, score=numeric_score(probs), logprob=None,
                         prompt_tokens=None, output_tokens=None, token_ids=None, choice_tokens=None)
        label = result.label
        rows.append(OutputRow(result, answer, result.score, None, None,
                              correct=None if label is None else answer == label))
        votes.append(judged)
    return Panel(method, list(judges), rows, votes)


def panel_table(panel: Panel) -> pa.Table:
    """A job's answer columns (the panel's probabilities in `choice_probs`: the judges' mean; `calibrated_probs`
    empty, the judges' own being calibrated already), then each judge's answer and probabilities, in the judges'
    order; the metadata names the method and the judges."""
    table = results_table(panel.rows)
    table = table.append_column("judge_answers", pa.array([[row.answer for row in judged] for judged in panel.votes],
                                                          pa.list_(pa.string())))
    table = table.append_column("judge_probs", pa.array(
        [[list(judge_probs(row).items()) for row in judged] for judged in panel.votes], pa.list_(CHOICE_PROBS_TYPE)))
    about = {"method": panel.method, "judges": [{"model": judge.model, "job_id": judge.job_id}
                                                for judge in panel.judges]}
    return table.replace_schema_metadata({PROVENANCE_PREFIX + "panel": json.dumps(about)})


def write_panel(path: Path, panel: Panel, *, force: bool = False) -> Path:
    """The panel's answers as Parquet at `path`, written atomically; an existing file is replaced only with force."""
    table = panel_table(panel)
    return atomic_write(Path(path), lambda temp: pq.write_table(table, temp), force=force)


def panel_figures(panel: Panel) -> dict:
    """Fleiss' kappa between the judges over the panel's rows, and each judge's and the panel's accuracy and Cohen's
    kappa against the labels over the labelled ones, each with its 95% interval."""
    labelled = [i for i, row in enumerate(panel.rows) if row.result.label is not None]
    labels = [panel.rows[i].result.label for i in labelled]

    def judged(answers: list[str]) -> dict:
        kappa = cohen_kappa(labels, answers) if labels else None
        return {"accuracy": label_metrics(labels, answers).to_json() if labels else None,
                "kappa": kappa.to_json() if kappa else None}

    between = fleiss_kappa([[row.answer for row in judged_rows] for judged_rows in panel.votes])
    return {"method": panel.method, "rows": len(panel.rows), "labelled": len(labels),
            "fleiss_kappa": between.to_json() if between else None,
            "judges": [{"model": judge.model, "job_id": judge.job_id,
                        **judged([panel.votes[i][k].answer for i in labelled])}
                       for k, judge in enumerate(panel.judges)],
            "panel": judged([panel.rows[i].answer for i in labelled])}


def describe_panel(found: dict) -> list[str]:
    """The panel's figures (as panel_figures gives them) as terminal lines."""
    between = found["fleiss_kappa"]
    agreement = "no Fleiss' kappa (one judge, or one answer throughout)" if between is None else \
        f"Fleiss' kappa between the judges {_estimate(between)}"
    lines = [f"panel ({found['method']}) of {len(found['judges'])} judge(s) on the {found['rows']} rows all "
             f"answered: {agreement}"]
    for name, figures in [(judge["model"], judge) for judge in found["judges"]] + [("panel", found["panel"])]:
        lines.append(f"  {name}: {_judged(figures)}")
    return lines


def _judged(figures: dict) -> str:
    accuracy, kappa = figures["accuracy"], figures["kappa"]
    if accuracy is None:
        return "no labelled row"
    low, high = accuracy["interval"]
    return (f"accuracy {accuracy['correct']}/{accuracy['labelled']} = {accuracy['rate']:.1%} ({low:.0%}-{high:.0%}), "
            f"kappa against the labels {'undefined' if kappa is None else _estimate(kappa)}")


def _estimate(estimate: dict) -> str:
    interval = estimate["interval"]
    return f"{estimate['value']:.2f}" + (f" ({interval[0]:.2f} to {interval[1]:.2f})" if interval else "")
