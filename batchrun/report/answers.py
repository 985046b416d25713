"""Section 2, the answers: for choice rows what was answered and how surely (the least sure rows listed), the score
of numeric choices; for generation rows how they finished and how long they are."""
from __future__ import annotations

import heapq
from collections import Counter
from typing import Callable, Sequence

from batchrun.report import charts
from batchrun.report.data import CHOICE, GENERATION, ReportData, Rows
from batchrun.report.page import Section, figure, heading, note, shorten, table

MOST_ANSWERS = 25  # bars in an answer distribution; the rest are one "other" bar
LEAST_CONFIDENT_SHOWN = 20
EMPTY_IDS_SHOWN = 20
PROMPT_START = 100  # characters of a prompt shown beside its row
CONFIDENCE_BINS = 20

PromptLookup = Callable[[Sequence[object]], tuple[dict[str, str], str | None]]


def answers_section(data: ReportData, prompts: PromptLookup) -> Section:
    rows = data.rows
    choice, generation = rows.of_kind(CHOICE), rows.of_kind(GENERATION)
    parts = []
    if choice:
        parts += [heading(f"Choice rows ({len(choice):,})"), *_choice_parts(rows, choice, prompts)]
    if generation:
        parts += [heading(f"Generation rows ({len(generation):,})"), *_generation_parts(rows, generation)]
    if not parts:
        parts.append(note("No row is answered yet."))
    return Section("answers", "Answers", "\n".join(parts))


def _choice_parts(rows: Rows, positions: list[int], prompts: PromptLookup) -> list[str]:
    series = {"raw": Counter(rows.own_answer(i) for i in positions)}
    calibrated_positions = [i for i in positions if rows.calibrated and rows.calibrated[i]]
    if calibrated_positions:
        series["calibrated"] = Counter(rows.answers[i] for i in calibrated_positions)
    categories, values, folded = _top_categories(series)
    caption = "How often each choice was answered: raw, the model's own pick" + (
        "; calibrated, the answer the output gives after calibration" if calibrated_positions else "")
    if folded:
        caption += f"; the {folded:,} least frequent answers are one bar, (other)"
    parts = [figure("answer-distribution", charts.bars("answer-distribution", categories, values,
                                                       title="Answers", ylabel="rows",
                                                       horizontal=len(categories) > 8), caption + ".")]
    confidence = [c for c in (rows.confidence(i) for i in positions) if c is not None]
    parts.append(figure("confidence", charts.histogram(
        "confidence", confidence, bins=CONFIDENCE_BINS, value_range=(0.0, 1.0), title="Confidence",
        xlabel="probability of the chosen answer"),
        "Rows by the probability of the answer the output gives" + (" (calibrated)." if calibrated_positions else ".")))
    parts.append(_least_confident(rows, positions, prompts))
    scores = [rows.scores[i] for i in positions if rows.scores[i] is not None]
    if scores:
        parts.append(figure("scores", charts.histogram(
            "scores", scores, bins=30, value_range=None, title="Scores", xlabel="score (probability-weighted mean)"),
            f"{len(scores):,} rows whose choices are all numbers: the probability-weighted mean of the choices."))
    return parts


def _top_categories(series: dict[str, Counter]) -> tuple[list[str], dict[str, list[int]], int]:
    """The most frequent answers over all series (the rest summed into "(other)"), each series' counts of them, and
    how many answers were folded."""
    overall = Counter()
    for counts in series.values():
        overall.update(counts)
    ranked = [answer for answer, _ in overall.most_common()]
    shown, rest = ranked[:MOST_ANSWERS], ranked[MOST_ANSWERS:]
    labels = ["(none)" if a is None else str(a) for a in shown] + (["(other)"] if rest else [])
    values = {name: [counts.get(a, 0) for a in shown] + ([sum(counts.get(a, 0) for a in rest)] if rest else [])
              for name, counts in series.items()}
    return labels, values, len(rest)


def _least_confident(rows: Rows, positions: list[int], prompts: PromptLookup) -> str:
    scored = [(rows.confidence(i), i) for i in positions if rows.confidence(i) is not None]
    least = heapq.nsmallest(LEAST_CONFIDENT_SHOWN, scored)
    found, why_not = prompts([rows.ids[i] for _, i in least])
    calibrated = bool(rows.calibrated) and any(rows.calibrated[i] for _, i in least)
    lines = []
    for confidence, i in least:
        line = [rows.ids[i], shorten(found.get(str(rows.ids[i]), ""), PROMPT_START), rows.answers[i], confidence,
                _probabilities(rows.probs[i])]
        lines.append(line + ([_probabilities(rows.calibrated[i])] if calibrated else []))
    headers = ["id", "prompt (start)", "answer", "confidence", "probabilities"] + (["calibrated"] if calibrated else [])
    parts = [heading("Least confident rows"),
             table(headers, lines, numeric=(3,), left_out=len(scored) - len(least), what="choice rows",
                   name="least-confident")]
    if why_not:
        parts.append(note(f"Prompts are not shown: {why_not}."))
    return "\n".join(parts)


def _probabilities(probs: dict[str, float] | None, shown: int = 5) -> str:
    """'positive 0.512, negative 0.488', the most probable first, at most `shown` choices."""
    if not probs:
        return ""
    ranked = sorted(probs.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{shorten(choice, 30)} {p:.3f}" for choice, p in ranked[:shown])
    return text + (f", … ({len(ranked) - shown} more)" if len(ranked) > shown else "")


def _generation_parts(rows: Rows, positions: list[int]) -> list[str]:
    finishes = Counter(rows.finish[i] for i in positions)
    ordered = [reason for reason in ("stop", "length") if finishes.get(reason)]
    parts = [figure("finish-reasons", charts.bars("finish-reasons", ordered, {"rows": [finishes[r] for r in ordered]},
                                                  title="Finish reasons", ylabel="rows", horizontal=True),
                    "How the generated answers ended: stop, at the end of text or a stop string; length, at "
                    "max_new_tokens.")]
    lengths = [rows.output_tokens[i] for i in positions if rows.output_tokens[i] is not None]
    if lengths:
        longest = max(lengths)
        parts.append(figure("answer-length", charts.histogram(
            "answer-length", lengths, bins=min(40, longest + 1), value_range=(-0.5, longest + 0.5),
            title="Answer length", xlabel="output tokens"), "Rows by the number of tokens generated."))
    empty = [rows.ids[i] for i in positions if rows.answers[i] in ("", None)]
    if empty:
        listed = ", ".join(shorten(row_id, 40) for row_id in empty[:EMPTY_IDS_SHOWN])
        more = f" and {len(empty) - EMPTY_IDS_SHOWN:,} more" if len(empty) > EMPTY_IDS_SHOWN else ""
        parts.append(note(f"{len(empty):,} empty answers (the row stopped before any text): {listed}{more}."))
    else:
        parts.append(note("No empty answers."))
    return parts
