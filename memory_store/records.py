"""Typed records the store hands out and takes in.

Plain dataclasses: the agent and the TUI never see SQL rows. Token ids are
read-only int32 numpy arrays (``None`` when a message was never tokenized,
e.g. one imported from JSONL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Role = Literal["system", "user", "assistant"]
Status = Literal["complete", "partial", "interrupted"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")
STATUSES: tuple[str, ...] = ("complete", "partial", "interrupted")
# Meta flags that keep a message out of every re-read (it stays in the log and the export).
NOT_REREAD: tuple[str, ...] = ("discarded", "refused", "unanswered")


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    model: str | None
    settings: dict[str, Any]
    created_at: str
    updated_at: str
    message_count: int = 0


@dataclass(frozen=True, eq=False)
class Message:
    id: int
    conversation_id: int
    index: int
    role: str
    content: str
    tokens: np.ndarray | None
    first_pos: int | None
    status: str
    meta: dict[str, Any]
    created_at: str
    updated_at: str

    @property
    def positions(self) -> np.ndarray | None:
        """Positions of ``tokens`` in the model's sequence (contiguous from ``first_pos``)."""
        if self.tokens is None or self.first_pos is None:
            return None
        return np.arange(self.first_pos, self.first_pos + len(self.tokens), dtype=np.int32)


@dataclass(frozen=True)
class SearchHit:
    conversation_id: int
    title: str
    message_id: int
    index: int
    role: str
    snippet: str


@dataclass
class Turn:
    """Measurements of one assistant answer (one row per answer)."""

    conversation_id: int
    message_id: int | None = None
    policy: str | None = None
    budget: float | None = None  # as the agent defines it (fraction of context or cells)
    allocated_cells: int | None = None
    live_cells: int | None = None
    cert_stats: dict[str, float] = field(default_factory=dict)
    cert_layers: list[Any] = field(default_factory=list)  # per-layer values (nested lists allowed)
    gate_stat: float | None = None
    gate_threshold: float | None = None
    gate_fired: bool = False
    reprefill_tokens: int | None = None
    prompt_tokens: int | None = None
    decode_tokens: int | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    tokens_per_s: float | None = None
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    created_at: str | None = None


@dataclass
class EvictionRound:
    """One eviction round of one conversation."""

    conversation_id: int
    round: int
    message_id: int | None = None
    policy: str | None = None
    cells_before: int | None = None
    cells_after: int | None = None
    expected_budget: float | None = None
    seed: int | None = None
    sum_pi: float | None = None  # Σπ over the candidates: the expected number kept
    id: int | None = None
    created_at: str | None = None


@dataclass(frozen=True, eq=False)
class History:
    """A conversation's messages in order, as the model saw them, for re-prefill."""

    conversation_id: int
    messages: list[Message]

    def flatten(self, *, skip_untokenized: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """All token ids and their positions, concatenated in message order.

        Messages the chat took back out of its cache (``NOT_REREAD``: a replay's discarded probe or replaced
        answer, a refused message) are left out: a later message may hold their positions.

        Raises ValueError when a message has no token ids (unless
        ``skip_untokenized``) or when positions overlap or go backwards:
        re-prefilling such a history would not reproduce what the model saw.
        """
        token_parts: list[np.ndarray] = []
        pos_parts: list[np.ndarray] = []
        next_free = None
        for message in self.messages:
            if any(message.meta.get(k) for k in NOT_REREAD):
                continue
            if message.tokens is None or message.first_pos is None:
                if skip_untokenized:
                    continue
                raise ValueError(
                    f"conversation {self.conversation_id}: message {message.index} ({message.role}) "
                    "has no recorded token ids"
                )
            if len(message.tokens) == 0:
                continue
            if next_free is not None and message.first_pos < next_free:
                raise ValueError(
                    f"conversation {self.conversation_id}: message {message.index} starts at position "
                    f"{message.first_pos}, before the previous message ends ({next_free})"
                )
            token_parts.append(message.tokens)
            positions = message.positions
            assert positions is not None
            pos_parts.append(positions)
            next_free = message.first_pos + len(message.tokens)
        if not token_parts:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
        return np.concatenate(token_parts), np.concatenate(pos_parts)
