"""The gate's calibrated default: which turn statistic it reads and its threshold τ.

The gating study (`certchat replay --study gating --write-calibration STAT`) writes
``gate_calibration.json`` next to this module, with the figures and the commands that chose
it; ``gate = "auto"`` and ``gate_stat = "auto"`` in the config resolve through here, so the
default always cites the data behind it.

The certificate a turn reads depends on when the cache was evicted (config ``evict_at``), so
the file keeps one record per ``evict_at`` (``{"calibrations": [...]}``; a file holding a
single record is one calibrated with ``evict_at = "question"``, the only timing there was).

A record may make τ adaptive (``"adaptive": {"factor", "window"}``): the threshold of a turn is then
the larger of τ and ``factor`` × the median of the conversation's last ``window`` turn statistics
(:func:`adaptive_tau`), a constant-false-alarm-rate rule — a chat whose ordinary turns already read high
(long chats that refer back, docs/results/NOTES.md) raises its own bar, and a quiet one keeps τ.

A record holds for the model it was fitted on (``"model_sha256"``, the GGUF's hash; a record naming only a registry
``"model"`` holds for that model's file). On another model the floor can sit where that model's turns never reach it
(docs/results/NOTES.md has a larger model's anomalies against the default model's τ), so the gate never fires and
eviction forgets silently: :func:`covers` says whether a model has a calibration, and the cache manager keeps such a
model's cache full under ``gate = "auto"`` (:data:`UNCALIBRATED`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agent import models
from agent.config import DEFAULT_EVICT_AT, Budget
from agent.gate import certificate
from agent.gate.certificate import CertificateForm, Component

PATH = Path(__file__).parent / "gate_calibration.json"

# What "auto" means when no calibration file is present (a development checkout mid-study):
# the question-window maximum, and no threshold — the gate stays off rather than guess.
FALLBACK_STATISTIC = "question.max"

UNCALIBRATED = "this model's gate is not calibrated: running the full cache (no eviction)"
"""Why an evicting policy under ``gate = "auto"`` keeps a model's cache full (the status line, doctor, the chat)."""
UNCALIBRATED_HOW = "to evict anyway, give a threshold (--gate TAU) or turn the gate off (--gate off)"
"""How to get eviction on such a model; the user then chooses what the gate does."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Adaptive:
    """τ that follows the conversation: max(τ, factor × median of the last ``window`` turn statistics)."""

    factor: float
    window: int

    def ordinary(self, recent: Sequence[float]) -> float:
        """The conversation's ordinary turn statistic: the median of its last ``window`` (``recent`` non-empty,
        oldest first)."""
        return float(np.median(np.asarray(recent[-self.window:], dtype=np.float64)))


def adaptive_tau(tau: float, recent: Sequence[float], rule: Adaptive | None) -> float:
    """The threshold of the next turn, given the conversation's earlier turn statistics (oldest first)."""
    if rule is None or not recent:
        return tau
    return max(tau, rule.factor * rule.ordinary(recent))


@dataclass(frozen=True)
class GateCalibration:
    statistic: str
    tau: float
    rule: str
    model: str | None
    command: str | None
    study_command: str | None
    record: dict[str, Any]
    model_sha256: str | None = None
    """The GGUF the record was fitted on (its ``model_sha256``, else the registry's hash of its ``model``)."""


