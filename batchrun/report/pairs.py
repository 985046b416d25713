"""The pair rows' section: how far the judge's verdicts hang on the order of the answers and on their length, each
share with its 95% interval (the output's pair statistics, docs/judging.md). Only a job with pair rows has it."""
from __future__ import annotations

from batchrun.report.data import ReportData
from batchrun.report.page import Section, note, percent, table

MEASURES = (
    ("consistency", "Consistency", "pairs whose two orders pick the same answer"),
    ("first_slot", "First-slot preference", "order-wise verdicts that pick the first slot (50% is no lean)"),
    ("longer", "Longer answer preferred", "consistent verdicts on answers of different lengths won by the longer"),
)


def pair_sections(data: ReportData) -> list[Section]:
    found = (data.quality or {}).get("pairs")
    if not found:
        return []
    rows = []
    for key, name, meaning in MEASURES:
        share = found[key]
        low, high = share["interval"] or (None, None)
        rows.append([name, percent(share["rate"]), f"{percent(low)} to {percent(high)}" if share["of"] else "-",
                     f"{share['count']:,} of {share['of']:,}", meaning])
    accuracy = found.get("accuracy")
    if accuracy:
        low, high = accuracy["interval"]
        rows.append(["Verdict accuracy", percent(accuracy["rate"]), f"{percent(low)} to {percent(high)}",
                     f"{accuracy['correct']:,} of {accuracy['labelled']:,}",
                     "labelled pairs whose verdict matches the label (a split verdict is a tie)"])
    parts = [note(f"{found['judged']:,} of {found['pairs']:,} pair rows judged in both orders; a pair's verdict "
                  "follows P(a wins) averaged over the orders, and a verdict that flips with the order is a tie."),
             table(["Measure", "Share", "95% interval", "Count", "What it counts"], rows, numeric=(1, 3),
                   name="pairs")]
    return [Section("pairs", "Pairs judged in both orders", "\n".join(parts))]
