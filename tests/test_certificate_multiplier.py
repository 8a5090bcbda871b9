"""The certificate shown, calibrated: the split-conformal fit with its drift term, the lookup per model, budget and
rounds class, and τ staying on the form it was calibrated under."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.config import Config
from agent.gate import calibration, certificate
from agent.gate.certificate import CertificateForm, Component
from agent.gate.decision import Gate
from agent.lab.fits import certificate_multiplier


def test_conformal_multiplier_is_the_right_order_statistic() -> None:
    rng = np.random.default_rng(0)
    v_hat = rng.uniform(0.5, 2.0, 999)
    err = np.sqrt(v_hat) * rng.exponential(1.0, 999)
    k = certificate.conformal_multiplier(err, np.sqrt(v_hat), 0.95)
    scores = np.sort(err / np.sqrt(v_hat))
    assert k == scores[int(np.ceil(1000 * 0.95)) - 1]
    assert np.mean(err <= k * np.sqrt(v_hat)) >= 0.95
    # a cell the certificate calls exact (scale 0) but which has an error can only be covered by k = ∞
    assert certificate.conformal_multiplier([1.0, 0.0], [0.0, 1.0], 0.3) == 0.0
    assert certificate.conformal_multiplier([1.0, 1.0], [0.0, 1.0], 0.9) == np.inf
    with pytest.raises(ValueError):
        certificate.conformal_multiplier([], [], 0.95)


def _drifting_cells(rng: np.random.Generator, n: int, drift: np.ndarray) -> dict[str, np.ndarray]:
    """Cells whose output error is the sample's (variance V̂) plus a drift of relative variance λ_layer, both
    Gaussian in 8 dimensions: the model the drift term assumes."""
    layer = rng.integers(0, len(drift), n)
    o2 = rng.uniform(0.5, 4.0, n)
    v_hat = o2 * rng.uniform(0.0, 0.05, n) * rng.integers(0, 2, n)  # half the cells: an exact sample (V̂ = 0)
    var = (v_hat + drift[layer] * o2) / 8.0
    err = np.linalg.norm(rng.normal(size=(n, 8)) * np.sqrt(var)[:, None], axis=1)
    return {"layer": layer, "o_norm2": o2, "v_hat": v_hat, "err": err}


def test_fit_with_drift_covers_at_nominal_held_out() -> None:
    """A statistical test with a fixed seed: on independent cells of a known error model, the fitted certificate
    covers held-out cells within the central 99.9% binomial interval of 95% (false-alarm rate 0.1% for an exact
    fit), and recovers each layer's drift; sqrt(V̂) alone, however scaled, cannot cover the exact-sample cells."""
    rng = np.random.default_rng(20261202)
    drift = np.array([0.01, 0.04, 0.09, 0.25])
    cal = _drifting_cells(rng, 20_000, drift)
    fitted = certificate.fit(cal["err"], cal["v_hat"], cal["o_norm2"], cal["layer"], len(drift))
    np.testing.assert_allclose(fitted.drift, drift, rtol=0.1)
    held = _drifting_cells(rng, 4_000, drift)
    rel = np.sqrt(held["v_hat"] / held["o_norm2"])
    cert = np.sqrt(held["o_norm2"]) * CertificateForm((fitted,)).apply_cells(rel, held["layer"], len(drift))
    covered = int(np.sum(held["err"] <= cert))
    assert 3_764 <= covered <= 3_833  # Binomial(4000, 0.95): 0.05% in each tail outside
    plain = certificate.conformal_multiplier(cal["err"], np.sqrt(cal["v_hat"]))
    assert plain == np.inf


