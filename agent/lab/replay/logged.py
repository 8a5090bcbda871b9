"""A conversation from the SQLite log as a replay script (``certchat replay --conversation ID``).

What the model saw is what gets replayed: the system message, then each user message with
the answer that stayed in the history (discarded and interrupted answers are skipped).
Probe metadata survives a JSONL import (``meta.probe`` / ``meta.independent``) and is used
as it is. A plain chat has no probes: then every answered user message becomes an
*agreement* probe — the policy's answer is generated, compared with the logged answer by
token F1, and the logged answer re-enters the history — so a policy can be judged on any
conversation by how far its answers move from the ones the user actually got.
"""

from __future__ import annotations

from typing import Any

from agent.lab.replay.script import Probe, Script, ScriptError, Step


def _probe(meta: dict[str, Any]) -> Probe | None:
    raw = meta.get("probe")
    if not isinstance(raw, dict):
        return None
    expect = raw.get("expect") or []
    if isinstance(expect, str):
        expect = [expect]
    fact_turn = raw.get("fact_turn")
    return Probe(expect=tuple(str(e) for e in expect),
                 fact_turn=fact_turn if isinstance(fact_turn, int) and not isinstance(fact_turn, bool) else None,
                 reference=None if raw.get("answer") is None else str(raw["answer"]),
                 category=None if raw.get("category") is None else str(raw["category"]))


def from_store(store: Any, conversation_id: int) -> Script:
    conversation = store.get_conversation(conversation_id)
    messages = store.messages(conversation_id)
    system: str | None = None
    steps: list[Step] = []
    turn = 0
    for n, m in enumerate(messages):
        if m.role == "system":
            if n == 0:
                system = m.content
            continue
        if m.role == "user":
            independent = bool(m.meta.get("independent") or m.meta.get("discarded"))
            this_turn = turn + 1
            if not independent:
                turn = this_turn
            steps.append(Step(this_turn, m.content, m.index, None, _probe(m.meta), independent))
            continue
        # An assistant answer counts when it is the one that stayed in the history.
        if m.meta.get("discarded") or m.status != "complete" or not steps:
            continue
        last = steps[-1]
        if last.independent or last.assistant is not None:
            continue
        steps[-1] = Step(last.turn, last.user, last.lineno, m.content, last.probe, last.independent)
    if not steps:
        raise ScriptError(f"conversation {conversation_id}: no user messages to replay")
    if not any(s.probe is not None for s in steps):
        steps = [s if s.independent or s.assistant is None else
                 Step(s.turn, s.user, s.lineno, s.assistant, Probe(expect=(), reference=s.assistant,
                                                                   category="agreement"))
                 for s in steps]
    return Script(name=f"conversation-{conversation_id}", system=system if system is not None else "",
                  steps=tuple(steps), source=f"{store.path}#{conversation_id}",
                  meta={"title": conversation.title, "model": conversation.model})
