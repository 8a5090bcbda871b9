"""Rank statistics the studies and the coverage study share: AUC with a bootstrap interval, Spearman's ρ, a
certificate's coverage of the realised error, and the later half of a conversation (the harder sample to separate)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

import numpy as np


def auc(positive: Iterable[float | None], negative: Iterable[float | None]) -> float | None:
    """ROC AUC = P(score of a positive > score of a negative), ties counting one half."""
    pos = np.asarray([p for p in positive if p is not None and not math.isnan(p)], dtype=np.float64)
    neg = np.asarray([n for n in negative if n is not None and not math.isnan(n)], dtype=np.float64)
    if len(pos) == 0 or len(neg) == 0:
        return None
    scores = np.concatenate([pos, neg])
    ranks = _rank(scores)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def _rank(x: np.ndarray) -> np.ndarray:
    """Average ranks from 1 (ties share their mean rank)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def auc_ci(positive: Iterable[float | None], negative: Iterable[float | None], n_boot: int = 1000,
           seed: int = 0) -> tuple[float | None, float | None]:
    """Percentile bootstrap 95% interval of the AUC (resampling each class)."""
    pos = [p for p in positive if p is not None and not math.isnan(p)]
    neg = [n for n in negative if n is not None and not math.isnan(n)]
    if len(pos) < 2 or len(neg) < 2:
        return None, None
    rng = np.random.default_rng(seed)
    p, n = np.asarray(pos), np.asarray(neg)
    values = [auc(rng.choice(p, len(p)), rng.choice(n, len(n))) for _ in range(n_boot)]
    arr = np.asarray([v for v in values if v is not None])
    return float(np.quantile(arr, 0.025)), float(np.quantile(arr, 0.975))


def spearman(x: Iterable[float], y: Iterable[float]) -> float | None:
    a, b = np.asarray(list(x), dtype=np.float64), np.asarray(list(y), dtype=np.float64)
    if len(a) < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return None
    ra, rb = _rank(a), _rank(b)
    return float(np.corrcoef(ra, rb)[0, 1])


# -- pairing evicted runs with the full-cache reference ---------------------------------


def coverage(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Coverage at the nominal level, Spearman(certificate, error), per-layer breakdown.

    Each cell: ``{"layer", "head", "certificate", "error", "relative"?}`` — the certificate
    at nominal 1 − δ (absolute) and the realized ‖ô − o‖ for the same query.
    """
    if not cells:
        raise ValueError("no coverage cells")
    cert = np.asarray([c["certificate"] for c in cells], dtype=np.float64)
    err = np.asarray([c["error"] for c in cells], dtype=np.float64)
    covered = err <= cert
    layers: dict[int, list[bool]] = defaultdict(list)
    for c, ok in zip(cells, covered):
        layers[int(c["layer"])].append(bool(ok))
    return {"n_cells": len(cells), "coverage": float(covered.mean()), "spearman": spearman(cert, err),
            "per_layer": {str(k): float(np.mean(v)) for k, v in sorted(layers.items())},
            "median_ratio_error_to_certificate": float(np.median(err / np.maximum(cert, 1e-30)))}


def in_later_half(turn: int, last_turn: int) -> bool:
    """Whether a turn lies in the later half of its conversation (whose last turn is ``last_turn``): the ordinary
    turns a probe is compared against where the turn's position alone no longer tells them apart."""
    return int(turn) * 2 >= int(last_turn)


def paired_difference(full_only: int, default_only: int, n: int) -> tuple[float, float, float] | None:
    """Recall of the default minus the full cache's on the same n probes, with its 95% Wald interval for paired
    proportions (b = full only, c = default only: (c − b)/n ± 1.96·sqrt(b + c − (c − b)²/n)/n)."""
    if not n:
        return None
    d = (default_only - full_only) / n
    half = 1.96 * math.sqrt(max(full_only + default_only - (default_only - full_only) ** 2 / n, 0.0)) / n
    return d, d - half, d + half
