"""One replay step on a chat session: teacher forcing, independent probes, answers the script replaces.

Replays need what a live chat never does: an answer given instead of generated, a probe answered
and then forgotten, a generated answer swapped for the script's so every policy continues from the
same history. Each is composed here from the session's public turn steps (``begin_turn``,
``answer`` / ``force_answer``, ``finish_turn``, ``checkpoint`` / ``rollback``, ``replace_answer``),
so the live turn carries no replay modes.
"""

from __future__ import annotations

import threading

from agent import events as ev
from agent.chat.session import ChatSession, EventSink


def _ignore(_: ev.Event) -> None:
    return None


def forced(session: ChatSession, text: str, answer: str, on_event: EventSink = _ignore,
           scores: list[float] | None = None) -> ev.TurnResult:
    """``answer`` enters the history as the reply to ``text`` (eviction, certificate and gate still run).
    Given ``scores``, the model's log-probability of each of ``answer``'s tokens after the first is appended."""
    turn = session.begin_turn(text, on_event)
    session.force_answer(turn, answer, score=scores is not None)
    if scores is not None and turn.generation is not None:
        scores.extend(turn.generation.logprobs)
    return session.finish_turn(turn, on_event)


def independent(session: ChatSession, text: str, on_event: EventSink = _ignore,
                cancel: threading.Event | None = None) -> ev.TurnResult:
    """Answer ``text`` from the current state, then put the cache back as it was; both messages are logged
    ``discarded``, so later turns never see them."""
    saved = session.checkpoint()
    turn = session.begin_turn(text, on_event, cancel, meta={"discarded": True})
    session.answer(turn, on_event, cancel)
    result = session.finish_turn(turn, on_event, evict=False)
    session.rollback(saved)
    return result


def replaced(session: ChatSession, text: str, answer: str, on_event: EventSink = _ignore,
             scores: list[float] | None = None) -> ev.TurnResult:
    """Generate (and report) the reply to ``text``, then replace it in the cache and the log with ``answer``,
    so every policy continues from the same history; the turn-end eviction runs after the replacement. Given
    ``scores``, the log-probabilities of ``answer``'s tokens after the first (teacher-forced) are appended."""
    turn = session.begin_turn(text, on_event)
    session.answer(turn, on_event)
    result = session.finish_turn(turn, on_event, evict=False)
    taken = session.replace_answer(turn, answer, score=scores is not None)
    if scores is not None:
        scores.extend(taken)
    session.evict_turn_end(turn, on_event)
    return result
