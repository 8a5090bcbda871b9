"""Rank and restore: before a question is read, the evicted messages nearest it in meaning come back.

A copy from the engine's evicted rows is cheap (no decode), so a turn need not wait for the gate to fire to bring a
message back: the question's text alone ranks the evicted messages, and the best few come back whole at their old
positions before the question is prefilled, so the question is fed once, over them. The rank (``restore_by``):
``meaning``, each message's best-matching sentence under a sentence encoder (:mod:`agent.gate.sentence_encoder`), a
fact said in passing is one sentence of a longer message, with the words the question shares with it (BM25,
:mod:`agent.gate.lexical`) to break near ties; or ``words``, BM25 alone.
They leave again at the turn's end, as a re-read's messages do. A message comes back only where the rows hold every
evicted token of it, as the chat computed them; the gate stays the fallback for what words do not find.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from agent.gate.decision import TargetedRead, copyable
from agent.gate.lexical import bm25_scores, words

if TYPE_CHECKING:
    from agent.llm.engine import Engine


RANKS = ("meaning", "words")
MEANING_FLOOR = 0.25
"""A message comes back by meaning only where its best sentence's cosine to the question reaches this: under every
fact's message on the calibration chats (8k seed 80, 16k seed 82, five LoCoMo conversations: the least 0.27), since
a needless copy costs little and a missed fact costs the answer; a turn that only refers to the last answer ("say
that more briefly") reads under it."""
WORDS_WEIGHT = 0.1
"""BM25, scaled to the best candidate's, added to the cosine: chosen on the same calibration chats among 0.1–0.3 and
min-max fusions (docs/results/NOTES.md); more lets a question's filler words outrank a paraphrased fact."""
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"\w+")


def sentences(text: str) -> list[str]:
    """A message's sentences, split after . ! ? and at line breaks; the whole text where it has none."""
    parts = [x.strip() for x in _SENTENCE.split(text)]
    return [x for x in parts if x] or [text]


SHORT_WORDS = 2
"""Sentences of at most this many words ("Thanks!", "Hi there!", "Wow.") say nothing of a topic, yet match each
other's repeats at a cosine near 1: ranked on, "Thanks! What did I name my cat?" would bring back old thank-yous,
not the cat (on the 16k yardstick that prefix drops recall at 3 from 0.88 to 0.21; docs/results/NOTES.md)."""


def meaning_sentences(text: str) -> list[str]:
    """The sentences a text is ranked by meaning on: those of more than ``SHORT_WORDS`` words, or all of them where
    none is that long."""
    parts = sentences(text)
    return [x for x in parts if len(_WORD.findall(x)) > SHORT_WORDS] or parts


class Ranker:
    """Ranks a chat's messages for a question, ``by`` meaning or words. Holds the sentence encoder (loaded on first
    use), each text's sentence vectors and its word counts, so a message is encoded and counted once however many
    turns rank it."""

    def __init__(self, by: str = "meaning", encoder: Callable[[], Any] | None = None) -> None:
        if by not in RANKS:
            raise ValueError(f"restore_by: one of {', '.join(RANKS)}, got {by!r}")
        self.asked = self.by = by
        self.missing: str | None = None
        """Why ranking by meaning fell back to words (the encoder's package is not installed); None while it has not."""
        self.best: float | None = None
        """The last rank's best reading, floor or not: the nearest message's cosine (meaning) or BM25 (words); None
        when it had no message to rank."""
        self._make = encoder
        self._encoder: Any = None
        self._vectors: dict[str, np.ndarray] = {}
        self._counts: dict[str, Counter[str]] = {}

    def _bm25(self, question: str, texts: Sequence[str]) -> np.ndarray:
        for text in texts:
            if text not in self._counts:
                self._counts[text] = Counter(words(text))
        return bm25_scores(words(question), [self._counts[t] for t in texts])

    def _encode(self, texts: list[str]) -> None:
        if self._encoder is None:
            if self._make is None:
                from agent.gate.sentence_encoder import SentenceEncoder  # noqa: PLC0415 — 90 MB, loaded when used

                self._make = SentenceEncoder
            self._encoder = self._make()
        parts = {t: meaning_sentences(t) for t in dict.fromkeys(texts) if t not in self._vectors}
        flat = [x for ps in parts.values() for x in ps]
        vecs = self._encoder.encode(flat) if flat else np.zeros((0, 0), np.float32)
        at = 0
        for text, ps in parts.items():
            self._vectors[text] = vecs[at:at + len(ps)]
            at += len(ps)

    def rank(self, question: str, texts: dict[int, str]) -> list[tuple[int, float]]:
        """The messages of ``texts`` (index → text), best first, only those over the floor (meaning: a best
        sentence at ``MEANING_FLOOR``; words: a word in common). Ties go to the newer message."""
        indices = sorted(texts)
        self.best = None
        if not indices:
            return []
        bm = self._bm25(question, [texts[i] for i in indices])
        if self.by == "meaning":
            from agent.gate.sentence_encoder import EncoderMissing  # noqa: PLC0415 — the encoder's module, when used

            try:
                self._encode([question] + [texts[i] for i in indices])
            except EncoderMissing as exc:
                self.by, self.missing = "words", f"restore ranks by words only: {exc}"
        if self.by == "words":
            self.best = float(bm.max())
            ranked = sorted(zip(indices, bm.tolist()), key=lambda p: (-p[1], -p[0]))
            return [(i, s) for i, s in ranked if s > 0.0]
        q = self._vectors[question]  # each sentence of a question in several: its best pair with the message's
        cos = np.array([float((self._vectors[texts[i]] @ q.T).max()) for i in indices])
        self.best = float(cos.max())
        score = cos + WORDS_WEIGHT * (bm / bm.max() if bm.max() > 0 else bm)
        ranked_meaning = sorted(zip(indices, score.tolist(), cos.tolist()), key=lambda p: (-p[1], -p[0]))
        return [(i, s) for i, s, c in ranked_meaning if c >= MEANING_FLOOR]


Candidate = tuple[Any, int, list[tuple[int, int]]]
"""An evicted message a copy can put back whole: (the logged message, its first position, its evicted runs)."""


def evicted(engine: "Engine", logged: dict[int, Any]) -> dict[int, Candidate]:
    """The logged messages, by index, with evicted tokens that the engine's rows can put back whole."""
    out: dict[int, Candidate] = {}
    gone = engine.evicted_by_message()
    for index, message in logged.items():
        runs = gone.get(index)
        if not runs or index in engine.homeless:
            continue
        first = copyable(engine, index, message, runs)
        if first is not None:
            out[index] = (message, first, runs)
    return out


def plan(ranker: Ranker, question: str, candidates: dict[int, Candidate], texts: dict[int, str], engine: "Engine",
         messages: int, tokens: int) -> TargetedRead | None:
    """The ``messages`` best-ranked of ``candidates`` (their ``texts`` by index) that come back whole within
    ``tokens`` evicted tokens (and the cache's free cells); None when none does."""
    room = min(tokens, engine.free_cells())
    chosen: list[Candidate] = []
    for index, _ in ranker.rank(question, texts):
        if len(chosen) == messages:
            break
        need = sum(p1 - p0 for p0, p1 in candidates[index][2])
        if need > room:
            continue
        chosen.append(candidates[index])
        room -= need
    return TargetedRead(chosen) if chosen else None
