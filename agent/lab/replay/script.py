"""The conversation script format (JSONL, docs/REPLAY_FORMAT.md): parsing and validation.

One message per line, in order: an optional ``system`` line first, then ``user`` and
``assistant`` lines. A user line with a ``probe`` object is scored; ``independent: true``
answers from the current state and is then discarded. Unknown keys are ignored; the first
malformed line raises :class:`ScriptError` naming the file and line.

A script becomes a list of :class:`Step` — one per user message, carrying the assistant
text that follows it (teacher-forced) or ``None`` (the generated answer enters the history).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from agent.errors import ExplainedError
from memory_store import jsonl


class ScriptError(ExplainedError, ValueError):
    """A script that cannot be replayed; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class Probe:
    """What a probe expects: any ``expect`` string in the answer (case-insensitive) is correct."""

    expect: tuple[str, ...]
    fact_turn: int | None = None
    """The user turn (counted from 1) that stated the fact; distance = probe turn − fact_turn."""
    reference: str | None = None
    """A reference answer for token F1 (``probe.answer``; LoCoMo's gold answer)."""
    category: str | None = None
    """A free label for breakdowns (``probe.category``; LoCoMo's QA category)."""


@dataclass(frozen=True)
class Step:
    """One user message and what enters the history after it."""

    turn: int
    """User turn number, from 1. An independent message takes the number the next turn will
    have and does not advance the count (it never becomes part of the history)."""
    user: str
    lineno: int = field(compare=False)
    """Where the message is in its file (provenance; two steps with the same content are equal)."""
    assistant: str | None = None
    """The next line's assistant text (teacher-forced), or None: the generated answer stays."""
    probe: Probe | None = None
    independent: bool = False

    @property
    def distance(self) -> int | None:
        if self.probe is None or self.probe.fact_turn is None:
            return None
        return self.turn - self.probe.fact_turn


@dataclass(frozen=True)
class Script:
    name: str
    system: str | None
    """The script's system text ("" = no system message); None = the run's configured one."""
    steps: tuple[Step, ...]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def probes(self) -> list[Step]:
        return [s for s in self.steps if s.probe is not None]

    @property
    def fact_turns(self) -> set[int]:
        return {s.probe.fact_turn for s in self.probes if s.probe is not None and s.probe.fact_turn is not None}

    def filler_turns(self) -> list[int]:
        """User turns that are neither probes nor the facts a probe asks about."""
        facts = self.fact_turns
        return [s.turn for s in self.steps if s.probe is None and not s.independent and s.turn not in facts]


