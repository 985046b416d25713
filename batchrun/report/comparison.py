"""The page `batchrun compare` writes: each model's accuracy on the labelled rows against the whole job's wait, one
point each with its interval, the figures as a table, and the verdict; with a panel, its figures beside its judges'."""
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
    sections = [Section("compare", "Accuracy against the wait", body)]
    if found.get("panel"):
        sections.append(Section("panel", "Panel", _panel_body(found["panel"])))
    return page(title, f"{len(models)} model{'' if len(models) == 1 else 's'} on {found['sample_rows']} labelled "
                "rows", sections)


def _panel_body(panel: dict) -> str:
    """Each judge's and the panel's accuracy and kappa against the labels on the panel's rows, and the judges'
    agreement among themselves."""
    between = panel["fleiss_kappa"]
    rows = [[name, _rate(figures["accuracy"]), _kappa(figures["kappa"])]
            for name, figures in [(judge["model"], judge) for judge in panel["judges"]] + [("panel", panel["panel"])]]
    agreement = "undefined (one judge, or one answer throughout)" if between is None else _kappa(between)
    return (table(["judge", "accuracy", "kappa against the labels"], rows, name="panel")
            + note(f"The {panel['method']} of the judges' answers on the {panel['rows']} rows all of them answered; "
                   f"Fleiss' kappa between the judges {agreement}. The panel's answers: {panel['output']}."))


def _kappa(estimate: dict | None) -> str:
    if not estimate:
        return "undefined"
    interval = estimate["interval"]
    return f"{estimate['value']:.2f}" + (f" ({interval[0]:.2f} to {interval[1]:.2f})" if interval else "")


def write_comparison(found: dict, path: Path, *, force: bool = False) -> Path:
    html = comparison_page(found)
    return atomic_write(Path(path), lambda temp: Path(temp).write_text(html, encoding="utf-8"), force=force)


def _rate(metrics: dict | None) -> str:
    if not metrics:
        return ""
    low, high = metrics["interval"]
    return f"{metrics['rate']:.1%} ({low:.0%}-{high:.0%})"
