"""Pair rows in the output: a pair row's two orders (two rows of the store, spec/pairs.py) folded back into the one
row the user wrote, with its verdict, and the statistics over a job's pairs that show how much its judge leans on
the order and the length of the answers (docs/judging.md).

P(a wins) in one order is the probability of the choice naming a's slot out of the two, from the probabilities the
output gives (calibrated where the job calibrates). It is written as 1/2 plus half the margin between the two
choices: that equals the choice's probability (the two sum to 1) and keeps identical answers at exactly 1/2 after
rounding, the two orders' margins being the same number.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from batchrun.quality import label_metrics, wilson_interval
from batchrun.store import RowResult

PAIR_COLUMNS = ("p_a_first", "p_a_second", "p_a", "consistent", "a_chars", "b_chars")


@dataclass(frozen=True)
class PairVerdict:
    """One pair row's verdict from its two orders; probabilities are None where an order failed."""

    p_a_first: float | None  # P(a wins) with a in the first slot (order ab)
    p_a_second: float | None  # P(a wins) with a in the second slot (order ba)
    p_a: float | None  # the two averaged: what the pair's verdict follows
    verdict: str | None  # "a", "b", or "tie" where the orders disagree (FastChat's rule)
    consistent: bool | None  # both orders pick the same answer
    a_chars: int
    b_chars: int
    first_slot_picks: tuple[bool, bool] | None = None  # per order, whether the first slot won

    def columns(self) -> dict:
        return {name: getattr(self, name) for name in PAIR_COLUMNS}


def fold_pairs(rows: list, make_row) -> list:
    """`rows` (output rows in input order) with each pair row's two orders folded into one, at the place of its
    first order; `make_row(first, second, verdict)` builds the folded row. A pair row with an order not finished
    yet is left out, as an unfinished row is."""
    by_idx = {row.result.idx: row for row in rows}
    folded = []
    for row in rows:
        pair = row.result.pair
        if pair is None:
            folded.append(row)
            continue
        partner = by_idx.get(row.result.idx + 1)
        if pair["order"] != "ab" or partner is None or (partner.result.pair or {}).get("order") != "ba":
            continue
        folded.append(make_row(row, partner, pair_verdict(row, partner)))
    return folded


def pair_verdict(first, second) -> PairVerdict:
    """The verdict of a pair from its order-ab and order-ba output rows."""
    pair = first.result.pair
    chars = (pair["a_chars"], pair["b_chars"])
    margins = [_first_slot_margin(row) for row in (first, second)]
    if None in margins:
        return PairVerdict(None, None, None, None, None, *chars)
    a_margin_ab, b_margin_ba = margins  # order ba has b in the first slot
    picks = ("a" if a_margin_ab > 0 else "b" if a_margin_ab < 0 else "tie",
             "b" if b_margin_ba > 0 else "a" if b_margin_ba < 0 else "tie")
    consistent = picks[0] == picks[1]
    return PairVerdict(0.5 + a_margin_ab / 2, 0.5 - b_margin_ba / 2, 0.5 + (a_margin_ab - b_margin_ba) / 4,
                       picks[0] if consistent else "tie", consistent, *chars,
                       first_slot_picks=(a_margin_ab > 0, b_margin_ba > 0))


def _first_slot_margin(row) -> float | None:
    """P(first choice) less P(second choice), as the output gives them; None for a failed order."""
    result: RowResult = row.result
    probs = row.calibrated_probs if row.calibrated_probs is not None else result.choice_probs
    if result.failed or probs is None or len(probs) != 2:
        return None
    first, second = probs.values()  # in the order of the row's choices
    return first - second


def folded_result(first: RowResult, second: RowResult) -> RowResult:
    """The store's two rows of a pair as one: the first order's id and carried values, the pair's label, both
    orders' prompt tokens, and an order's error where one failed."""
    failed = [(row.pair["order"], row.error) for row in (first, second) if row.failed]
    error = "; ".join(f"order {order}: {message}" for order, message in failed) or None
    tokens = None if None in (first.prompt_tokens, second.prompt_tokens) else first.prompt_tokens + second.prompt_tokens
    return replace(first, answer=None, choice_probs=None, score=None, logprob=None, prompt_tokens=tokens,
                   output_tokens=None, finish_reason="error" if failed else "choice", error=error,
                   token_ids=None, choice_tokens=None, label=first.pair.get("label"))


def pair_statistics(rows: Sequence) -> dict | None:
    """Over a job's answered pair rows: consistency, first-slot preference and preference for the longer answer,
    each a share with its 95% Wilson interval, and accuracy of the verdicts where pairs carry labels. None: the
    job has no pair rows."""
    pairs = [row.pair for row in rows if getattr(row, "pair", None) is not None]
    if not pairs:
        return None
    judged = [pair for pair in pairs if pair.verdict is not None]
    picks = [pick for pair in judged for pick in pair.first_slot_picks]
    sized = [pair for pair in judged if pair.consistent and pair.verdict != "tie" and pair.a_chars != pair.b_chars]
    longer = sum((pair.verdict == "a") == (pair.a_chars > pair.b_chars) for pair in sized)
    found = {"pairs": len(pairs), "judged": len(judged),
             "consistency": _share(sum(pair.consistent for pair in judged), len(judged)),
             "first_slot": _share(sum(picks), len(picks)),
             "longer": _share(longer, len(sized))}
    labelled = [row for row in rows if getattr(row, "pair", None) is not None and row.result.label is not None
                and row.pair.verdict is not None]
    found["accuracy"] = label_metrics([row.result.label for row in labelled], [row.pair.verdict for row in labelled],
                                      "accuracy").to_json() if labelled else None
    return found


def _share(count: int, total: int) -> dict:
    return {"count": count, "of": total, "rate": count / total if total else None,
            "interval": wilson_interval(count, total)}


def describe_pairs(found: dict) -> list[str]:
    """The pair statistics as terminal lines."""
    lines = [f"pairs: {found['judged']} of {found['pairs']} pair rows judged in both orders (each is two of the "
             "job's rows, one per order)"]
    for key, what in (("consistency", "consistency (both orders agree)"),
                      ("first_slot", "first-slot preference (of the order-wise verdicts)"),
                      ("longer", "longer answer preferred (consistent verdicts, lengths differ)")):
        share = found[key]
        if share["of"]:
            low, high = share["interval"]
            lines.append(f"  {what}: {share['count']}/{share['of']} = {share['rate']:.1%} "
                         f"(95% CI {low:.1%}-{high:.1%})")
    accuracy = found.get("accuracy")
    if accuracy:
        low, high = accuracy["interval"]
        lines.append(f"  verdict accuracy {accuracy['correct']}/{accuracy['labelled']} = {accuracy['rate']:.1%} "
                     f"(95% CI {low:.1%}-{high:.1%}; a split verdict is a tie)")
    return lines
