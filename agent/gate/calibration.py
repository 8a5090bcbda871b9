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
eviction forgets silently. Every model therefore has its own calibration (:class:`ModelCalibration`, found by
:func:`for_model` from the GGUF's hash): one written by ``certchat calibrate`` into the cache dir
(``calibrations/<sha256>.json``, :func:`record_path`), else one shipped beside this module (``gate_calibration.json``
and ``calibrations/*.json``). A model with none is uncalibrated, and the cache manager keeps its cache full under
``gate = "auto"`` (:data:`UNCALIBRATED`) until it is calibrated.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agent import models, paths
from agent.config import DEFAULT_EVICT_AT, Budget
from agent.gate import certificate, certification, signals
from agent.gate.certificate import CertificateForm, Component
from agent.gate.certification import Certification

PATH = Path(__file__).parent / "gate_calibration.json"
SHIPPED_DIR = Path(__file__).parent / "calibrations"
"""Per-model records shipped with certchat, each written by ``certchat calibrate`` (named after the model)."""

# What "auto" means when no calibration file is present (a development checkout mid-study):
# the question-window maximum, and no threshold — the gate stays off rather than guess.
FALLBACK_STATISTIC = "question.max"

UNCALIBRATED = "this model's gate is not calibrated: running the full cache (no eviction)"
"""Why an evicting policy under ``gate = "auto"`` keeps a model's cache full (the status line, doctor, the chat)."""
REJECTED = "this model's gate calibration was rejected ({why}): running the full cache (no eviction)"
"""Why a model whose calibration did not catch enough calibration questions keeps its cache full."""
UNCALIBRATED_HOW = ("calibrate it once with `certchat calibrate MODEL` (minutes), or evict anyway with a threshold "
                    "(--gate TAU) or with the gate off (--gate off)")
"""How to get eviction on such a model: calibrate it, or choose what the gate does."""

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


def breach(value: float | None, tau: float | None) -> bool:
    """Whether a reading reaches τ; a non-finite one does (the gate fails closed on a broken certificate)."""
    return value is not None and tau is not None and (not math.isfinite(value) or value >= tau)


def adaptive_tau(tau: float, recent: Sequence[float], rule: Adaptive | None) -> float:
    """The threshold of the next turn, given the conversation's earlier turn statistics (oldest first)."""
    if rule is None or not recent:
        return tau
    return max(tau, rule.factor * rule.ordinary(recent))


@dataclass(frozen=True)
class SecondSignal:
    """A statistic that fires the gate on its own where the gate's statistic does not reach its bar: read in the
    certificate form shown, against a fixed τ fitted on ordinary turns of long calibration chats, and only where the
    kept sample holds at least ``min_sampled`` cells (below that the statistic reads on another scale). The record's
    ``second``, as read; the gate holds it as one of its bars (``agent.gate.bars.Bar.calibrated``)."""

    statistic: str
    tau: float
    min_sampled: int = 0

    def applies(self, sampled_cells: int) -> bool:
        """Whether the statistic is read at all with this many cells in the kept sample."""
        return sampled_cells >= self.min_sampled

    def fires(self, value: float | None, sampled_cells: int) -> bool:
        """Whether the second signal fires on its own: read, and reaching its τ."""
        return self.applies(sampled_cells) and breach(value, self.tau)


@dataclass(frozen=True)
class GateCalibration:
    """One calibrated gate: the statistic it reads, its floor τ and rule, and what it was fitted on."""

    statistic: str
    tau: float
    rule: str
    model: str | None
    command: str | None
    study_command: str | None
    record: dict[str, Any]
    model_sha256: str | None = None
    """The GGUF the record was fitted on (its ``model_sha256``, else the registry's hash of its ``model``)."""

    def tau_for(self, statistic: str) -> float | None:
        """τ for ``statistic`` when this calibration chose that statistic; None (gate off) otherwise. A certificate
        statistic's τ holds on the certificate form it was calibrated under (:meth:`tau_form`)."""
        if self.statistic != statistic:
            log.warning("gate 'auto' is calibrated for %s, not %s: gate off (give a threshold with --gate)",
                        self.statistic, statistic)
            return None
        return self.tau

    def adaptive(self, statistic: str) -> Adaptive | None:
        """The adaptive rule of τ for ``statistic`` (None: a fixed τ, or calibrated for another statistic)."""
        spec = self.record.get("adaptive") if self.statistic == statistic else None
        return Adaptive(float(spec["factor"]), int(spec["window"])) if spec else None

    def second(self) -> SecondSignal | None:
        """The second signal the calibration chose (record ``second``: a statistic and its τ), or None."""
        spec = self.record.get("second")
        if not spec:
            return None
        return SecondSignal(str(spec["statistic"]), float(spec["tau"]), int(spec.get("min_sampled", 0)))

    def tau_form(self, budget: Budget | str | None = None, model: str | None = None, rounds: int | None = None,
                 policy: str = "poisson") -> CertificateForm:
        """The certificate form τ was fitted on: the gate reads a certificate statistic in it, so that a refitted
        certificate changes what the TUI shows, not when the gate fires. The record keeps the certificate
        calibration in force when it was fitted (``certificate``); a record from before calibrated certificates
        holds on sqrt(V̂)/‖ô‖ (times its ``certificate_multiplier`` k, if any)."""
        rows = self.record.get("certificate")
        if rows:
            return certificate.form_for(budget, model, rounds, records=certificate.parse_records(rows), policy=policy)
        k = self.record.get("certificate_multiplier")
        return CertificateForm((Component(float(k or 1.0)),))

    def sketch_layers(self, layer_windows: Sequence[int]) -> tuple[int, ...]:
        """The sketch layers chosen (``sketch_layers = "auto"``) for a model whose layers have the attention windows
        ``layer_windows`` (0: full attention; ``ModelInfo.layer_windows``): the calibrated ones on a model as deep as
        the calibration's, the same relative depths on another, each moved to the nearest full-attention layer (a
        sliding-window layer never sees an evicted position outside its window, so the sketch cannot read it there;
        the deeper one on a tie); () when the calibrated statistic needs no sketch or every layer has a window."""
        spec = self.record.get("sketch")
        n_layer = len(layer_windows)
        full = [il for il, w in enumerate(layer_windows) if w == 0]
        if not spec or not spec.get("layers") or not full:
            return ()
        layers = [int(x) for x in spec["layers"]]
        ref = spec.get("n_layer")
        if ref and int(ref) != n_layer:
            layers = [min(n_layer - 1, round(x * (n_layer - 1) / (int(ref) - 1))) for x in layers]
        return tuple(sorted({min(full, key=lambda f: (abs(f - x), -f)) for x in layers if 0 <= x < n_layer}))


@dataclass(frozen=True)
class ModelCalibration:
    """Everything calibrated for one GGUF: its gate (one record per ``evict_at``), when the calibration fitted
    one, its certificate (the file's ``multipliers``, rows as in ``certificate_calibration.json``), and when it
    replayed long chats, its certification (the file's ``certification``: each budget's paired loss against the full
    cache and certified risk, agent/gate/certification.py), which ``budget = "auto"`` resolves through."""

    model_sha256: str
    path: Path
    gates: tuple[GateCalibration, ...]
    certificate: tuple[certificate.Record, ...] = ()
    model: str | None = None
    certification: Certification | None = None

    def gate(self, evict_at: str = DEFAULT_EVICT_AT) -> GateCalibration | None:
        """The gate for ``evict_at``; None when none was fitted, or its fit was rejected (``accepted``: false, a gate
        that missed the calibration probes: such a model keeps the full cache, as one never calibrated)."""
        return next((g for g in self.gates if g.record["evict_at"] == evict_at and g.record.get("accepted", True)),
                    None)

    def rejection(self, evict_at: str = DEFAULT_EVICT_AT) -> str | None:
        """Why the fit for ``evict_at`` was rejected (``rejected_because``); None when it was accepted or is absent."""
        g = next((g for g in self.gates if g.record["evict_at"] == evict_at), None)
        if g is None or g.record.get("accepted", True):
            return None
        return str(g.record.get("rejected_because") or "its gate missed the calibration questions")

    @property
    def user_made(self) -> bool:
        """Written by ``certchat calibrate`` on this machine (not shipped)."""
        return self.path.parent == paths.calibrations_dir()


def _records(path: Path) -> list[dict[str, Any]]:
    return _records_of(json.loads(path.read_text(encoding="utf-8")))


def _records_of(data: Any) -> list[dict[str, Any]]:
    records = data["calibrations"] if isinstance(data, dict) and "calibrations" in data else [data]
    return [{**r, "evict_at": r.get("evict_at", "question")} for r in records]


def _gate(record: dict[str, Any]) -> GateCalibration:
    return GateCalibration(statistic=str(record["statistic"]), tau=float(record["tau"]),
                           rule=str(record.get("rule", "fillers")), model=record.get("model"),
                           command=record.get("command"), study_command=record.get("study_command"),
                           record=record, model_sha256=_fitted_on(record))


@lru_cache(maxsize=8)
def load(path: Path = PATH, evict_at: str = DEFAULT_EVICT_AT) -> GateCalibration | None:
    """The calibration record for ``evict_at`` in the file at ``path``, or None (logged) when the file is missing,
    unreadable or has no record for that timing."""
    try:
        for record in _records(path):
            if record["evict_at"] == evict_at:
                return _gate(record)
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


def read(path: Path) -> list[ModelCalibration]:
    """The model calibrations a file holds: one per model its gate records were fitted on ([] when unreadable,
    logged). A per-model file (``certchat calibrate``) also holds that model's certificate (``multipliers``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        gates = [_gate(r) for r in _records_of(data)]
        rows = (data.get("multipliers") or []) if isinstance(data, dict) else []
        cert = certificate.parse_records(rows)
        certified = Certification.from_record(data.get("certification")) if isinstance(data, dict) else None
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("unreadable gate calibration %s (%s): skipped", path, err)
        return []
    shas = dict.fromkeys(g.model_sha256 for g in gates if g.model_sha256)
    # a file's certification is the model the file names (certchat calibrate writes one model per file)
    owner = data.get("model_sha256") if isinstance(data, dict) else None
    owner = str(owner) if owner else next(iter(shas)) if len(shas) == 1 else None
    if certified is not None and owner:
        shas.setdefault(owner)
    return [ModelCalibration(sha, path, tuple(g for g in gates if g.model_sha256 == sha), cert,
                             next((g.model for g in gates if g.model_sha256 == sha), None),
                             certified if sha == owner else None) for sha in shas]


def record_path(model_sha256: str) -> Path:
    """The file ``certchat calibrate`` writes for the GGUF of this hash (in ``paths.calibrations_dir``)."""
    return paths.calibrations_dir() / f"{model_sha256}.json"


def shipped_files() -> list[Path]:
    """The package's calibration files, in the order they are trusted: the per-model records ``certchat calibrate``
    made, then the gating study's file."""
    return [*sorted(SHIPPED_DIR.glob("*.json")), PATH]


@lru_cache(maxsize=16)
def for_model(model_sha256: str | None) -> ModelCalibration | None:
    """The calibration of the GGUF of this hash (``models.gguf_sha256``): for each ``evict_at``, the gate record of
    the first file that has one, the one ``certchat calibrate`` wrote on this machine before any shipped one; the
    certificate of the first file that fitted one. None for a model nothing was calibrated for."""
    if not model_sha256:
        return None
    found = [m for path in (record_path(model_sha256), *shipped_files()) if path.exists()
             for m in read(path) if m.model_sha256 == model_sha256]
    if not found:
        return None
    gates: dict[str, GateCalibration] = {}
    for m in found:
        for g in m.gates:
            gates.setdefault(g.record["evict_at"], g)
    cert = next((m.certificate for m in found if m.certificate), ())
    certified = next((m.certification for m in found if m.certification is not None), None)
    return ModelCalibration(model_sha256, found[0].path, tuple(gates.values()), cert, found[0].model, certified)


def of_file(model_path: Path) -> ModelCalibration | None:
    """The calibration of the GGUF at ``model_path`` (:func:`for_model` of its hash; None when it has none or the
    file cannot be read, which is no calibrated model either)."""
    try:
        return for_model(models.gguf_sha256(model_path))
    except OSError as err:
        log.warning("cannot hash %s (%s): treated as uncalibrated", model_path, err)
        return None


def fallback_statistic(evict_at: str = DEFAULT_EVICT_AT) -> str:
    """The statistic ``gate_stat = "auto"`` reads on a model without a calibration that evicts anyway (a threshold,
    or the gate off): the shipped default model's."""
    shipped = load(PATH, evict_at)
    return shipped.statistic if shipped is not None else FALLBACK_STATISTIC


def fallback_sketch_layers(layer_windows: Sequence[int], evict_at: str = DEFAULT_EVICT_AT) -> tuple[int, ...]:
    """Sketch layers for a model without a calibration that evicts anyway (a threshold, or the gate off): the
    shipped default model's, at the same relative depths."""
    shipped = load(PATH, evict_at)
    return shipped.sketch_layers(layer_windows) if shipped is not None else ()


def forget() -> None:
    """Drop what was read (after a calibration is written)."""
    for_model.cache_clear()
    load.cache_clear()


def full_cache_reason(model: ModelCalibration | None, evict_at: str = DEFAULT_EVICT_AT) -> str | None:
    """Why gate "auto" keeps this model's cache full at ``evict_at``: :data:`UNCALIBRATED` (no gate calibration for
    it) or :data:`REJECTED` with the fit's own reason; None when its gate is calibrated."""
    if model is not None and model.gate(evict_at) is not None:
        return None
    why = model.rejection(evict_at) if model is not None else None
    return REJECTED.format(why=why) if why else UNCALIBRATED


def setting_line(found: ModelCalibration | None, risk: float, model: str) -> str:
    """What ``budget = "auto"`` runs for a model at ``risk``, in one line, from its calibration ``found``: the gate's
    absence or rejection first (no gate, no eviction), else its certification's line."""
    if found is None or found.gate() is None:
        rejected = found is not None and found.rejection() is not None
        return "full cache: its gate calibration was rejected" if rejected else "full cache: no gate calibration"
    return certification.setting_line(found.certification, risk, model)


def covers(model_sha256: str | None, evict_at: str = DEFAULT_EVICT_AT) -> bool:
    """Whether the model of this hash has a gate calibration for ``evict_at``."""
    return full_cache_reason(for_model(model_sha256), evict_at) is None


def is_certificate_statistic(statistic: str) -> bool:
    """Statistics of the certificate values (agent.gate.certificate; not the evicted share or the sketch's anomaly)."""
    signal = signals.SIGNALS.get(statistic)
    return signal is not None and signal.certificate


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
    forget()
    return path


def write_model(document: dict[str, Any], path: Path) -> Path:
    """Write a model's calibration file (``{"calibrations": [gate records], "multipliers": [certificate rows], …}``,
    what ``certchat calibrate`` makes) atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    forget()
    return path
