"""The structured answers' section: how many structured rows validate against their schema, fail it, or were cut by
their token limit; each field's accuracy against JSON labels with its 95% interval and the confusion counts of enum
fields; and the rows the grammar forced hardest. All of it comes from the output's job_quality ("structured" from
structured_counts, "fields" from field_figures). Only a job with structured rows has it."""
from __future__ import annotations

from batchrun.report.answers import PROMPT_START, PromptLookup
from batchrun.report.data import ReportData
from batchrun.report.page import Section, heading, note, percent, shorten, table


def structured_sections(data: ReportData, prompts: PromptLookup | None = None) -> list[Section]:
    quality = data.quality or {}
    counts = quality.get("structured")
    if not counts:
        return []
    parts = _count_parts(counts)
    if quality.get("fields"):
        parts += _field_parts(quality["fields"])
    parts += _forced_parts(counts.get("forced_hardest") or [], prompts)
    return [Section("structured", "Structured answers", "\n".join(parts))]


def _count_parts(counts: dict) -> list[str]:
    total = counts["rows"]
    lines = [[name, counts[key], percent(counts[key] / total if total else None), meaning]
             for key, name, meaning in (
                 ("valid", "Valid", "the answer's JSON validates against its schema (or matches its pattern)"),
                 ("invalid", "Invalid", "the answer fails its schema or pattern (schema_errors names where)"),
                 ("cut", "Cut", "the token limit cut the answer before its JSON closed (json_incomplete)"))]
    return [table(["rows", "count", "share", "what it counts"], lines, numeric=(1, 2), name="structured-counts"),
            note(f"{total:,} structured rows answered; the validator checks each answer apart from the grammar that "
                 "decoded it.")]


def _field_parts(fields: dict) -> list[str]:
    whole = fields["whole"]
    ranked = sorted(fields["per_field"].items(), key=lambda item: (item[1]["rate"], item[0]))  # worst first
    lines = [["(whole value)", *_rate_cells(whole)]] + [[pointer, *_rate_cells(figures)] for pointer, figures in ranked]
    parts = [heading("Fields against their JSON labels"),
             table(["field", "accuracy", "95% interval", "correct"], lines, numeric=(1, 3), name="field-accuracy"),
             note("Each field the label names (a JSON pointer) is right where the answer holds the label's value; "
                  "a row with no JSON gets every field wrong. Intervals are Wilson score intervals.")]
    confusion = [[pointer, label, answer, count] for pointer, figures in ranked
                 for label, answers in sorted((figures.get("confusion") or {}).items())
                 for answer, count in sorted(answers.items(), key=lambda item: (-item[1], item[0]))]
    if confusion:
        parts += [heading("Enum fields: label against answer"),
                  table(["field", "label", "answer", "rows"], confusion, numeric=(3,), name="field-confusion")]
    return parts


def _rate_cells(figures: dict) -> list[object]:
    low, high = figures["interval"]
    return [percent(figures["rate"]), f"{percent(low)} to {percent(high)}",
            f"{figures['correct']:,} of {figures['labelled']:,}"]


def _forced_parts(hardest: list[dict], prompts: PromptLookup | None) -> list[str]:
    if not hardest:
        return [heading("Forced hardest"), note("The grammar never refused the model's top token on these rows.")]
    texts, why_not = prompts([row["id"] for row in hardest]) if prompts else ({}, None)
    lines = [[row["id"], shorten(texts.get(str(row["id"]), ""), PROMPT_START), row["overrides"],
              "" if row["lowest_logprob"] is None else f"{row['lowest_logprob']:.2f}"] for row in hardest]
    parts = [heading("Forced hardest"),
             table(["id", "prompt (start)", "overrides", "lowest logprob"], lines, numeric=(2, 3),
                   name="forced-hardest"),
             note("The rows where the grammar most often refused the model's top token, with the lowest "
                  "log-probability of a token it chose: where the schema and the model disagree most.")]
    if why_not:
        parts.append(note(f"Prompts are not shown: {why_not}."))
    return parts
