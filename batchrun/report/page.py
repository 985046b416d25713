"""The page around the charts: one HTML file with its style inline, sections, capped tables, escaped text.

Nothing on the page points outside it: no script, no stylesheet or font to fetch, only `#section` links.
"""
from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Sequence

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: #222; margin: 0;
       background: #f6f6f4; }
main { max-width: 1100px; margin: 0 auto; padding: 12px 24px 48px; }
header { background: #26364a; color: #fff; padding: 14px 24px; }
header h1 { margin: 0; font-size: 20px; }
header p { margin: 4px 0 0; color: #cfd8e3; }
nav { margin: 10px 0 0; }
nav a { color: #fff; margin-right: 16px; }
section { background: #fff; border: 1px solid #e2e2de; border-radius: 6px; padding: 4px 20px 16px; margin: 18px 0; }
h2 { font-size: 18px; border-bottom: 1px solid #e2e2de; padding-bottom: 6px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 10px; font-size: 13px; }
th, td { border-bottom: 1px solid #ecece8; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.facts th { width: 230px; }
figure.chart { margin: 10px 0; }
figure.chart svg { max-width: 100%; height: auto; }
figcaption, p.note, tr.more td { color: #666; font-size: 12.5px; }
p.snapshot { background: #fff4d6; border: 1px solid #ecd48a; padding: 6px 10px; border-radius: 4px; }
code, .text { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; white-space: pre-wrap;
              overflow-wrap: break-word; }
.bad { color: #b5473f; font-weight: 600; }
"""


@dataclass(frozen=True)
class Section:
    anchor: str  # the element id and the nav link's target
    title: str
    body: str  # HTML

# Marks a file as a batchrun report, which `submit` may replace after each run; any other file is the user's.
GENERATOR_META = '<meta name="generator" content="batchrun">'


def page(title: str, subtitle: str, sections: Sequence[Section]) -> str:
    nav = "".join(f'<a href="#{s.anchor}">{escape(s.title)}</a>' for s in sections)
    body = "\n".join(f'<section id="{s.anchor}">\n<h2>{escape(s.title)}</h2>\n{s.body}\n</section>' for s in sections)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'{GENERATOR_META}\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{escape(title)}</title>\n'
            f"<style>{STYLE}</style>\n</head>\n<body>\n<header><h1>{escape(title)}</h1><p>{escape(subtitle)}</p>"
            f"<nav>{nav}</nav></header>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def figure(name: str, svg: str, caption: str = "") -> str:
    """A chart: its inline SVG and a caption saying what it shows."""
    caption_html = f"<figcaption>{escape(caption)}</figcaption>" if caption else ""
    return f'<figure class="chart" data-chart="{escape(name)}">{svg}{caption_html}</figure>'


def facts(pairs: Sequence[tuple[str, str]]) -> str:
    """A two-column table of label and (already escaped) value."""
    rows = "".join(f"<tr><th>{escape(label)}</th><td>{value}</td></tr>" for label, value in pairs)
    return f'<table class="facts">{rows}</table>'


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, left_out: int = 0, what: str = "rows",
          numeric: Sequence[int] = (), name: str = "") -> str:
    """A table of escaped cells; `left_out` > 0 adds a last line saying how many more `what` are not shown.
    Columns in `numeric` are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    lines = []
    for row in rows:
        cells = "".join(f'<td class="{"num" if column in numeric else "text"}">{escape(_cell(value))}</td>'
                        for column, value in enumerate(row))
        lines.append(f"<tr>{cells}</tr>")
    if left_out > 0:
        lines.append(f'<tr class="more"><td colspan="{len(headers)}">… and {left_out:,} more {escape(what)} '
                     "not shown</td></tr>")
    marker = f' data-table="{escape(name)}"' if name else ""
    return f"<table{marker}><tr>{head}</tr>{''.join(lines)}</table>"


def note(text: str, css: str = "note") -> str:
    return f'<p class="{css}">{escape(text)}</p>'


def heading(text: str) -> str:
    return f"<h3>{escape(text)}</h3>"


def percent(part: float | None) -> str:
    return "unknown" if part is None else f"{part:.1%}"


def shorten(text: object, limit: int) -> str:
    value = " ".join(str(text).split())
    return value if len(value) <= limit else value[: limit - 1] + "…"


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
