"""Section 5, the errored rows, grouped by reason: rows refused for the same cause (a prompt over the context, a
malformed line) form one group, whatever their numbers and line locations."""
from __future__ import annotations

import re
from html import escape

from batchrun.report import charts
from batchrun.report.data import ReportData
from batchrun.report.page import Section, figure, note, shorten, table

GROUPS_SHOWN = 20
ROWS_SHOWN_PER_GROUP = 10
_LOCATION = re.compile(r"^(?:.*?(?::\d+|: row \d+)): (?P<reason>.*)$", re.S)  # "spec.jsonl:12: " / "x.parquet: row 3: "
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def reason_group(message: str) -> str:
    """What a row's error says without its location and numbers: "prompt has N tokens; the context holds N"."""
    located = _LOCATION.match(message)
    reason = located.group("reason") if located else message
    return _NUMBER.sub("N", " ".join(reason.split()))


def errors_section(data: ReportData) -> Section:
    rows = data.rows
    errored = rows.errored()
    if not errored:
        return Section("errors", "Errors", note("No row errored."))
    groups: dict[str, list[int]] = {}
    for i in errored:
        groups.setdefault(reason_group(rows.errors[i] or "no reason recorded"), []).append(i)
    ranked = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    shown = ranked[:GROUPS_SHOWN]
    parts = [note(f"{len(errored):,} rows errored, for {len(groups):,} distinct reason"
                  f"{'s' if len(groups) != 1 else ''}.", "bad")]
    parts.append(figure("error-reasons", charts.bars(
        "error-reasons", [shorten(reason, 60) for reason, _ in shown], {"rows": [len(m) for _, m in shown]},
        title="Errors by reason", ylabel="rows", horizontal=True), "Errored rows by reason (numbers shown as N)."))
    for reason, members in shown:
        lines = [[rows.ids[i], rows.errors[i]] for i in members[:ROWS_SHOWN_PER_GROUP]]
        parts.append(f'<h3 class="reason">{escape(reason)} <span class="note">({len(members):,} rows)</span></h3>')
        parts.append(table(["id", "error"], lines, left_out=len(members) - len(lines), what="rows with this reason",
                           name="errors"))
    if len(ranked) > len(shown):
        rest = ranked[len(shown):]
        parts.append(note(f"… and {len(rest):,} more reasons, covering {sum(len(m) for _, m in rest):,} rows, not "
                          "shown."))
    return Section("errors", "Errors", "\n".join(parts))
