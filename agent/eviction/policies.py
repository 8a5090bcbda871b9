"""Eviction policies: each is one small object that declares what it needs and carries its parameters.

A policy scores the live cells and names the design of the core library (``native.poisson``)
that turns scores into a keep set; its attributes say what the cache manager must provide
and do — attention importance, a −log π bias on sampled survivors, a deterministic top slice,
a score floor — so the manager never asks a policy its name (kvpress's presses, in spirit).
Everything else — the protected set (sinks, the recent window, the current message), the
budget, the draws, the compaction — is shared, so every policy is compared on the same terms.
``POLICIES`` is the one registry: configuration, the replay runner and the tests read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np


class Settings(Protocol):
    """The configuration fields a policy is built from (``agent.config.Config`` has them)."""

    policy: str
    top_share: float
    floor: float


@dataclass(frozen=True)
class CacheView:
    """What a policy may look at: the live cells in position order."""

    positions: np.ndarray
    """Position of each live cell (strictly increasing)."""
    segments: np.ndarray
    """Message index of each live cell."""
    importance: np.ndarray | None
    """Attention mass each cell received from the question window, summed over heads and layers
    (None when the patched importance read is unavailable)."""


@dataclass(frozen=True)
class Policy:
    """The base every policy shares: a name, a design, what it needs, and its parameters."""

    name: ClassVar[str]
    design: ClassVar[str]
    """The design in ``native.poisson.plan_eviction``: none, poisson, topk, window or uniform."""
    evicts: ClassVar[bool] = True
    needs_importance: ClassVar[bool] = False
    """Scores with the question window's attention (the graph's importance readout must be on)."""
    sampled: ClassVar[bool] = False
    """Survivors are a random sample and carry a −log π logit bias, so the certificate measures them."""
    help: ClassVar[str] = ""
    """One line for the UI's policy pickers."""

    top_share: float = 0.0
    """Share of the budget kept deterministically by score before the sampled tail (the top slice)."""
    floor: float = 0.0
    """Score floor as a share of the mean unprotected score, so every sampled π stays > 0."""

    @property
    def reads_attention(self) -> bool:
        """Whether eviction under this policy needs the graph's attention readout (importance or certificate)."""
        return self.evicts and (self.needs_importance or self.sampled)

    @classmethod
    def from_config(cls, config: Settings) -> "Policy":
        return cls()

    def score(self, view: CacheView) -> np.ndarray:
        raise NotImplementedError


def _pooled(importance: np.ndarray | None, n: int, width: int = 5) -> np.ndarray:
    """SnapKV's smoothing: a cell's score is the mean importance of its neighbourhood,
    so a fact's tokens are kept together rather than as isolated peaks."""
    if importance is None:
        raise ValueError("this policy needs attention importance from the patched library")
    if width <= 1 or n < width:
        return importance.astype(np.float64)
    kernel = np.ones(width) / width
    return np.convolve(importance.astype(np.float64), kernel, mode="same")


@dataclass(frozen=True)
class Full(Policy):
    """No eviction: the whole history stays in the cache (the quality reference)."""

    name: ClassVar[str] = "full"
    design: ClassVar[str] = "none"
    evicts: ClassVar[bool] = False
    help: ClassVar[str] = "keep every token (no eviction, no certificate)"

    def score(self, view: CacheView) -> np.ndarray:
        return np.ones(len(view.positions))


@dataclass(frozen=True)
class Window(Policy):
    """StreamingLLM: the sinks and the most recent tokens."""

    name: ClassVar[str] = "window"
    design: ClassVar[str] = "window"
    help: ClassVar[str] = "keep sinks and the most recent tokens"

    def score(self, view: CacheView) -> np.ndarray:
        return view.positions.astype(np.float64)


@dataclass(frozen=True)
class TopK(Policy):
    """SnapKV-style: the cells the question attends to most, deterministically."""

    name: ClassVar[str] = "topk"
    design: ClassVar[str] = "topk"
    needs_importance: ClassVar[bool] = True
    help: ClassVar[str] = "keep the most-attended tokens (deterministic)"
    pool: int = 5

    def score(self, view: CacheView) -> np.ndarray:
        return _pooled(view.importance, len(view.positions), self.pool)


@dataclass(frozen=True)
class UniformRandom(Policy):
    """Uniform Poisson sampling at the same expected budget (the randomised baseline)."""

    name: ClassVar[str] = "random"
    design: ClassVar[str] = "uniform"
    sampled: ClassVar[bool] = True
    help: ClassVar[str] = "keep a uniform random sample"

    def score(self, view: CacheView) -> np.ndarray:
        return np.ones(len(view.positions))


@dataclass(frozen=True)
class PoissonImportance(Policy):
    """Importance-proportional Poisson sampling with −log π biases (certchat's design): a top slice kept
    by score, the tail sampled at known inclusion probabilities above a floor."""

    name: ClassVar[str] = "poisson"
    design: ClassVar[str] = "poisson"
    needs_importance: ClassVar[bool] = True
    sampled: ClassVar[bool] = True
    help: ClassVar[str] = "Poisson-sampled by importance, with an error certificate"
    pool: int = 5

    @classmethod
    def from_config(cls, config: Settings) -> "PoissonImportance":
        return cls(top_share=config.top_share, floor=config.floor)

    def score(self, view: CacheView) -> np.ndarray:
        return _pooled(view.importance, len(view.positions), self.pool)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Full, Window, TopK, UniformRandom, PoissonImportance)}
"""Every eviction policy, by name: the one list of them."""

NAMES: tuple[str, ...] = tuple(POLICIES)

GATED = "poisson+gate"
"""The replays' name for the gated system: ``poisson`` with the gate on (every other policy replays ungated)."""

REPLAY_NAMES: tuple[str, ...] = (*NAMES, GATED)


def get(name: str) -> type[Policy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def from_config(config: Settings) -> Policy:
    """The configured policy, with its parameters."""
    return get(config.policy).from_config(config)
