"""The report's charts, drawn by matplotlib as SVG to inline in the page: no JavaScript, nothing fetched.

Every data mark (a bar, a line, a heat map) carries an id starting with `mark-<chart>-`, so a reader of the page (or
its test) can tell the drawn data from axes and ticks. Charts aggregate (histograms, binned lines): a 100,000-row
job draws as many marks as a 100-row one. matplotlib is imported here, on first use, never on `import batchrun`.
"""
from __future__ import annotations

import io
import re
from contextlib import contextmanager
from datetime import datetime
from typing import Iterator, Sequence

WIDTH_IN, HEIGHT_IN = 7.0, 2.8
COLORS = ("#3b6ea5", "#d08c2f", "#5a9e5a", "#b5473f", "#7d5ba6", "#8c8c8c")
_PROLOG = re.compile(r"^.*?(?=<svg)", re.S)  # the XML declaration and DOCTYPE: not part of inline SVG in HTML


@contextmanager
def _figure(name: str, height: float = HEIGHT_IN, width: float = WIDTH_IN) -> Iterator:
    """A figure and its axes under the report's style; the SVG text is left in `holder[0]` when the block ends."""
    import matplotlib
    from matplotlib.figure import Figure  # a bare Figure: no pyplot, no global backend, no display

    # Text stays text (small, selectable, the browser's fonts); the salt makes each chart's internal ids its own, as
    # several charts share one page.
    style = {"svg.fonttype": "none", "svg.hashsalt": f"batchrun-{name}", "font.size": 9, "axes.spines.top": False,
             "axes.spines.right": False, "axes.titlesize": 10, "axes.titleweight": "bold"}
    holder: list[str] = []
    with matplotlib.rc_context(style):
        figure = Figure(figsize=(width, height), layout="constrained")
        axes = figure.add_subplot()
        yield figure, axes, holder
        out = io.StringIO()
        figure.savefig(out, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    holder.append(_PROLOG.sub("", out.getvalue(), count=1))


def _tag(artists, chart: str, what: str) -> None:
    for number, artist in enumerate(artists):
        artist.set_gid(f"mark-{chart}-{what}-{number}")


def bars(name: str, categories: Sequence[str], series: dict[str, Sequence[float]], *, title: str, ylabel: str,
         horizontal: bool = False) -> str:
    """Grouped bars: one group per category, one bar per series (a legend when there are several)."""
    count = max(len(series), 1)
    width = 0.8 / count
    height = max(1.6, 0.24 * len(categories) * count + 1.0) if horizontal else HEIGHT_IN
    with _figure(name, height) as (_, axes, svg):
        positions = list(range(len(categories)))
        for number, (label, values) in enumerate(series.items()):
            offset = [p - 0.4 + width * (number + 0.5) for p in positions]
            color = COLORS[number % len(COLORS)]
            drawn = (axes.barh(offset, values, height=width, label=label, color=color) if horizontal
                     else axes.bar(offset, values, width=width, label=label, color=color))
            _tag(drawn, name, f"s{number}")
        if horizontal:
            axes.set_yticks(positions, [_short(c) for c in categories])
            axes.invert_yaxis()  # the first category on top, as a table reads
            axes.set_xlabel(ylabel)
        else:
            axes.set_xticks(positions, [_short(c) for c in categories], rotation=30 if len(categories) > 6 else 0,
                            ha="right" if len(categories) > 6 else "center")
            axes.set_ylabel(ylabel)
        (axes.xaxis if horizontal else axes.yaxis).set_major_locator(_whole_numbers())
        if len(series) > 1:
            axes.legend(frameon=False)
        axes.set_title(title)
    return svg[0]


def histogram(name: str, values: Sequence[float], *, bins: int, value_range: tuple[float, float] | None, title: str,
              xlabel: str, ylabel: str = "rows", log_y: bool = False) -> str:
    """A histogram of `values` (counted by numpy, one bar per bin however many values)."""
    with _figure(name) as (_, axes, svg):
        _, _, patches = axes.hist(values, bins=bins, range=value_range, color=COLORS[0], edgecolor="white",
                                  linewidth=0.5)
        _tag(patches, name, "bin")
        if log_y:
            axes.set_yscale("log")
        else:
            axes.yaxis.set_major_locator(_whole_numbers())
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
    return svg[0]


def heatmap(name: str, counts: Sequence[Sequence[float]], shares: Sequence[Sequence[float]], *,
            row_labels: Sequence[str], column_labels: Sequence[str], title: str, xlabel: str, ylabel: str) -> str:
    """Cells coloured by `shares` (0..1), annotated with `counts` when the matrix is small enough to read them."""
    size = max(len(row_labels), len(column_labels))
    side = min(7.0, max(3.2, 0.42 * size + 1.8))
    with _figure(name, height=side, width=side + 1.2) as (figure, axes, svg):
        mesh = axes.pcolormesh(shares, cmap="Blues", vmin=0.0, vmax=1.0, edgecolors="white", linewidth=0.5)
        mesh.set_gid(f"mark-{name}-cells")
        axes.set_xticks([i + 0.5 for i in range(len(column_labels))], [_short(c) for c in column_labels],
                        rotation=45, ha="right")
        axes.set_yticks([i + 0.5 for i in range(len(row_labels))], [_short(r) for r in row_labels])
        axes.invert_yaxis()
        if size <= 12:
            for row, line in enumerate(counts):
                for column, count in enumerate(line):
                    if count:
                        dark = shares[row][column] > 0.6
                        axes.text(column + 0.5, row + 0.5, f"{count:,}", ha="center", va="center", fontsize=8,
                                  color="white" if dark else "black")
        scale = figure.colorbar(mesh, ax=axes, label="share of the row", shrink=0.8)
        scale.solids.set_rasterized(False)  # vector, not an embedded PNG: the page holds no image data
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
    return svg[0]


def reliability(name: str, curves: dict[str, tuple[list[float], list[float], list[int]]], *, title: str) -> str:
    """Observed accuracy against confidence, one line per curve of (mean confidence, accuracy, rows) per bin; the
    diagonal is perfect calibration. Marker area follows the rows in the bin."""
    with _figure(name, height=3.4, width=4.6) as (_, axes, svg):
        axes.plot([0, 1], [0, 1], linestyle="--", color="#999999", linewidth=1, label="perfectly calibrated")
        for number, (label, (confidence, accuracy, rows)) in enumerate(curves.items()):
            largest = max(rows, default=1) or 1
            (line,) = axes.plot(confidence, accuracy, color=COLORS[number % len(COLORS)], linewidth=1.5, label=label)
            line.set_gid(f"mark-{name}-line-{number}")
            dots = axes.scatter(confidence, accuracy, s=[12 + 60 * n / largest for n in rows],
                                color=COLORS[number % len(COLORS)], zorder=3)
            dots.set_gid(f"mark-{name}-bins-{number}")
        axes.set_xlim(0, 1)
        axes.set_ylim(0, 1.02)
        axes.set_xlabel("confidence (probability of the chosen answer)")
        axes.set_ylabel("observed accuracy")
        axes.legend(frameon=False, loc="upper left")
        axes.set_title(title)
    return svg[0]


def pass_seconds(name: str, positions: Sequence[float], parts: dict[str, Sequence[float]], *,
                 planned: Sequence[float | None], resumes: Sequence[tuple[float, str]], width: float,
                 xlabel: str) -> str:
    """Stacked bars of seconds per pass (or per group of passes, each bar centred on its passes), the plan's estimate
    as a dotted line, each resume a vertical line named for its run."""
    with _figure(name) as (_, axes, svg):
        bottom = [0.0] * len(positions)
        for number, (label, values) in enumerate(parts.items()):
            drawn = axes.bar(positions, values, width=width * 0.9, bottom=bottom, label=label,
                             color=COLORS[number % len(COLORS)], linewidth=0)
            _tag(drawn, name, f"s{number}")
            bottom = [b + v for b, v in zip(bottom, values)]
        axes.xaxis.set_major_locator(_whole_numbers())
        known = [(p, value) for p, value in zip(positions, planned) if value is not None]
        if known:
            # a dash at each point too: one pass alone still shows its plan
            (line,) = axes.plot([p for p, _ in known], [v for _, v in known], color="#222222", linestyle=":",
                                linewidth=1.2, marker="_", markersize=12, label="planned")
            line.set_gid(f"mark-{name}-planned")
        for position, label in resumes:
            position -= 0.5  # between the run's first pass and the one before it
            axes.axvline(position, color=COLORS[3], linewidth=1, linestyle="--")
            axes.annotate(label, (position, 1), xycoords=("data", "axes fraction"), xytext=(3, -10),
                          textcoords="offset points", color=COLORS[3], fontsize=8)
        axes.set_xlabel(xlabel)
        axes.set_ylabel("seconds")
        axes.set_title("Seconds per pass")
        axes.legend(frameon=False, loc="upper right", fontsize=8)
    return svg[0]


def progress(name: str, runs: Sequence[tuple[str, Sequence[datetime], Sequence[int]]], *,
             stops: Sequence[tuple[datetime, str]], total: int) -> str:
    """Rows finished over wall-clock time, one step line per run; each run that ended early marked where it
    stopped; the job's total as a dotted ceiling."""
    import matplotlib.dates as mdates

    with _figure(name) as (_, axes, svg):
        for number, (label, times, finished) in enumerate(runs):
            (line,) = axes.step(times, finished, where="post", color=COLORS[number % len(COLORS)], linewidth=1.5,
                                label=label)
            line.set_gid(f"mark-{name}-run-{number}")
        for number, (when, label) in enumerate(stops):
            axes.axvline(when, color=COLORS[3], linewidth=1, linestyle="--")
            axes.annotate(label, (mdates.date2num(when), 0.02), xycoords=("data", "axes fraction"), xytext=(3, 0),
                          textcoords="offset points", color=COLORS[3], fontsize=8, rotation=90, va="bottom")
        axes.axhline(total, color="#999999", linestyle=":", linewidth=1)
        # at least 3 ticks: with the default 5, spans such as 4-5 minutes or hours find no interval within 8 ticks
        # and matplotlib warns on the user's terminal
        locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
        axes.xaxis.set_major_locator(locator)
        axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        axes.set_ylim(0, max(total, 1) * 1.05)
        axes.yaxis.set_major_locator(_whole_numbers())
        axes.set_ylabel("rows finished")
        axes.set_title("Rows finished over time (UTC)")
        if len(runs) > 1:
            axes.legend(frameon=False, loc="lower right", fontsize=8)
    return svg[0]


def row_states(name: str, counts: dict[str, int]) -> str:
    """One stacked horizontal bar: the job's rows by state."""
    with _figure(name, height=1.1) as (_, axes, svg):
        left = 0
        for number, (label, count) in enumerate(counts.items()):
            drawn = axes.barh([0], [count], left=left, color=COLORS[(0, 3, 5)[number % 3]], label=f"{label} {count:,}")
            _tag(drawn, name, label)
            left += count
        axes.set_xlim(0, max(left, 1))
        axes.set_yticks([])
        axes.spines["left"].set_visible(False)
        axes.legend(frameon=False, ncols=len(counts), loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=8)
    return svg[0]


def accuracy_against_wait(name: str, points: Sequence[tuple[str, float, float, float, float]], *, title: str,
                          ylabel: str) -> str:
    """One point per model: the whole job's ETA (hours, log scale when they differ tenfold) against accuracy, with
    its 95% interval as an error bar. `points`: (label, eta_hours, rate, low, high)."""
    with _figure(name, 3.2) as (_, axes, svg):
        for number, (label, hours, rate, low, high) in enumerate(points):
            drawn = axes.errorbar([hours], [rate], yerr=[[rate - low], [high - rate]], fmt="o", capsize=4,
                                  color=COLORS[number % len(COLORS)], label=_short(label, 40))
            _tag([drawn.lines[0]], name, "model")
        spread = [hours for _, hours, *_ in points if hours > 0]
        if spread and max(spread) > 10 * min(spread):
            axes.set_xscale("log")
        axes.set_xlabel("whole job, hours (plan)")
        axes.set_ylabel(ylabel)
        axes.set_ylim(0, 1.02)
        axes.legend(frameon=False, loc="lower right")
        axes.set_title(title)
    return svg[0]


def _whole_numbers():
    """Ticks at whole numbers only: rows are counted, never halved."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _short(label: object, limit: int = 24) -> str:
    text = str(label).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
