"""The cache manager: budget, eviction rounds, certificates and the gate for one engine.

It turns a policy's scores into a keep set (through the design core in ``native``),
applies it to the KV cache (remove, bias, compact through the patched API), and reduces
the in-graph certificate terms to the gate statistic. The session asks it three things:
evict now?, does the question breach the gate?, does this answer step breach it?
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.config import Config, parse_budget, parse_gate
from agent.engine import Engine


@dataclass(frozen=True)
class GateDecision:
    value: float | None
    threshold: float | None
    fire: bool


@dataclass(frozen=True)
class EvictionReport:
    round: int
    cells_before: int
    cells_after: int
    budget_cells: int
    sum_pi: float


# Calibrated default τ for the question-window statistic; replaced by the calibration
# study's output (docs/RESULTS.md) — until then the gate must be given explicitly or is off.
DEFAULT_TAU: float | None = None


@dataclass
class _TurnCerts:
    question: float | None = None
    answer_max: float | None = None
    first_answer: float | None = None
    steps: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


class CacheManager:
    """Budget and gate bookkeeping for one engine's cache (policy ``full`` never evicts)."""

    def __init__(self, engine: Engine, config: Config) -> None:
        self.engine = engine
        self.config = config
        self.round = 0
        self._turn = _TurnCerts()
        self._peak_history = 0

    def reconfigure(self, config: Config) -> None:
        self.config = config

    def reset(self) -> None:
        """A new or reopened conversation."""
        self.round = 0
        self._turn = _TurnCerts()
        self._peak_history = 0

    def reset_cache_state(self) -> None:
        """The cache was cleared and is being re-prefilled (biases are gone with it)."""
        self._turn = _TurnCerts()

    def snapshot(self) -> Any:
        """Bookkeeping to restore after an independent probe."""
        return (self.round, self._peak_history)

    def restore(self, snap: Any) -> None:
        self.round, self._peak_history = snap

    # -- budget ----------------------------------------------------------------------------
    def history_tokens(self) -> int:
        """Tokens the conversation has fed so far (live or evicted)."""
        return self.engine.next_pos

    def budget_cells(self) -> int | None:
        if self.config.policy == "full":
            return None
        kind, value = parse_budget(self.config.budget)
        cells = int(value) if kind == "tokens" else int(round(value * max(self.history_tokens(), 1)))
        return max(cells, self.config.sinks + self.config.recent)

    def threshold(self) -> float | None:
        gate = parse_gate(self.config.gate)
        if gate == "auto":
            return DEFAULT_TAU
        return gate if isinstance(gate, float) else None

    # -- eviction ------------------------------------------------------------------------
    def evict(self, protect_from: int, round_hint: int | None = None, conversation_id: int | None = None,
              store: Any = None, message_id: int | None = None) -> EvictionReport | None:
        """Bring the cache back to its budget; ``protect_from``: first position never evicted."""
        if self.config.policy == "full":
            return None
        raise NotImplementedError(f"policy {self.config.policy!r} needs the patched eviction API")

    def make_room(self, needed: int) -> bool:
        """Free cells for the next prefill + answer; False when the policy cannot (``full``)."""
        return False

    # -- certificates and the gate ----------------------------------------------------
    def question_gate(self) -> GateDecision:
        tau = self.threshold()
        value = self._turn.question
        return GateDecision(value, tau, fire=value is not None and tau is not None and value >= tau)

    def begin_answer(self) -> None:
        self._turn.answer_max = None
        self._turn.first_answer = None
        self._turn.steps = 0

    def step_gate(self) -> GateDecision:
        return GateDecision(None, self.threshold(), fire=False)

    def turn_statistic(self) -> float | None:
        return self._turn.question

    def turn_detail(self) -> dict[str, Any]:
        return {"question": self._turn.question, "answer_max": self._turn.answer_max,
                "first_answer": self._turn.first_answer, **self._turn.detail}

    def retained_by_message(self, roles: dict[int, str], lengths: dict[int, int]) -> list[tuple[int, str, float]]:
        """(message index, role, share of its tokens still cached) for each message."""
        segs = np.asarray(self.engine.cache.segments, dtype=np.int64)
        counts = np.bincount(segs, minlength=max(lengths, default=0) + 1) if len(segs) else np.zeros(1)
        out = []
        for index, role in sorted(roles.items()):
            total = lengths.get(index, 0)
            kept = int(counts[index]) if index < len(counts) else 0
            out.append((index, role, min(1.0, kept / total) if total else 1.0))
        return out
