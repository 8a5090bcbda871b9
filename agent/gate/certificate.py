"""The certificate the gate and the TUI show, in its calibrated form, and the split-conformal fit behind it.

Per (question row, layer, head) the graph gives the design-based variance V̂ of the kept sample (token form,
cumulative π) and ‖ô‖². The certificate shown is

    k_b · sqrt(V̂ + λ_{b,l} ‖ô‖²) / ‖ô‖

k_b and λ_{b,l} are fitted per model, budget b and rounds class (one eviction round, or several: see
:func:`rounds_class`; λ per layer l) on calibration replays
(``agent/lab/fits/certificate_multiplier.py``) and kept in ``certificate_calibration.json`` beside this module,
with the data, commands and held-out check that fixed them. λ_{b,l}‖ô‖² is the drift term: on the chat's own
cache the kept cells' K/V (and the question's rows) were computed over an evicted history, so the output moves
away from the full cache's even where the sample is exact, and no variance of the sample sees that
(docs/POISSON.md). λ is its moment estimate — the mean excess of the realised squared error over V̂, relative
to ‖ô‖² — and k a split-conformal quantile of err / sqrt(V̂ + λ‖ô‖²) (:func:`fit`), by the least conservative
rule that covers calibration conversations left out of the fit at nominal (:func:`choose_rule`). It is a
calibrated bound, not a design-exact one. Without the file the
certificate is the uncalibrated sqrt(V̂)/‖ô‖.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from agent.config import Budget

PATH = Path(__file__).parent / "certificate_calibration.json"
NOMINAL = 0.95

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Component:
    """One calibrated certificate: multiplier k and per-layer drift λ (empty: none) of a model of len(λ) layers."""

    multiplier: float = 1.0
    drift: tuple[float, ...] = ()

    def drift_for(self, n_layer: int) -> np.ndarray:
        """λ for a model of ``n_layer`` layers: its own per layer, or the same relative depths of another."""
        if not self.drift:
            return np.zeros(n_layer)
        ref = np.asarray(self.drift, dtype=np.float64)
        if len(ref) == n_layer:
            return ref
        if n_layer == 1 or len(ref) == 1:
            return np.full(n_layer, float(ref.max()))
        at = np.arange(n_layer) * (len(ref) - 1) / (n_layer - 1)
        # between two calibrated layers, the larger drift (conservative)
        return np.maximum(ref[np.floor(at).astype(int)], ref[np.ceil(at).astype(int)])


@dataclass(frozen=True)
class CertificateForm:
    """How the graph's sqrt(V̂)/‖ô‖ becomes the certificate shown: the largest of its components' certificates
    (one component for a calibrated model and budget; several where the lookup had to stay conservative)."""

    components: tuple[Component, ...] = (Component(),)

    @property
    def identity(self) -> bool:
        return all(c.multiplier == 1.0 and not any(c.drift) for c in self.components)

    @property
    def multiplier(self) -> float:
        return max(c.multiplier for c in self.components)

    def apply(self, rel: np.ndarray) -> np.ndarray:
        """``rel``: sqrt(V̂)/‖ô‖ with layers on axis −2 (…, layers, heads). Infinite entries stay infinite."""
        rel = np.asarray(rel, dtype=np.float64)
        if self.identity:
            return rel
        n_layer = rel.shape[-2]
        return self.apply_cells(rel, np.broadcast_to(np.arange(n_layer)[:, None], rel.shape), n_layer)

    def apply_cells(self, rel: np.ndarray, layer: np.ndarray, n_layer: int) -> np.ndarray:
        """``rel`` sqrt(V̂)/‖ô‖ of each cell, ``layer`` its layer (same shape) in a model of ``n_layer`` layers."""
        rel = np.asarray(rel, dtype=np.float64)
        lay = np.asarray(layer, dtype=np.int64)
        out = np.zeros_like(rel)
        for c in self.components:
            with np.errstate(invalid="ignore"):
                out = np.maximum(out, c.multiplier * np.sqrt(rel * rel + c.drift_for(n_layer)[lay]))
        return out

    def record(self) -> dict[str, Any]:
        return {"components": [{"multiplier": c.multiplier, "drift": list(c.drift)} for c in self.components]}


def conformal_multiplier(err: Any, scale: Any, level: float = NOMINAL) -> float:
    """Split-conformal k: the ⌈(n + 1)·level⌉-th smallest score err / scale of the calibration cells (a cell
    of scale 0 with a non-zero error scores +inf). Exchangeable cells would make P(err ≤ k·scale) ≥ level for a
    new cell; cells of one question are dependent, so read it as a consistent fit, not a guarantee."""
    e = np.asarray(err, dtype=np.float64)
    s = np.asarray(scale, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.where(s > 0, e / s, np.where(e > 0, np.inf, 0.0))
    n = len(scores)
    if n == 0:
        raise ValueError("no calibration cells")
    rank = min(n, int(np.ceil((n + 1) * level)))
    return float(np.sort(scores)[rank - 1])


def fit_drift(err: Any, v_hat: Any, o_norm2: Any, layer: Any, n_layer: int) -> tuple[float, ...]:
    """λ per layer: the mean of (err² − V̂)/‖ô‖² over the layer's cells, floored at 0 — what the realised error
    holds beyond the sample's variance (E‖ô − o‖² = E V̂ + drift², relative to the output). A layer without
    cells takes the largest λ of the others."""
    e2 = np.asarray(err, dtype=np.float64) ** 2
    v = np.maximum(np.asarray(v_hat, dtype=np.float64), 0.0)
    o2 = np.asarray(o_norm2, dtype=np.float64)
    lay = np.asarray(layer, dtype=np.int64)
    ok = o2 > 0
    lam = np.full(n_layer, np.nan)
    for li in range(n_layer):
        m = ok & (lay == li)
        if m.any():
            lam[li] = max(0.0, float(np.mean((e2[m] - v[m]) / o2[m])))
    if np.isnan(lam).all():
        return tuple(0.0 for _ in range(n_layer))
    return tuple(float(x) for x in np.where(np.isnan(lam), np.nanmax(lam), lam))


def _scale(v_hat: Any, o_norm2: Any, layer: Any, drift: Any) -> np.ndarray:
    """sqrt(V̂ + λ_l‖ô‖²) of each cell: the certificate before its multiplier, as ‖ô‖ times the relative."""
    lam = np.asarray(drift, dtype=np.float64)[np.asarray(layer, dtype=np.int64)]
    return np.sqrt(np.maximum(np.asarray(v_hat, dtype=np.float64), 0.0) + lam * np.asarray(o_norm2, dtype=np.float64))


def fit(err: Any, v_hat: Any, o_norm2: Any, layer: Any, n_layer: int, groups: Any = None,
        level: float = NOMINAL) -> Component:
    """The calibrated certificate of a set of calibration cells: λ by :func:`fit_drift` over all of them, then k
    conformal. With ``groups`` (e.g. each cell's conversation) k is the largest of the groups' conformal
    quantiles, so the certificate covers ``level`` of every group's cells: the cells of one conversation are
    dependent (its questions' outputs drift together), so the conversation, not the cell, is the exchangeable
    unit, and a quantile pooled over cells leaves a new conversation under-covered as often as over."""
    drift = fit_drift(err, v_hat, o_norm2, layer, n_layer)
    scale = _scale(v_hat, o_norm2, layer, drift)
    err = np.asarray(err, dtype=np.float64)
    if groups is None:
        return Component(conformal_multiplier(err, scale, level), drift)
    return Component(largest_group_multiplier(err, scale, groups, level), drift)


def largest_group_multiplier(err: Any, scale: Any, groups: Any, level: float = NOMINAL) -> float:
    """The largest of the groups' conformal multipliers (:func:`conformal_multiplier` per group): ``level`` of
    every group's cells covered, where a group (a conversation) is the exchangeable unit, not the cell."""
    e, s, g = np.asarray(err, dtype=np.float64), np.asarray(scale, dtype=np.float64), np.asarray(groups)
    return max(conformal_multiplier(e[g == x], s[g == x], level) for x in np.unique(g))


RULES: tuple[tuple[str, float], ...] = (("pooled", 0.95), ("pooled", 0.96), ("pooled", 0.97), ("pooled", 0.98),
                                        ("largest-group", NOMINAL))
"""k's candidate rules, least conservative first: the conformal quantile over every calibration cell at a level, or
the largest of the conversations' quantiles at nominal (every calibration conversation covered)."""


def fit_by_rule(err: Any, v_hat: Any, o_norm2: Any, layer: Any, n_layer: int, groups: Any,
                rule: tuple[str, float]) -> Component:
    """:func:`fit` under one of :data:`RULES` (``groups``: each cell's conversation)."""
    kind, level = rule
    return fit(err, v_hat, o_norm2, layer, n_layer, groups=groups if kind == "largest-group" else None, level=level)


def covered(err: Any, v_hat: Any, o_norm2: Any, layer: Any, comp: Component) -> np.ndarray:
    """Whether each cell's error is within the certificate ``comp`` shows for it (both as ‖ô‖ times the relative)."""
    return np.asarray(np.asarray(err, dtype=np.float64) <= comp.multiplier * _scale(v_hat, o_norm2, layer, comp.drift))


def left_out_coverage(err: Any, v_hat: Any, o_norm2: Any, layer: Any, n_layer: int, groups: Any,
                      rule: tuple[str, float]) -> dict[str, Any]:
    """Coverage of each calibration conversation under the certificate ``rule`` fits on the others — what a new
    conversation would see: pooled over the left-out cells, and the lowest and highest conversation's."""
    e, v, o2, lay = (np.asarray(x) for x in (err, v_hat, o_norm2, layer))
    g = np.asarray(groups)
    hits, per = [], []
    for name in np.unique(g):
        out, rest = g == name, g != name
        comp = fit_by_rule(e[rest], v[rest], o2[rest], lay[rest], n_layer, g[rest], rule)
        hit = covered(e[out], v[out], o2[out], lay[out], comp)
        hits.append(hit)
        per.append(float(hit.mean()))
    return {"rule": rule[0], "level": rule[1], "coverage": float(np.concatenate(hits).mean()), "lowest": min(per),
            "highest": max(per)}


def choose_rule(err: Any, v_hat: Any, o_norm2: Any, layer: Any, n_layer: int, groups: Any,
                level: float = NOMINAL) -> tuple[tuple[str, float], list[dict[str, Any]]]:
    """The least conservative of :data:`RULES` whose calibration conversations, each left out of the fit, are
    covered at ``level`` or more (pooled), with every rule's :func:`left_out_coverage`; with one conversation, or
    no rule reaching it, the most conservative. A quantile pooled over cells lets one conversation fall well under
    nominal while another is over; the largest conversation's quantile holds every calibration conversation to
    nominal and so over-covers a new one on average. Leaving conversations out measures which the chat gets."""
    if len(np.unique(np.asarray(groups))) < 2:
        return RULES[-1], []
    table = [left_out_coverage(err, v_hat, o_norm2, layer, n_layer, groups, rule) for rule in RULES]
    chosen = next((rule for rule, row in zip(RULES, table) if row["coverage"] >= level), RULES[-1])
    return chosen, table


def rounds_class(rounds: int) -> str:
    """"1": every kept cell was decoded over the whole history (one eviction round, the one-shot protocol);
    "2+": some were decoded over an evicted one (the multi-round protocol, the chat's steady state)."""
    return "1" if rounds <= 1 else "2+"


PROTOCOL_ROUNDS = {"one-shot": 1, "multi-round": 2}
"""Eviction rounds standing for each protocol of the coverage study (its rounds class: :func:`rounds_class`)."""


def _model_key(model: str) -> str:
    # a registry name, or a GGUF path whose file is named after it (the model cache's layout)
    name = Path(model).name
    return name[:-5] if name.endswith(".gguf") else name


Record = tuple[str, str | None, Budget, str | None, Component]
"""(policy, model, budget, rounds class, certificate) of one calibration; None: any. A record is found by what its
budget means (a share of 10% however it was written), not by its text."""


def parse_records(rows: list[dict[str, Any]]) -> tuple[Record, ...]:
    return tuple((str(r.get("policy", "poisson")), r.get("model"), Budget.parse(str(r["budget"])), r.get("rounds"),
                  Component(float(r["multiplier"]), tuple(float(x) for x in r.get("drift") or ()))) for r in rows)


def shipped_records(path: Path | None = None) -> list[dict[str, Any]]:
    """The calibration rows in force (what a τ calibrated now was read on); [] without a readable file."""
    path = path or PATH
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["multipliers"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("unreadable certificate calibration %s (%s): uncalibrated certificate", path, err)
        return []


@lru_cache(maxsize=8)
def _records(path: Path) -> tuple[Record, ...]:
    try:
        return parse_records(shipped_records(path))
    except (ValueError, KeyError, TypeError) as err:
        log.warning("unreadable certificate calibration %s (%s): uncalibrated certificate", path, err)
        return ()


def form_for(budget: Budget | str | None = None, model: str | None = None, rounds: int | None = None,
             path: Path | None = None, records: tuple[Record, ...] | None = None,
             policy: str = "poisson") -> CertificateForm:
    """The certificate for ``model`` at ``budget`` after ``rounds`` eviction rounds: its calibrated record; where
    the file holds no record for the model, the budget or the rounds class, the largest of the candidates'
    certificates (the conservative choice); without a file, sqrt(V̂)/‖ô‖. A record without a model (or rounds
    class) applies to any. A policy no record was fitted for (another design: its error is not this drift and
    this sample's) keeps sqrt(V̂)/‖ô‖ — for a deterministic design that is 0, no certificate."""
    table = _records(path or PATH) if records is None else records
    wanted = None if budget is None else Budget.parse(budget)
    rows: tuple[tuple[str | None, Budget, str | None, Component], ...] = tuple(
        (r[1], r[2], r[3], r[4]) for r in table if r[0] == policy)
    if not rows:
        return CertificateForm()
    key = _model_key(model) if model else None
    mine = [r for r in rows if r[0] is not None and r[0] == key] or [r for r in rows if r[0] is None] \
        or list(rows)
    cls = rounds_class(rounds) if rounds is not None else None
    mine = [r for r in mine if cls is not None and r[2] in (cls, None)] or mine
    at = [r for r in mine if wanted is not None and r[1] == wanted] or mine
    return CertificateForm(tuple(dict.fromkeys(r[3] for r in at)))


def write(record: dict[str, Any], path: Path | None = None) -> Path:
    """Write the calibration file (``{"multipliers": [{"model", "budget", "rounds", "multiplier", "drift"}, …],
    …}``)."""
    path = path or PATH
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _records.cache_clear()
    return path
