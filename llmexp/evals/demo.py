"""The demo task (`eval=demo`): "which line comes next?", built from the held-out part of the run's data (its items:
docs/how-to/evals.md's table). On the default data (the standard library's held-out files, which training never sees)
a model that learns Python ranks the true line first more often as it trains, from chance (0.25) up. Built the same
way on every machine from the same data (a seeded RNG), so it needs no download and no shipped file.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from llmexp.data.corpora import Record, plain_text
from llmexp.evals.items import ChoiceItem

CONTEXT_LINES = 4
"""Lines before the one to guess (the context)."""
CHOICES = 4
MIN_CHARS, MAX_CHARS = 12, 72
"""A candidate line's length without its indentation: long enough to say something, short enough to be one line."""


def _candidate(line: str) -> bool:
    body = line.strip()
    return MIN_CHARS <= len(body) <= MAX_CHARS and not body.startswith(("#", '"', "'"))  # code, not text


def demo_items(records: Sequence[Record], n: int, seed: int = 0) -> list[ChoiceItem]:
    """`n` next-line items from the records (fewer when they hold fewer candidate lines). The context ends
    with the newline and the indentation of the line to guess, so the choices differ in content only."""
    docs = [plain_text(r).splitlines() for r in records]
    spots = [(d, i) for d, lines in enumerate(docs) for i in range(CONTEXT_LINES, len(lines))
             if _candidate(lines[i]) and all(lines[j].strip() for j in range(i - CONTEXT_LINES, i))]
    if len(docs) < 2 or not spots:
        return []
    rng = random.Random(seed)
    items = []
    for d, i in rng.sample(spots, min(n, len(spots))):
        lines = docs[d]
        indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
        context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n" + indent
        truth = lines[i].strip()
        others = [s for s in rng.sample(spots, min(len(spots), 8 * CHOICES)) if s[0] != d]
        distractors = list(dict.fromkeys(docs[od][oi].strip() for od, oi in others if docs[od][oi].strip() != truth))
        if len(distractors) < CHOICES - 1:
            continue
        choices = [truth, *distractors[:CHOICES - 1]]
        rng.shuffle(choices)
        items.append(ChoiceItem(context, tuple(choices), choices.index(truth)))
    return items
