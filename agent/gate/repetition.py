"""Whether the question repeats an earlier question word for word.

A question that repeats an earlier one's words ("How did your last message start?" asked again, a habitual
opener such as "Before I forget: what is my …") draws the model's attention to that earlier copy: attention heads
that continue a repeated text look at where it was seen before. The sketch reads that pull as an anomaly on the
old message, yet an earlier question tells nothing, so re-reading it cannot help. The gate leaves such messages
out of ``sketch.max`` and of what a targeted re-read picks (agent/gate/decision.py).

Only earlier *questions* count: a statement that shares the question's words is usually the fact it asks about
("What is my gym locker code?" and "My gym locker code is 4172." share four of the fact's six words), and words
alone cannot tell it from a repeat.
"""

from __future__ import annotations

import re

REPEAT_WORDS = 4
"""A run of this many words in the same order counts as repetition (three-word runs such as "my sourdough
starter" are how a question names the fact it asks about, not a copy of the message holding it)."""

REPEATED = 0.5
"""An earlier message whose words are at least this share inside such runs is a repeat of the question."""

_WORD = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def repeated_share(question: str, earlier: str, n: int = REPEAT_WORDS) -> float:
    """The share of ``earlier``'s words that lie in a run of ``n`` consecutive words the question also has."""
    old = words(earlier)
    if not old:
        return 0.0
    new = words(question)
    runs = {tuple(new[i:i + n]) for i in range(len(new) - n + 1)}
    if not runs:
        return 0.0
    covered = [False] * len(old)
    for i in range(len(old) - n + 1):
        if tuple(old[i:i + n]) in runs:
            covered[i:i + n] = [True] * n
    return sum(covered) / len(old)


def asks(text: str) -> bool:
    """The message is a question: it ends with a question mark."""
    return text.rstrip().endswith(("?", "？"))


def is_repeat(question: str, earlier: str) -> bool:
    """``earlier`` is a question whose words the question repeats."""
    return asks(earlier) and repeated_share(question, earlier) >= REPEATED