def _records(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    records = data["calibrations"] if isinstance(data, dict) and "calibrations" in data else [data]
    return [{**r, "evict_at": r.get("evict_at", "question")} for r in records]


@lru_cache(maxsize=8)
def load(path: Path = PATH, evict_at: str = DEFAULT_EVICT_AT) -> GateCalibration | None:
    """The calibration record for ``evict_at``, or None (logged) when the file is missing, unreadable
    or has no record for that timing."""
    try:
        for record in _records(path):
            if record["evict_at"] == evict_at:
                return GateCalibration(statistic=str(record["statistic"]), tau=float(record["tau"]),
                                       rule=str(record.get("rule", "fillers")), model=record.get("model"),
                                       command=record.get("command"), study_command=record.get("study_command"),
                                       record=record, model_sha256=_fitted_on(record))
        log.warning("no gate calibration for evict_at = %r in %s: gate 'auto' is off", evict_at, path)
    except FileNotFoundError:
        log.warning("no gate calibration at %s: gate 'auto' is off", path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("unreadable gate calibration %s (%s): gate 'auto' is off", path, err)
    return None


def _fitted_on(record: dict[str, Any]) -> str | None:
    sha = record.get("model_sha256")
    if sha:
        return str(sha)
    named = models.REGISTRY.get(str(record.get("model")))
    return named.sha256 if named else None


def covers(model_sha256: str | None, evict_at: str = DEFAULT_EVICT_AT) -> bool:
    """Whether the gate calibration for ``evict_at`` was fitted on the GGUF of this hash (``models.gguf_sha256``)."""
    cal = load(PATH, evict_at)
    return cal is not None and model_sha256 is not None and cal.model_sha256 == model_sha256


def default_statistic(evict_at: str = DEFAULT_EVICT_AT) -> str:
    cal = load(PATH, evict_at)
    return cal.statistic if cal else FALLBACK_STATISTIC


def default_tau(statistic: str, evict_at: str = DEFAULT_EVICT_AT) -> float | None:
    """τ for ``statistic`` when the calibration for ``evict_at`` chose that statistic; None (gate off) otherwise.
    A certificate statistic's τ holds on the certificate form it was calibrated under (:func:`tau_form`)."""
    cal = load(PATH, evict_at)
    if cal is None:
        return None
    if cal.statistic != statistic:
        log.warning("gate 'auto' is calibrated for %s, not %s: gate off (give a threshold with --gate)",
                    cal.statistic, statistic)
        return None
    return cal.tau


def adaptive(statistic: str, evict_at: str = DEFAULT_EVICT_AT) -> Adaptive | None:
    """The adaptive rule of the calibrated τ for ``statistic`` (None: a fixed τ, or no calibration for it)."""
    cal = load(PATH, evict_at)
    spec = cal.record.get("adaptive") if cal is not None and cal.statistic == statistic else None
    if not spec:
        return None
    return Adaptive(float(spec["factor"]), int(spec["window"]))


def tau_form(evict_at: str = DEFAULT_EVICT_AT, budget: Budget | str | None = None, model: str | None = None,
             rounds: int | None = None, policy: str = "poisson") -> CertificateForm | None:
    """The certificate form the calibrated τ for ``evict_at`` was fitted on: the gate reads a certificate
    statistic in it, so that a refitted certificate changes what the TUI shows, not when the gate fires. The
    record keeps the certificate calibration in force when it was fitted (``certificate``); a record from
    before calibrated certificates holds on sqrt(V̂)/‖ô‖ (times its ``certificate_multiplier`` k, if any).
    None without a calibration."""
    cal = load(PATH, evict_at)
    if cal is None:
        return None
    rows = cal.record.get("certificate")
    if rows:
        return certificate.form_for(budget, model, rounds, records=certificate.parse_records(rows), policy=policy)
    k = cal.record.get("certificate_multiplier")
    return CertificateForm((Component(float(k or 1.0)),))


def sketch_layers(layer_windows: Sequence[int], evict_at: str = DEFAULT_EVICT_AT) -> tuple[int, ...]:
    """The sketch layers the calibration for ``evict_at`` chose (``sketch_layers = "auto"``), for a model whose
    layers have the attention windows ``layer_windows`` (0: full attention; ``ModelInfo.layer_windows``): the
    calibrated ones on a model as deep as the calibration's, the same relative depths on another, each moved to
    the nearest full-attention layer (a sliding-window layer never sees an evicted position outside its
    window, so the sketch cannot read it there; the deeper one on a tie); () when the calibrated statistic
    needs no sketch or every layer has a window."""
    cal = load(PATH, evict_at)
    spec = cal.record.get("sketch") if cal is not None else None
    n_layer = len(layer_windows)
    full = [il for il, w in enumerate(layer_windows) if w == 0]
    if not spec or not spec.get("layers") or not full:
        return ()
    layers = [int(x) for x in spec["layers"]]
    ref = spec.get("n_layer")
    if ref and int(ref) != n_layer:
        layers = [min(n_layer - 1, round(x * (n_layer - 1) / (int(ref) - 1))) for x in layers]
    return tuple(sorted({min(full, key=lambda f: (abs(f - x), -f)) for x in layers if 0 <= x < n_layer}))


def is_certificate_statistic(statistic: str) -> bool:
    """Statistics of the certificate values (agent.gate.certificate; not the evicted share or the sketch's anomaly)."""
    return statistic.startswith(("question.", "answer.")) and "evicted_share" not in statistic


def write(record: dict[str, Any], path: Path = PATH) -> Path:
    """Add ``record`` to the file, replacing the record of the same ``evict_at``."""
    record = {**record, "evict_at": record.get("evict_at", "question")}
    try:
        others = [r for r in _records(path) if r["evict_at"] != record["evict_at"]]
    except (OSError, ValueError, KeyError, TypeError):
        others = []
    records = sorted([*others, record], key=lambda r: r["evict_at"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"calibrations": records}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    load.cache_clear()
    return path
