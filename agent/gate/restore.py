"""Rank and restore: before a question is read, the evicted messages it shares the most words with come back.

A copy from the engine's evicted rows is cheap (no decode), so a turn need not wait for the gate to fire to bring a
message back: the question's text alone ranks the evicted messages (BM25, :mod:`agent.gate.lexical`), and the best
few come back whole at their old positions before the question is prefilled, so the question is fed once, over them.
They leave again at the turn's end, as a re-read's messages do. A message comes back only where the rows hold every
evicted token of it, as the chat computed them; the gate stays the fallback for what words do not find.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from agent.gate.decision import TargetedRead, copyable
from agent.gate.lexical import bm25_scores, words

if TYPE_CHECKING:
    from agent.llm.engine import Engine


def rank(question: str, texts: dict[int, str]) -> list[tuple[int, float]]:
    """The messages of ``texts`` (index → text) by BM25 of ``question`` against them, best first; only those
    sharing a word with it. Ties go to the newer message."""
    indices = sorted(texts)
    scores = bm25_scores(words(question), [Counter(words(texts[i])) for i in indices])
    ranked = sorted(zip(indices, scores.tolist()), key=lambda p: (-p[1], -p[0]))
    return [(i, s) for i, s in ranked if s > 0.0]


Candidate = tuple[Any, int, list[tuple[int, int]]]
"""An evicted message a copy can put back whole: (the logged message, its first position, its evicted runs)."""


def evicted(engine: "Engine", logged: dict[int, Any]) -> dict[int, Candidate]:
    """The logged messages, by index, with evicted tokens that the engine's rows can put back whole."""
    out: dict[int, Candidate] = {}
    for index, message in logged.items():
        if index in engine.homeless:
            continue
        runs = engine.evicted_runs(index)
        first = copyable(engine, index, message, runs) if runs else None
        if first is not None:
            out[index] = (message, first, runs)
    return out


def plan(question: str, candidates: dict[int, Candidate], texts: dict[int, str], engine: "Engine", messages: int,
         tokens: int) -> TargetedRead | None:
    """The ``messages`` best-ranked of ``candidates`` (their ``texts`` by index) that come back whole within
    ``tokens`` evicted tokens (and the cache's free cells); None when none does."""
    room = min(tokens, engine.free_cells())
    chosen: list[Candidate] = []
    for index, _ in rank(question, texts):
        if len(chosen) == messages:
            break
        need = sum(p1 - p0 for p0, p1 in candidates[index][2])
        if need > room:
            continue
        chosen.append(candidates[index])
        room -= need
    return TargetedRead(chosen) if chosen else None
