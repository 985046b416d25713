"""The page `batchrun compare` writes: each model's accuracy on the labelled rows against the whole job's wait, one
point each with its interval, the figures as a table, and the verdict."""
from __future__ import annotations

from html import escape
from pathlib import Path

from batchrun.output import atomic_write
from batchrun.report.charts import accuracy_against_wait
from batchrun.report.page import Section, figure, note, page, table


def comparison_page(found: dict) -> str:
    """`found`: a comparison as `compare --json` prints it."""
    models = found["models"]
    metric = "accuracy" if models[0]["metric"] == "accuracy" else "exact match"
    points = [(model["model"], (model["eta_seconds"] or 0) / 3600, judged["rate"], *judged["interval"])
              for model in models for judged in [model["calibrated"] or model["raw"]]
              if model["eta_seconds"]]
    chart = accuracy_against_wait("compare", points, title=f"{metric} against the whole job's wait",
                                  ylabel=f"{metric} (95% interval)") if points else ""
    rows = [[model["model"], _rate(model["raw"]), _rate(model["calibrated"]), model["calibration"], model["passes"],
             model["eta_human"] or "does not fit"] for model in models]
    body = (f"<p><strong>{escape(found['verdict'])}</strong></p>"
            + (figure("compare", chart, "One point per model: its accuracy on the labelled rows (calibrated where "
                                        "calibration changed anything) with its 95% interval, against the plan's "
                                        "ETA for the whole job.") if chart else note("No model's plan fits."))
            + table(["model", f"{metric} (raw)", f"{metric} (calibrated)", "calibration", "passes", "whole job"], rows,
                    name="compare")
            + note(f"{found['sample_rows']} of the spec's {found['labelled_rows']} labelled rows, stratified by label, "
                   "ran on each model; the runs are stored, so a later submit reuses them."))
    title = f"batchrun compare: {Path(found['spec']).name}"
    return page(title, f"{len(models)} models on {found['sample_rows']} labelled rows",
                [Section("compare", "Accuracy against the wait", body)])


def write_comparison(found: dict, path: Path, *, force: bool = False) -> Path:
    html = comparison_page(found)
    return atomic_write(Path(path), lambda temp: Path(temp).write_text(html, encoding="utf-8"), force=force)


def _rate(metrics: dict | None) -> str:
    if not metrics:
        return ""
    low, high = metrics["interval"]
    return f"{metrics['rate']:.1%} ({low:.0%}-{high:.0%})"
