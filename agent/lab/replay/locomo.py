"""LoCoMo conversations as replay scripts (the benchmark of very long-term conversational memory).

A LoCoMo sample has two speakers and dated sessions of turns ``{speaker, dia_id, text,
blip_caption?}``, and a QA list ``{question, answer, evidence: [dia_id…], category}``
(1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial). The conversion:

- speaker A's turns are the user's messages, speaker B's the assistant's (teacher-forced);
  consecutive turns of one speaker merge into one message; every line is prefixed with its
  speaker's name, shared photos become ``[shares a photo: caption]``, and each session's
  first message opens with the session's date (temporal questions need it);
- the QA become independent probes at the end (asked from the final state and discarded),
  scored by containment of the gold answer and by token F1 against it;
- ``fact_turn`` is the user turn holding the *earliest* evidence line (an assistant line
  counts as the user turn it answers), so the distance is to the oldest fact needed.

Category 5 has no gold answer (only a distractor) and is not converted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import ExplainedError
from agent.lab.replay.script import Probe, Script, ScriptError, Step

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
DEFAULT_CATEGORIES = (1, 2, 3, 4)
_EVIDENCE = re.compile(r"D(\d+):(\d+)")


class LocomoError(ExplainedError, ValueError):
    """A file that is not a LoCoMo sample, or options that select nothing."""


@dataclass(frozen=True)
class Options:
    categories: tuple[int, ...] = DEFAULT_CATEGORIES
    max_sessions: int | None = None
    max_probes: int | None = None


def parse_categories(text: str) -> tuple[int, ...]:
    try:
        cats = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise LocomoError(f"--qa-category: expected numbers like 1,2,4; got {text!r}") from None
    bad = [c for c in cats if c not in CATEGORIES]
    if bad or not cats:
        raise LocomoError(f"--qa-category: categories are 1–4 (1 multi-hop, 2 temporal, 3 open-domain, "
                          f"4 single-hop); got {text!r}")
    if 5 in cats:
        raise LocomoError("--qa-category: category 5 (adversarial) has no gold answer to score against")
    return cats


def samples(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, sample) for each conversation in a file: one sample, a list, or ``{conversation, qa}``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LocomoError(f"{path}: not a readable JSON file ({err})") from None
    items = data if isinstance(data, list) else [data]
    out = []
    for n, item in enumerate(items):
        if not isinstance(item, dict):
            raise LocomoError(f"{path}: sample {n} is not an object")
        conv = item.get("conversation", item)
        if not isinstance(conv, dict) or "speaker_a" not in conv or "session_1" not in conv or "qa" not in item:
            raise LocomoError(f"{path}: sample {n} is not a LoCoMo conversation (needs speaker_a, session_1, qa)")
        name = str(item.get("sample_id") or (path.stem if len(items) == 1 else f"{path.stem}-{n}"))
        out.append((name, {"conversation": conv, "qa": item["qa"]}))
    return out


def _sessions(conv: dict[str, Any]) -> list[tuple[int, str, list[dict[str, Any]]]]:
    found = []
    for key, value in conv.items():
        m = re.fullmatch(r"session_(\d+)", key)
        if m and isinstance(value, list) and value:
            found.append((int(m.group(1)), str(conv.get(f"{key}_date_time", "")), value))
    return sorted(found)


def _line(turn: dict[str, Any]) -> str:
    text = str(turn.get("text", "")).strip()
    caption = turn.get("blip_caption")
    if caption:
        text = f"{text} [shares a photo: {caption}]".strip()
    return f"{turn.get('speaker', '?')}: {text}"


def convert(name: str, sample: dict[str, Any], options: Options = Options()) -> Script:
    """One LoCoMo sample as a script: the dialogue teacher-forced, then the QA as independent probes."""
    conv = sample["conversation"]
    speaker_a, speaker_b = str(conv["speaker_a"]), str(conv["speaker_b"])
    sessions = _sessions(conv)
    if options.max_sessions is not None:
        sessions = sessions[: options.max_sessions]
    kept_sessions = {s for s, _, _ in sessions}

    # Merge the dialogue into alternating messages, remembering where each dia_id landed.
    messages: list[tuple[str, list[str]]] = []
    where: dict[str, int] = {}
    for number, date, turns in sessions:
        for i, utterance in enumerate(turns):
            role = "user" if utterance.get("speaker") == speaker_a else "assistant"
            line = _line(utterance)
            if i == 0 and date:
                line = f"(Session {number}, {date})\n{line}"
            if not messages and role == "assistant":
                messages.append(("user", [f"(A conversation between {speaker_a} and {speaker_b}.)"]))
            if messages and messages[-1][0] == role:
                messages[-1][1].append(line)
            else:
                messages.append((role, [line]))
            if utterance.get("dia_id"):
                where[str(utterance["dia_id"])] = len(messages) - 1

    steps: list[Step] = []
    turn_of_message: dict[int, int] = {}
    turn = 0
    for index, (role, lines) in enumerate(messages):
        text = "\n".join(lines)
        if role == "user":
            turn += 1
            steps.append(Step(turn, text, index + 1))
        else:
            prev = steps[-1]
            steps[-1] = Step(prev.turn, prev.user, prev.lineno, text)
        turn_of_message[index] = turn

    if steps and steps[-1].assistant is None:
        # A trailing user message would make each policy generate (and keep) a different reply.
        last = steps[-1]
        steps[-1] = Step(last.turn, last.user, last.lineno, f"{speaker_b}: (no reply)")
    qa = _select(sample.get("qa", []), options, kept_sessions)
    probe_turn = turn + 1  # independent probes take the next turn's number
    for k, q in enumerate(qa):
        evidence = _EVIDENCE.findall(" ".join(map(str, q.get("evidence", []))))
        evidence_turns = [turn_of_message[where[f"D{s}:{d}"]] for s, d in evidence if f"D{s}:{d}" in where]
        fact_turn = min(evidence_turns) if evidence_turns else None
        answer = str(q["answer"])
        steps.append(Step(probe_turn, f"Question about our conversation: {q['question']} "
                                      "Answer with a short phrase.", len(messages) + k + 1,
                          probe=Probe(expect=(answer,), fact_turn=fact_turn, reference=answer,
                                      category=CATEGORIES[int(q["category"])]),
                          independent=True))
    if not qa:
        raise LocomoError(f"{name}: no QA left after the category/session/probe filters")
    system = (f"This is a long-term chat between {speaker_a} and {speaker_b} over several sessions on different "
              f"dates. The user's messages are {speaker_a}'s and the assistant's are {speaker_b}'s. "
              "Afterwards, answer questions about the conversation with a short phrase.")
    suffix = f"-s{options.max_sessions}" if options.max_sessions is not None else ""
    meta = {"locomo": name, "speakers": [speaker_a, speaker_b], "sessions": len(sessions), "qa": len(qa)}
    return Script(name=f"locomo-{name}{suffix}", system=system, steps=tuple(steps), source=f"locomo:{name}",
                  meta=meta)


def evidence_lines(sample: dict[str, Any], options: Options = Options()) -> list[list[str]]:
    """For each probe :func:`convert` makes of ``sample``, in its order, the lines of its evidence as the script
    writes them (``Speaker: text``, a photo's caption included): which message holds a fact, for a study that needs
    the message and not only the user turn ``fact_turn`` names (an evidence line may be the assistant's)."""
    conv = sample["conversation"]
    sessions = _sessions(conv)
    if options.max_sessions is not None:
        sessions = sessions[: options.max_sessions]
    lines = {str(u["dia_id"]): _line(u) for _, _, turns in sessions for u in turns if u.get("dia_id")}
    out = []
    for q in _select(sample.get("qa", []), options, {s for s, _, _ in sessions}):
        evidence = _EVIDENCE.findall(" ".join(map(str, q.get("evidence", []))))
        out.append([lines[f"D{s}:{d}"] for s, d in evidence if f"D{s}:{d}" in lines])
    return out


def _select(qa: list[dict[str, Any]], options: Options, kept_sessions: set[int]) -> list[dict[str, Any]]:
    chosen = []
    for q in qa:
        if not isinstance(q, dict) or "answer" not in q or "question" not in q:
            continue
        try:
            category = int(q.get("category", 0))
        except (TypeError, ValueError):
            continue
        if category not in options.categories:
            continue
        if options.max_sessions is not None:
            sessions = {int(s) for s, _ in _EVIDENCE.findall(" ".join(map(str, q.get("evidence", []))))}
            # A question whose facts were cut off would score the truncation, not the cache.
            if not sessions or not sessions <= kept_sessions:
                continue
        chosen.append(q)
    if options.max_probes is not None and len(chosen) > options.max_probes:
        # Evenly spaced, so a quick run still spans the whole conversation.
        n = options.max_probes
        chosen = [chosen[round(i * (len(chosen) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 else chosen[:1]
    return chosen


def load(path: str | Path, options: Options = Options()) -> list[Script]:
    """Every conversation of a LoCoMo file as a script."""
    try:
        return [convert(name, sample, options) for name, sample in samples(path)]
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, (LocomoError, ScriptError)):
            raise
        raise LocomoError(f"{path}: unexpected LoCoMo structure ({err!r})") from None
