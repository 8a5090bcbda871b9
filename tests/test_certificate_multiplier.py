"""The certificate's calibrated multiplier: the split-conformal fit, the per-budget lookup, and τ moving with it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent import calibration


def test_conformal_multiplier_is_the_right_order_statistic() -> None:
    rng = np.random.default_rng(0)
    v_hat = rng.uniform(0.5, 2.0, 999)
    err = np.sqrt(v_hat) * rng.exponential(1.0, 999)
    k = calibration.conformal_multiplier(err, v_hat, 0.95)
    scores = np.sort(err / np.sqrt(v_hat))
    assert k == scores[int(np.ceil(1000 * 0.95)) - 1]
    assert np.mean(err <= k * np.sqrt(v_hat)) >= 0.95
    # a cell the certificate calls exact (V̂ = 0) but which has an error can only be covered by k = ∞
    assert calibration.conformal_multiplier([1.0, 0.0], [0.0, 1.0], 0.3) == 0.0
    assert calibration.conformal_multiplier([1.0, 1.0], [0.0, 1.0], 0.9) == np.inf
    with pytest.raises(ValueError):
        calibration.conformal_multiplier([], [], 0.95)


def test_multiplier_per_budget_and_tau_rescaled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "certificate_calibration.json"
    assert calibration.certificate_multiplier("10%", path) == 1.0  # no file: the uncalibrated sqrt(V̂)/‖ô‖
    calibration.write_multipliers({"multipliers": [{"budget": "10%", "multiplier": 3.0},
                                                   {"budget": "25%", "multiplier": 2.0}]}, path)
    assert calibration.certificate_multiplier("10%", path) == 3.0
    assert calibration.certificate_multiplier("25%", path) == 2.0
    assert calibration.certificate_multiplier("50%", path) == 3.0  # not calibrated: the largest k
    # τ of a certificate statistic moves with k (so the gate fires on the same turns); others do not
    gate_path = tmp_path / "gate_calibration.json"
    gate_path.write_text(json.dumps({"calibrations": [{"statistic": "question.max", "tau": 0.5,
                                                       "evict_at": "turn-end"}]}))
    monkeypatch.setattr(calibration, "PATH", gate_path)
    monkeypatch.setattr(calibration, "CERTIFICATE_PATH", path)
    calibration.load.cache_clear()
    try:
        assert calibration.default_tau("question.max", "turn-end") == 0.5
        assert calibration.default_tau("question.max", "turn-end", "10%") == pytest.approx(1.5)
        gate_path.write_text(json.dumps({"calibrations": [{"statistic": "question.max", "tau": 1.5,
                                                           "evict_at": "turn-end", "certificate_multiplier": 3.0}]}))
        calibration.load.cache_clear()
        assert calibration.default_tau("question.max", "turn-end", "10%") == pytest.approx(1.5)
        assert calibration.default_tau("question.max", "turn-end", "25%") == pytest.approx(1.0)
        assert not calibration.is_certificate_statistic("question.evicted_share")
        assert not calibration.is_certificate_statistic("sketch.max")
    finally:
        calibration.load.cache_clear()
