"""The agreement part of section 3: kappa, weighted kappa, the score's rank correlations and mean absolute error
against numeric labels with their intervals, the most confident disagreements, and each verdict's share corrected
for the answers' errors. All of it comes from the output's job_quality "agreement" (quality.agreement's figures)."""
from __future__ import annotations

from batchrun.report.answers import PROMPT_START, PromptLookup
from batchrun.report.page import heading, note, percent, shorten, table

FIGURES = (("kappa", "Cohen's kappa (answer against label)"),
           ("weighted_kappa", "quadratic-weighted kappa (ordered choices)"),
           ("spearman", "Spearman's rho (score against label)"), ("kendall", "Kendall's tau-b (score against label)"),
           ("mae", "mean absolute error (score against label)"))


def agreement_parts(found: dict | None, prompts: PromptLookup | None) -> list[str]:
    if not found:
        return []
    parts = [heading("Agreement"), _figures(found), *_disagreements(found, prompts)]
    if found.get("shares"):
        parts += _shares(found["shares"])
    return parts


def _figures(found: dict) -> str:
    lines = [[name, found[key]["value"], _span(found[key]["interval"], "{:.3f}"), found[key]["rows"]]
             for key, name in FIGURES if found.get(key)]
    how = (f"95% intervals: the 2.5th and 97.5th percentiles over {found['resamples']:,} bootstrap resamples of the "
           f"labelled rows (seed {found['seed']}, so the same rows give the same intervals).")
    if found.get("scale"):
        how += " Weighted kappa weighs a disagreement by the squared distance of the two places on the scale " + \
               ", ".join(found["scale"]) + "."
    if found.get("single_answer") is not None:
        how += (f" Every labelled row was answered {found['single_answer']!r}: kappa is 0 whatever the labels, and its "
                "interval says nothing of the judge.")
    return table(["figure", "value", "95% interval", "rows"], lines, numeric=(1, 3), name="agreement") + note(how)


def _disagreements(found: dict, prompts: PromptLookup | None) -> list[str]:
    shown = found.get("most_confident_disagreements") or []
    if not shown:
        return [note("Every labelled row is answered with its label: no disagreement to list.")]
    texts, why_not = prompts([row["id"] for row in shown]) if prompts else ({}, None)
    lines = [[row["id"], shorten(texts.get(str(row["id"]), ""), PROMPT_START), row["label"], row["answer"],
              row["confidence"]] for row in shown]
    parts = [heading("Most confident disagreements"),
             table(["id", "prompt (start)", "label", "answer", "confidence"], lines, numeric=(4,),
                   left_out=found["disagreements"] - len(shown), what="disagreeing rows", name="disagreements"),
             note("Labelled rows answered otherwise, the surest answers first: where the answers are most "
                  "confidently wrong, or the label is.")]
    if why_not:
        parts.append(note(f"Prompts are not shown: {why_not}."))
    return parts


def _shares(shares: list[dict]) -> list[str]:
    lines = [[share["verdict"], percent(share["raw"]),
              percent(share["corrected"]) if share["corrected"] is not None else "n/a",
              _span(share["interval"], "{:.1%}"), share["sensitivity"], share["specificity"]] for share in shares]
    reasons = sorted({f"{share['verdict']}: {share['why_not']}" for share in shares if share["why_not"]})
    rows, labelled = shares[0]["rows"], shares[0]["labelled"]
    parts = [heading("Share of each verdict, corrected for the answers' errors"),
             table(["verdict", "raw share", "corrected share", "95% interval", "sensitivity", "specificity"], lines,
                   numeric=(1, 2, 4, 5), name="corrected-shares"),
             note(f"Raw: the share of the {rows:,} answered choice rows given the verdict. Corrected (Rogan-Gladen): "
                  "(raw + specificity - 1) / (sensitivity + specificity - 1), clipped to 0-100%, with sensitivity "
                  f"and specificity measured on the {labelled:,} labelled rows; its interval is a bootstrap over "
                  "both.")]
    if reasons:
        parts.append(note("n/a: " + "; ".join(reasons) + "."))
    return parts


def _span(interval: list[float] | None, form: str) -> str:
    return "" if not interval else f"{form.format(interval[0])} to {form.format(interval[1])}"
