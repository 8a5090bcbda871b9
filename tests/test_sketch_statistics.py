"""agent/lab/fits/sketch_statistics.py: the offline turn statistics recomputed from recorded sketch readings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import ModuleType

import pytest

from agent.lab.fits import sketch_statistics
from agent.lab.replay import aggregate

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs/results/data/longchat-8k-adaptive"


def _script() -> ModuleType:
    return sketch_statistics


def _message(share: list[float], base: list[float] | None, evicted: int = 10, live: int = 0) -> dict:
    return {"share": share, "base": base, "anomaly": None, "evicted": evicted, "live": live}


def _step(turn: int, kind: str, messages: dict, correct: bool | None = None) -> dict:
    step = {"turn": turn, "kind": kind, "certificate_detail": {"sketch.messages": messages}}
    if kind == "probe":
        step["correct"] = correct
    return step


def _write(path: Path, runs: list[dict]) -> Path:
    path.write_text(json.dumps({"format": aggregate.FORMAT, "version": aggregate.VERSION, "meta": {}, "runs": runs}))
    return path


def test_statistics_and_separations_on_a_known_recording(tmp_path: Path) -> None:
    mod = _script()
    quiet = {"1": _message([0.01, 0.02], [0.01, 0.01])}
    loud = {"1": _message([0.30, 0.10], [0.01, 0.01]), "2": _message([0.05, 0.04], [0.01, 0.02]),
            "3": _message([0.90, 0.90], [0.01, 0.01], evicted=2, live=8),   # mostly live: left out
            "4": _message([0.90, 0.90], None)}                              # no baseline yet: left out
    evicting = {"script": "s", "policy": "poisson", "budget": "10%", "question_fillers": [3], "steps": [
        _step(1, "filler", {}),                       # nothing evicted yet: silent, not a turn of the study
        _step(2, "filler", quiet), _step(3, "filler", quiet), _step(4, "filler", quiet),
        _step(5, "probe", loud, correct=False), _step(5, "probe", loud, correct=True)]}
    full = {"script": "s", "policy": "full", "budget": "100%", "steps": [
        _step(1, "filler", {}), _step(2, "filler", {}), _step(3, "filler", {}), _step(4, "filler", {}),
        _step(5, "probe", {}, correct=True), _step(5, "probe", {}, correct=True)]}
    turns = mod.load([_write(tmp_path / "results.json", [full, evicting])], "poisson", "10%")

    assert [t.kind for t in turns] == ["other", "question filler", "other", "probe", "probe"]
    probe = turns[3]
    assert probe.values["sketch.max"] == pytest.approx(30.0)        # 0.30 / 0.01 on message 1
    assert probe.values["excess.max"] == pytest.approx(0.29)
    assert probe.values["excess.sum"] == pytest.approx(0.29 + 0.04)  # message 2's largest excess: 0.04 in layer 0
    # independent probes share a turn number: induced is matched by position in the run, not by turn
    assert [t.induced for t in turns[3:]] == [True, False]
    sep = mod.separations(turns, "sketch.max")
    assert sep["question fillers"] == 1.0 and sep["other turns"] == 1.0 and sep["n_induced"] == 1
    assert sep["induced vs rest"] == 0.5                             # the two probes read the same
    assert "| excess.sum | 1.00 | 1.00 |" in mod.table(turns)

    with pytest.raises(SystemExit, match="no turn with sketch.messages"):
        mod.load([tmp_path / "results.json"], "poisson", "25%")


def test_the_recomputed_sketch_max_is_the_recorded_one() -> None:
    """On a committed recording (the 8k long chat, poisson 10%): sketch.max from the per-message shares equals what
    the gate computed at the time, up to the detail's 4-digit rounding."""
    mod = _script()
    path = RECORDED / "results.json.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        runs = json.load(fh)["runs"]
    steps = [s for r in runs if r["policy"] == "poisson" for s in r["steps"]]
    checked = 0
    for s in steps:
        rows = mod.message_rows(s["certificate_detail"] or {})
        if rows:
            recorded = s["certificate_detail"]["sketch.max"]
            assert mod.STATISTICS["sketch.max"](rows) == pytest.approx(recorded, rel=2e-3)
            checked += 1
    assert checked > 50
    assert len(mod.load([RECORDED], "poisson", "10%")) == checked
