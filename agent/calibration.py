"""The gate's calibrated default: which turn statistic it reads and its threshold τ.

The gating study (`certchat replay --study gating --write-calibration STAT`) writes
``gate_calibration.json`` next to this module, with the figures and the commands that chose
it; ``gate = "auto"`` and ``gate_stat = "auto"`` in the config resolve through here, so the
default always cites the data behind it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

PATH = Path(__file__).parent / "gate_calibration.json"

# What "auto" means when no calibration file is present (a development checkout mid-study):
# the question-window maximum, and no threshold — the gate stays off rather than guess.
FALLBACK_STATISTIC = "question.max"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateCalibration:
    statistic: str
    tau: float
    rule: str
    model: str | None
    command: str | None
    study_command: str | None
    record: dict[str, Any]


@lru_cache(maxsize=4)
def load(path: Path = PATH) -> GateCalibration | None:
    """The calibration record, or None (logged) when the file is missing or unreadable."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        return GateCalibration(statistic=str(record["statistic"]), tau=float(record["tau"]),
                               rule=str(record.get("rule", "fillers")), model=record.get("model"),
                               command=record.get("command"), study_command=record.get("study_command"),
                               record=record)
    except FileNotFoundError:
        log.warning("no gate calibration at %s: gate 'auto' is off", path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("unreadable gate calibration %s (%s): gate 'auto' is off", path, err)
    return None


def default_statistic() -> str:
    cal = load()
    return cal.statistic if cal else FALLBACK_STATISTIC


def default_tau(statistic: str) -> float | None:
    """τ for ``statistic`` when the calibration chose that statistic; None (gate off) otherwise."""
    cal = load()
    if cal is None:
        return None
    if cal.statistic != statistic:
        log.warning("gate 'auto' is calibrated for %s, not %s: gate off (give a threshold with --gate)",
                    cal.statistic, statistic)
        return None
    return cal.tau


def write(record: dict[str, Any], path: Path = PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    load.cache_clear()
    return path