def _fail(source: str, lineno: int, reason: str) -> ScriptError:
    return ScriptError(f"{source}:{lineno}: {reason}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_probe(source: str, lineno: int, raw: Any, turn: int) -> Probe:
    if not isinstance(raw, dict):
        raise _fail(source, lineno, "\"probe\" must be an object like {\"expect\": [\"4172\"], \"fact_turn\": 3}")
    expect = raw.get("expect")
    if isinstance(expect, str):
        expect = [expect]
    if not isinstance(expect, list) or not expect or not all(isinstance(e, str) and e.strip() for e in expect):
        raise _fail(source, lineno, "\"probe.expect\" must be a non-empty list of non-empty strings")
    fact_turn = raw.get("fact_turn")
    if fact_turn is not None:
        if not _int(fact_turn) or fact_turn < 1:
            raise _fail(source, lineno, f"\"probe.fact_turn\" must be a user turn number ≥ 1, got {fact_turn!r}")
        if fact_turn >= turn:
            raise _fail(source, lineno, f"\"probe.fact_turn\" {fact_turn} is not before the probe (turn {turn})")
    reference = raw.get("answer")
    if reference is not None and not isinstance(reference, (str, int, float)):
        raise _fail(source, lineno, "\"probe.answer\" must be a string")
    category = raw.get("category")
    return Probe(expect=tuple(expect), fact_turn=fact_turn,
                 reference=None if reference is None else str(reference),
                 category=None if category is None else str(category))


def parse(lines: Iterable[str], source: str = "<script>") -> tuple[str | None, list[Step]]:
    """(system text or None, steps) from JSONL lines; blank lines are skipped."""
    system: str | None = None
    steps: list[Step] = []
    turn = 0
    seen = 0
    for lineno, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            data = jsonl.message_line(raw)
        except jsonl.LineError as err:
            raise _fail(source, lineno, str(err)) from None
        role, content = data["role"], data["content"]
        seen += 1
        if role == "system":
            if seen != 1:
                raise _fail(source, lineno, "a system message may only be the first line")
            system = content
            continue
        if role == "assistant":
            if not content.strip():
                raise _fail(source, lineno, "an assistant message needs text")
            if not steps or steps[-1].assistant is not None:
                raise _fail(source, lineno, "an assistant message must follow a user message")
            if steps[-1].independent:
                raise _fail(source, lineno, "an assistant message cannot follow an independent message "
                                            "(its answer is discarded)")
            prev = steps[-1]
            steps[-1] = Step(prev.turn, prev.user, prev.lineno, content, prev.probe, prev.independent)
            continue
        if not content.strip():
            raise _fail(source, lineno, "a user message needs text")
        independent = data.get("independent", False)
        probe_raw = data.get("probe")
        if isinstance(probe_raw, dict) and "independent" in probe_raw and "independent" not in data:
            independent = probe_raw["independent"]
        if not isinstance(independent, bool):
            raise _fail(source, lineno, "\"independent\" must be true or false")
        this_turn = turn + 1
        probe = _parse_probe(source, lineno, probe_raw, this_turn) if probe_raw is not None else None
        if not independent:
            turn = this_turn
        steps.append(Step(this_turn, content, lineno, None, probe, independent))
    if not steps:
        raise ScriptError(f"{source}: no user messages")
    return system, steps


def load(path: str | Path) -> Script:
    """Read and validate a script file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ScriptError(f"{path}: not UTF-8 text (byte offset {err.start})") from None
    except OSError as err:
        raise ScriptError(f"{path}: cannot read ({err.strerror})") from None
    # split("\n"), not splitlines(): a U+2028 inside a JSON string is not a line break.
    try:
        system, steps = parse(text.split("\n"), str(path))
    except ScriptError:
        if _is_locomo(text):
            raise ScriptError(f"{path}: a LoCoMo conversation, not a replay script: pass it with --locomo {path} "
                              "(one --locomo per file)") from None
        raise
    return Script(name=path.stem, system=system, steps=tuple(steps), source=str(path))


def _is_locomo(text: str) -> bool:
    """Whether ``text`` is one JSON object shaped like a LoCoMo conversation file (a common slip: such files given
    after a single ``--locomo`` are read as scripts)."""
    try:
        data = json.loads(text)
    except ValueError:
        return False
    return isinstance(data, dict) and "conversation" in data and "qa" in data


def dump(script: Script, system_meta: dict[str, Any] | None = None) -> str:
    """The script as JSONL text (what :func:`load` reads back); ``system_meta``: keys the system line carries besides
    its content, such as a generator's provenance (the format ignores unknown keys)."""
    out: list[str] = []
    if script.system is not None:
        out.append(json.dumps({"role": "system", "content": script.system, **(system_meta or {})},
                              ensure_ascii=False))
    for step in script.steps:
        line: dict[str, Any] = {"role": "user", "content": step.user}
        if step.probe is not None:
            probe: dict[str, Any] = {"expect": list(step.probe.expect)}
            if step.probe.fact_turn is not None:
                probe["fact_turn"] = step.probe.fact_turn
            if step.probe.reference is not None:
                probe["answer"] = step.probe.reference
            if step.probe.category is not None:
                probe["category"] = step.probe.category
            line["probe"] = probe
        if step.independent:
            line["independent"] = True
        out.append(json.dumps(line, ensure_ascii=False))
        if step.assistant is not None:
            out.append(json.dumps({"role": "assistant", "content": step.assistant}, ensure_ascii=False))
    return "\n".join(out) + "\n"


def save(script: Script, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(script), encoding="utf-8")
    return path
