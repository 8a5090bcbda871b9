"""One line of the replay JSONL format (docs/REPLAY_FORMAT.md) as a checked message object.

Shared by the log's import (``memory_store.export``) and the replay scripts (``agent.lab.replay.script``):
both read the same lines and must refuse the same mistakes in the same words; each caller adds the
file and line number to the reason.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from memory_store.records import ROLES


class LineError(ValueError):
    """Why a line is not a message (the reason only: the caller names the file and line)."""


def numbered_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) for each non-blank line. ``split("\\n")``, not ``splitlines()``: exports write
    non-ASCII raw, and splitlines() would also break a line at a U+2028 or U+0085 inside a string."""
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if raw.strip():
            yield lineno, raw


def message_line(raw: str) -> dict[str, Any]:
    """The JSON object of a message line, its ``role`` and ``content`` checked; other keys are the caller's."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise LineError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict):
        raise LineError(f"expected a JSON object, got {type(data).__name__}")
    role = data.get("role")
    if role not in ROLES:
        raise LineError(f"\"role\" must be one of {', '.join(ROLES)}, got {role!r}")
    content = data.get("content")
    if not isinstance(content, str):
        raise LineError(f"\"content\" must be a string, got {type(content).__name__}")
    return data
