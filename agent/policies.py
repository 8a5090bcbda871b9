"""Eviction policies: each is a small object with one scoring method.

A policy says how to score the live cells and which design of the core library turns
the scores into a keep set; everything else — the protected set (sinks, the recent
window, the current message), the budget, the draws, the bias, the compaction — is
shared, so every policy is compared on the same terms (kvpress's ScorerPress idea).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


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


class Policy(Protocol):
    name: str
    method: str
    """The design in ``native.poisson.plan_eviction``: poisson, topk, window or uniform."""
    evicts: bool
    sampled: bool
    """True when survivors carry a −log π bias (the randomised designs)."""

    def score(self, view: CacheView) -> np.ndarray: ...


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
class Full:
    """No eviction: the whole history stays in the cache (the quality reference)."""

    name: str = "full"
    method: str = "none"
    evicts: bool = False
    sampled: bool = False

    def score(self, view: CacheView) -> np.ndarray:
        return np.ones(len(view.positions))


@dataclass(frozen=True)
class Window:
    """StreamingLLM: the sinks and the most recent tokens."""

    name: str = "window"
    method: str = "window"
    evicts: bool = True
    sampled: bool = False

    def score(self, view: CacheView) -> np.ndarray:
        return view.positions.astype(np.float64)


@dataclass(frozen=True)
class TopK:
    """SnapKV-style: the cells the question attends to most, deterministically."""

    name: str = "topk"
    method: str = "topk"
    evicts: bool = True
    sampled: bool = False
    pool: int = 5

    def score(self, view: CacheView) -> np.ndarray:
        return _pooled(view.importance, len(view.positions), self.pool)


@dataclass(frozen=True)
class UniformRandom:
    """Uniform Poisson sampling at the same expected budget (the randomised baseline)."""

    name: str = "random"
    method: str = "uniform"
    evicts: bool = True
    sampled: bool = True

    def score(self, view: CacheView) -> np.ndarray:
        return np.ones(len(view.positions))


@dataclass(frozen=True)
class PoissonImportance:
    """Importance-proportional Poisson sampling with −log π biases (certchat's design)."""

    name: str = "poisson"
    method: str = "poisson"
    evicts: bool = True
    sampled: bool = True
    pool: int = 5

    def score(self, view: CacheView) -> np.ndarray:
        return _pooled(view.importance, len(view.positions), self.pool)


POLICIES: dict[str, Policy] = {p.name: p for p in (Full(), Window(), TopK(), UniformRandom(), PoissonImportance())}


def get(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
