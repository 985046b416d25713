"""The two sweeps of the throughput benchmark, as batchrun specs and as runner jobs (same prompts, same rows).

- classification: a shared instruction block (~230 tokens) + one customer review (~55-85 tokens) per row, scored
  against the choices " positive" / " negative" (single tokens, with the leading space a continuation has, as in
  lm-evaluation-harness; real tokenizers also encode these words as one token each).
- short answer: a shared extraction instruction (~150 tokens) + one support ticket (~40-120 tokens) per row,
  8 new tokens, greedy.

Prompts are raw text (`--raw`): the random-weight checkpoint has no chat training. Texts are deterministic.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

CHOICES = [" positive", " negative"]
SHORT_ANSWER_TOKENS = 8

CLASSIFY_INSTRUCTIONS = [
    "You are a careful analyst working for the customer support team of an online shop.",
    "Read the customer review below and decide whether its overall sentiment is positive or negative.",
    "A review is positive when the customer is satisfied with the product, the delivery or the service, "
    "even if they mention a small problem along the way.",
    "A review is negative when the customer is unhappy, asks for a refund or a replacement, or warns other "
    "people not to buy the product.",
    "Ignore any star rating that is quoted in the text and judge the words themselves.",
    "Sarcasm is common in reviews, so read the whole text before you decide and do not judge from single words.",
    "If the review mixes praise and complaints, decide which one the customer would act on: a customer who keeps "
    "the product and would order again is positive, a customer who sends it back is negative.",
    "Reviews about the delivery only count: a late delivery that made the customer angry is negative.",
    "Answer with exactly one word, positive or negative, and nothing else.",
]
SHORT_ANSWER_INSTRUCTIONS = [
    "You read support tickets for an online shop and extract one fact from each.",
    "Find the name of the product the customer writes about, as they wrote it, and answer with that name only.",
    "If the ticket names several products, give the one the customer has a problem with.",
    "Do not explain, do not repeat the question, and do not add any other words.",
    "Example ticket: my kettle stopped working after a week. Product: kettle.",
]
POSITIVE = [
    "The blender arrived two days early and works perfectly.", "I love the new lamp, it looks great in the office.",
    "Customer service answered my email within an hour and fixed the problem.",
    "The quality of the fabric is much better than I expected for the price.",
    "Setup took five minutes and the instructions were clear.", "My kids use it every day and it still looks new.",
    "The delivery driver was friendly and the box was in perfect condition.",
    "I would order from this shop again without thinking twice.",
]
NEGATIVE = [
    "The kettle stopped working after one week and nobody answers my emails.",
    "The box was crushed and the screen was cracked when I opened it.",
    "I asked for a refund three times and I am still waiting.", "The colour is nothing like the picture on the site.",
    "It is loud, it smells of plastic and the lid does not close.", "Delivery was two weeks late without any notice.",
    "The support team closed my ticket without reading it.", "Do not buy this, it broke on the second day.",
]
NEUTRAL = [
    "I ordered it on Monday for my brother's birthday.", "The package contained the device, a cable and a manual.",
    "We used it mostly in the kitchen and sometimes in the garden.", "My previous one was from another brand.",
    "The invoice came by email the same day.", "I have had it for about a month now.",
]
PRODUCTS = ["coffee grinder", "desk lamp", "rice cooker", "hair dryer", "phone charger", "garden hose", "toaster",
            "electric kettle", "office chair", "baby monitor", "vacuum cleaner", "bread knife"]
TICKET_LINES = [
    "I bought the {p} from your shop last month.", "Since yesterday the {p} makes a strange noise.",
    "The {p} does not turn on any more, even with a new cable.", "Please tell me whether the warranty covers this.",
    "My order number is in the email you sent me.", "I tried the steps from the manual twice.",
    "I would prefer a replacement to a refund.", "Can someone call me in the morning?",
    "The rest of the order was fine.", "It was a present for my mother and she is disappointed.",
]


@dataclass
class Sweep:
    name: str  # "classification" | "short-answer"
    kind: str  # "choice" | "generate"
    ids: list[str]
    prompts: list[str]
    choices: list[str] | None
    max_new_tokens: int

    def write_spec(self, path: Path, rows: int | None = None) -> Path:
        """A batchrun JSONL spec of the first `rows` rows."""
        lines = []
        for row_id, prompt in list(zip(self.ids, self.prompts))[:rows]:
            row = {"id": row_id, "prompt": prompt}
            row.update({"choices": self.choices} if self.kind == "choice" else {"max_new_tokens": self.max_new_tokens})
            lines.append(json.dumps(row))
        path.write_text("\n".join(lines) + "\n")
        return path

    def runner_job(self, checkpoint: Path, dtype: str, rows: int | None = None) -> dict:
        return {"kind": self.kind, "checkpoint": str(checkpoint), "prompts": self.prompts[:rows],
                "choices": self.choices, "max_new_tokens": self.max_new_tokens, "dtype": dtype}


def _grow(sentences, count_tokens, target: int, rng: random.Random | None = None) -> str:
    """Words of the sentences (in order, or sentences drawn with rng) until the text reaches `target` tokens."""
    words: list[str] = []
    index = 0
    while True:
        sentence = rng.choice(sentences) if rng else sentences[index % len(sentences)]
        index += 1
        for word in sentence.split():
            words.append(word)
            if count_tokens(" ".join(words)) >= target:
                text = " ".join(words)
                return text if text.endswith((".", "?", "!")) else text.rstrip(",") + "."


def _distinct(make, seed: int, earlier: list[str]) -> str:
    """make(rng) seeded with `seed`, drawn again (other seeds) while it repeats an earlier prompt: batchrun computes a
    repeated row once and the baselines every time, which would flatter its answers per hour."""
    attempt = 0
    while (prompt := make(random.Random(seed + 100_000 * attempt))) in earlier:
        attempt += 1
    return prompt


def classification(tokenizer, rows: int, instruction_tokens: int = 230,
                   review_tokens: tuple[int, int] = (55, 85)) -> Sweep:
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    instruction = _grow(CLASSIFY_INSTRUCTIONS, count, instruction_tokens)
    prompts: list[str] = []
    for index in range(rows):
        def review_prompt(rng: random.Random) -> str:
            pool = (POSITIVE if index % 2 == 0 else NEGATIVE) * 2 + NEUTRAL
            return f"{instruction}\n\nReview: {_grow(pool, count, rng.randint(*review_tokens), rng)}\nSentiment:"
        prompts.append(_distinct(review_prompt, index, prompts))
    return Sweep("classification", "choice", [f"review-{i}" for i in range(rows)], prompts, CHOICES, 0)


def short_answer(tokenizer, rows: int, instruction_tokens: int = 150, ticket_tokens: tuple[int, int] = (40, 120),
                 max_new_tokens: int = SHORT_ANSWER_TOKENS) -> Sweep:
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    instruction = _grow(SHORT_ANSWER_INSTRUCTIONS, count, instruction_tokens)
    prompts: list[str] = []
    for index in range(rows):
        def ticket_prompt(rng: random.Random) -> str:
            lines = [line.format(p=PRODUCTS[index % len(PRODUCTS)]) for line in TICKET_LINES]
            return f"{instruction}\n\nTicket: {_grow(lines, count, rng.randint(*ticket_tokens), rng)}\nProduct:"
        prompts.append(_distinct(ticket_prompt, 1000 + index, prompts))
    return Sweep("short-answer", "generate", [f"ticket-{i}" for i in range(rows)], prompts, None,
                 max_new_tokens)
