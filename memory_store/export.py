"""A conversation as a replay JSONL file or as Markdown, and JSONL back in.

The JSONL is the evaluation's replay format: one message per line,
``{"role": "system"|"user"|"assistant", "content": ...}``; a probe is a user
line with ``"probe": {"expect": [...], "fact_turn": N}`` and optionally
``"independent": true``. Export adds keys a replay reader ignores: ``status``,
``tokens`` and ``first_pos`` (the exact ids the model saw), ``meta`` (other
per-message metadata) and, on the first line only, ``conversation`` (title,
model, settings). Import reads all of them back, ignores any other key, and
names the file and line of the first malformed line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from memory_store import jsonl
from memory_store.errors import ImportFormatError
from memory_store.records import STATUSES, Conversation, Message
from memory_store.store import Store

# Replay keys kept in a message's meta and written back at top level.
_REPLAY_KEYS = ("probe", "independent")


def message_to_json(message: Message, *, tokens: bool = True) -> dict[str, Any]:
    line: dict[str, Any] = {"role": message.role, "content": message.content, "status": message.status}
    meta = dict(message.meta)
    for key in _REPLAY_KEYS:
        if key in meta:
            line[key] = meta.pop(key)
    if meta:
        line["meta"] = meta
    if tokens and message.tokens is not None:
        line["tokens"] = message.tokens.tolist()
        line["first_pos"] = message.first_pos
    return line


def export_jsonl(store: Store, conversation_id: int, out: IO[str], *, tokens: bool = True) -> int:
    """Write the conversation as replay JSONL; returns the number of lines."""
    conversation = store.get_conversation(conversation_id)
    messages = store.messages(conversation_id)
    for n, message in enumerate(messages):
        line = message_to_json(message, tokens=tokens)
        if n == 0:
            line["conversation"] = {
                "title": conversation.title,
                "model": conversation.model,
                "settings": conversation.settings,
            }
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
    return len(messages)


def export_markdown(store: Store, conversation_id: int, out: IO[str]) -> None:
    """Write the conversation as Markdown: a heading per message, content verbatim."""
    conversation = store.get_conversation(conversation_id)
    title = conversation.title or f"Conversation {conversation.id}"
    out.write(f"# {title}\n\n")
    details = [f"conversation {conversation.id}", f"created {conversation.created_at}"]
    if conversation.model:
        details.insert(1, f"model `{conversation.model}`")
    out.write(f"*{' · '.join(details)}*\n")
    for message in store.messages(conversation_id):
        heading = message.role.capitalize()
        if message.status != "complete":
            heading += f" ({message.status})"
        probe = message.meta.get("probe")
        if isinstance(probe, dict):
            heading += f" — probe, expects {', '.join(map(str, probe.get('expect', [])))}"
        out.write(f"\n## {heading}\n\n{message.content}\n")


def _fail(path: Path, lineno: int, reason: str) -> ImportFormatError:
    return ImportFormatError(f"{path}:{lineno}: {reason}")


def _parse_line(path: Path, lineno: int, raw: str) -> dict[str, Any]:
    try:
        data = jsonl.message_line(raw)
    except jsonl.LineError as err:
        raise _fail(path, lineno, str(err)) from None
    role, content = data["role"], data["content"]
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(path, lineno, "\"content\" holds a lone surrogate (invalid Unicode)") from None
    item: dict[str, Any] = {"role": role, "content": content}
    meta: dict[str, Any] = {}
    if "meta" in data:
        if not isinstance(data["meta"], dict):
            raise _fail(path, lineno, "\"meta\" must be an object")
        meta.update(data["meta"])
    if "probe" in data:
        probe = data["probe"]
        if role != "user":
            raise _fail(path, lineno, "a probe must be a user message")
        if not isinstance(probe, dict):
            raise _fail(path, lineno, "\"probe\" must be an object")
        expect = probe.get("expect")
        if not isinstance(expect, list) or not all(isinstance(e, str) for e in expect):
            raise _fail(path, lineno, "\"probe.expect\" must be a list of strings")
        fact_turn = probe.get("fact_turn")
        if not isinstance(fact_turn, int) or isinstance(fact_turn, bool):
            raise _fail(path, lineno, "\"probe.fact_turn\" must be an integer")
        meta["probe"] = probe
    if "independent" in data:
        if not isinstance(data["independent"], bool):
            raise _fail(path, lineno, "\"independent\" must be true or false")
        meta["independent"] = data["independent"]
    if meta:
        item["meta"] = meta
    if "status" in data:
        if data["status"] not in STATUSES:
            raise _fail(path, lineno, f"\"status\" must be one of {', '.join(STATUSES)}")
        item["status"] = data["status"]
    if "tokens" in data and data["tokens"] is not None:
        tokens = data["tokens"]
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens
        ):
            raise _fail(path, lineno, "\"tokens\" must be a list of token ids (integers in [0, 2^31))")
        first_pos = data.get("first_pos")
        if first_pos is not None and (not isinstance(first_pos, int) or isinstance(first_pos, bool) or first_pos < 0):
            raise _fail(path, lineno, "\"first_pos\" must be a non-negative integer or null")
        item["tokens"] = tokens
        item["first_pos"] = first_pos
    return item


def read_jsonl(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Parse a replay JSONL file: (conversation header or {}, messages). Blank lines are skipped."""
    path = Path(path)
    header: dict[str, Any] = {}
    items: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ImportFormatError(f"{path}: not UTF-8 text (byte offset {error.start})") from None
    except OSError as error:
        raise ImportFormatError(f"{path}: cannot read ({error.strerror})") from None
    for lineno, raw in jsonl.numbered_lines(text):
        item = _parse_line(path, lineno, raw)
        if not items:
            conv = json.loads(raw).get("conversation")
            if isinstance(conv, dict):
                header = conv
        items.append(item)
    return header, items


def import_jsonl(store: Store, path: str | Path, *, title: str | None = None) -> Conversation:
    """Create a new conversation from a replay JSONL file (all lines or none)."""
    path = Path(path)
    header, items = read_jsonl(path)
    name = title if title is not None else header.get("title") if isinstance(header.get("title"), str) else None
    model = header.get("model") if isinstance(header.get("model"), str) else None
    settings = header.get("settings") if isinstance(header.get("settings"), dict) else None
    return store.import_messages(name if name is not None else path.stem, items, model=model, settings=settings)