def test_the_rule_for_k_is_chosen_by_the_conversations_left_out() -> None:
    """Conversations alike: a pooled quantile at or near nominal covers a left-out one at nominal. Conversations whose
    errors differ in scale: the pooled 95% quantile leaves the left-out ones under nominal, so a higher level is
    chosen, and the chosen rule's left-out coverage is at least nominal. One conversation: nothing to leave out,
    the most conservative rule."""
    rng = np.random.default_rng(20261205)
    drift = np.array([0.01, 0.04])

    def conversations(scales: list[float]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        parts = [_drifting_cells(rng, 3_000, drift) for _ in scales]
        for part, scale in zip(parts, scales):
            part["err"] = part["err"] * scale
        cells = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return cells, np.repeat([f"c{i}" for i in range(len(scales))], 3_000)

    def choose(cells: dict[str, np.ndarray], groups: np.ndarray) -> tuple[tuple[str, float], list[dict]]:
        return certificate.choose_rule(cells["err"], cells["v_hat"], cells["o_norm2"], cells["layer"], len(drift),
                                       groups)

    alike, groups = conversations([1.0] * 8)
    rule, table = choose(alike, groups)
    assert rule[0] == "pooled" and rule[1] <= 0.96
    row = {(r["rule"], r["level"]): r for r in table}
    assert certificate.NOMINAL <= row[rule]["coverage"] < 0.97

    unlike, groups = conversations([0.6, 0.8, 1.0, 1.0, 1.2, 1.4, 1.7, 2.0])
    rule, table = choose(unlike, groups)
    row = {(r["rule"], r["level"]): r for r in table}
    assert row[("pooled", 0.95)]["coverage"] < certificate.NOMINAL
    assert rule != ("pooled", 0.95) and row[rule]["coverage"] >= certificate.NOMINAL
    assert row[rule]["lowest"] < certificate.NOMINAL < row[rule]["highest"], "conversations spread either side"

    one, groups = conversations([1.0])
    assert choose(one, groups) == (certificate.RULES[-1], [])


def test_the_two_phase_fit_recovers_an_evicted_part_that_grows_with_the_evicted_share() -> None:
    """Cells whose error beyond the sample's is a drift λ_l plus an evicted part μ_l m² (m: the question's share on
    the evicted cells), relative to ‖ô‖²: the study's two-phase fit recovers λ and μ, covers held-out cells at
    nominal (Binomial(4000, 0.95): outside [3764, 3833] with probability 0.1%), and ranks the errors better than
    the shipped form, which sees no m."""
    script = certificate_multiplier
    rng = np.random.default_rng(20261203)
    lam, mu = np.array([0.01, 0.04, 0.02]), np.array([0.5, 0.0, 2.0])

    def cells(n: int) -> dict[str, np.ndarray]:
        layer = rng.integers(0, 3, n)
        o2 = rng.uniform(0.5, 4.0, n)
        m = rng.beta(0.5, 3.0, n)
        v_hat = o2 * rng.uniform(0.0, 0.02, n)
        var = (v_hat + (lam[layer] + mu[layer] * m ** 2) * o2) / 8.0
        err = np.linalg.norm(rng.normal(size=(n, 8)) * np.sqrt(var)[:, None], axis=1)
        return {"layer": layer, "o_norm2": o2, "v_hat": v_hat, "err": err, "m": m}

    cal, held = cells(20_000), cells(4_000)
    k, lam_fit, mu_fit = script.fit_two_phase(cal["err"], cal["v_hat"], cal["o_norm2"], cal["layer"], cal["m"], 3,
                                              np.zeros(20_000))
    np.testing.assert_allclose(lam_fit, lam, atol=0.01)
    np.testing.assert_allclose(mu_fit, mu, atol=0.15)
    coverage, spearman = script.two_phase_coverage(held, held["m"], k, lam_fit, mu_fit)
    assert 3_764 <= round(coverage * 4_000) <= 3_833
    shipped = certificate.fit(cal["err"], cal["v_hat"], cal["o_norm2"], cal["layer"], 3)
    _, spearman_shipped = script.two_phase_coverage(held, np.zeros(4_000), shipped.multiplier,
                                                    np.asarray(shipped.drift), np.zeros(3))
    assert spearman > spearman_shipped + 0.05


def test_apply_maps_drift_by_depth_and_keeps_infinity() -> None:
    form = CertificateForm((Component(2.0, (0.0, 0.25)),))
    rel = np.array([[[0.0, np.inf], [0.0, 0.3]]])  # (rows, layers, heads)
    out = form.apply(rel)
    assert out[0, 0, 0] == 0.0 and np.isinf(out[0, 0, 1])
    np.testing.assert_allclose(out[0, 1], 2.0 * np.sqrt(np.array([0.0, 0.09]) + 0.25))
    # a model of 3 layers reads the 2-layer calibration at the same relative depths
    np.testing.assert_allclose(Component(1.0, (0.1, 0.3)).drift_for(3), [0.1, 0.3, 0.3])
    assert CertificateForm().identity and CertificateForm().apply(rel) is not None


def _rows(*rows: tuple[str | None, str, str | None, float, list[float]]) -> dict:
    return {"multipliers": [{"model": m, "budget": b, "rounds": r, "multiplier": k, "drift": d}
                            for m, b, r, k, d in rows]}


def test_lookup_per_model_budget_and_rounds(tmp_path: Path) -> None:
    path = tmp_path / "certificate_calibration.json"
    assert certificate.form_for("10%", "qwen", 3, path).identity  # no file: the uncalibrated sqrt(V̂)/‖ô‖
    certificate.write(_rows(("qwen", "10%", "1", 1.5, [0.1]), ("qwen", "10%", "2+", 1.6, [0.2]),
                            ("qwen", "25%", "2+", 1.4, [0.05]), ("gemma", "10%", "2+", 3.0, [0.3])), path)
    assert certificate.form_for("10%", "qwen", 1, path).components == (Component(1.5, (0.1,)),)
    assert certificate.form_for("10%", "/models/qwen.gguf", 5, path).components == (Component(1.6, (0.2,)),)
    # not calibrated: the largest of the candidates, never a smaller certificate than a calibrated one
    assert set(certificate.form_for("50%", "qwen", 2, path).components) == {Component(1.6, (0.2,)),
                                                                           Component(1.4, (0.05,))}
    unknown = certificate.form_for("10%", "llama", 2, path)
    rel = np.full((1, 1, 1), 0.1)
    assert unknown.apply(rel)[0, 0, 0] == pytest.approx(3.0 * np.sqrt(0.01 + 0.3))
    # another design was not calibrated: sqrt(V̂)/‖ô‖ (0 for a deterministic one: no certificate)
    assert certificate.form_for("10%", "qwen", 2, path, policy="topk").identity
    assert certificate.rounds_class(0) == "1" and certificate.rounds_class(1) == "1"
    assert certificate.rounds_class(2) == "2+"


def test_gate_decides_on_the_form_tau_was_calibrated_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new certificate changes what is shown; the calibrated τ keeps firing on the same turns. An explicit
    threshold is read on the certificate shown."""
    cert_path = tmp_path / "certificate_calibration.json"
    certificate.write(_rows(("qwen", "10%", None, 2.0, [0.0])), cert_path)
    gate_path = tmp_path / "gate_calibration.json"
    gate_path.write_text(json.dumps({"calibrations": [{"statistic": "question.max", "tau": 0.5,
                                                       "evict_at": "turn-end", "model_sha256": "ab" * 32}]}))
    monkeypatch.setattr(certificate, "PATH", cert_path)
    calibration.load.cache_clear()
    try:
        settings = Config(model="qwen", budget="10%", gate="auto", gate_stat="question.max", evict_at="turn-end")
        gate = Gate(settings, calibration.read(gate_path)[0])
        turn = gate.turn
        turn.question = np.full((2, 3, 2), 0.4)  # sqrt(V̂)/‖ô‖ as the graph gives it
        turn.form = gate.certificate_form(2)
        turn.rounds = 2
        assert turn.statistics()["question.max"] == pytest.approx(0.8)  # shown: k = 2
        decision = gate.question_decision()
        assert not decision.fire and decision.value == pytest.approx(0.4)  # τ 0.5 was fitted on k = 1
        assert calibration.load(gate_path, "turn-end").tau_form().identity
        # a record that names the calibration it was read in
        gate_path.write_text(json.dumps({"calibrations": [{"statistic": "question.max", "tau": 0.7,
                                                           "evict_at": "turn-end", "model_sha256": "ab" * 32,
                                                           "certificate": _rows(("qwen", "10%", None, 2.0,
                                                                                 [0.0]))["multipliers"]}]}))
        gate = Gate(settings, calibration.read(gate_path)[0])
        gate.turn = turn
        decision = gate.question_decision()
        assert decision.fire and decision.value == pytest.approx(0.8)
        explicit = Gate(Config(model="qwen", budget="10%", gate="0.7", gate_stat="question.max",
                               evict_at="turn-end"), calibration.read(gate_path)[0])
        explicit.turn = turn
        assert explicit.question_decision().fire
        assert not calibration.is_certificate_statistic("question.evicted_share")
        assert not calibration.is_certificate_statistic("sketch.max")
    finally:
        calibration.load.cache_clear()
        certificate._records.cache_clear()
