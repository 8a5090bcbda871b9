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

from agent.gate.decision import TargetedRead, fed_span
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


def evicted(engine: "Engine", logged: dict[int, Any]) -> list[int]:
    """The logged messages with evicted tokens that the engine's rows can put back whole."""
    rows = engine.rows
    if rows is None:
        return []
    out = []
    for index, message in logged.items():
        if index in engine.homeless:
            continue
        runs = engine.evicted_runs(index)
        span = fed_span(engine, index, message)
        if not runs or span is None:
            continue
        toks = [int(t) for t in message.tokens]
        if all(rows.covers(p0, toks[p0 - span[0]:p1 - span[0]]) for p0, p1 in runs):
            out.append(index)
    return out


def plan(question: str, logged: dict[int, Any], texts: dict[int, str], engine: "Engine", messages: int,
         tokens: int) -> TargetedRead | None:
    """The ``messages`` best-ranked evicted messages of ``texts`` that come back whole within ``tokens`` evicted
    tokens (and the cache's free cells); None when none does."""
    room = min(tokens, engine.free_cells())
    chosen: list[tuple[Any, int, list[tuple[int, int]]]] = []
    for index, _ in rank(question, texts):
        if len(chosen) == messages:
            break
        message = logged[index]
        span = fed_span(engine, index, message)
        runs = engine.evicted_runs(index)
        need = sum(p1 - p0 for p0, p1 in runs)
        if span is None or need > room:
            continue
        chosen.append((message, span[0], runs))
        room -= need
    return TargetedRead(chosen) if chosen else None
