"""The C++ design core against the numpy reference: same probabilities (1e-6), same
uniforms bit for bit, same keep sets, bookkeeping, estimator, certificates and aggregates."""

from __future__ import annotations

import numpy as np
import poisson_reference as ref
import pytest

from native import poisson as P

KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def scores_of(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Importance scores shaped like attention mass: peaked, flat or heavy-tailed; or few
    distinct values (ties everywhere: the top slice's order rule)."""
    if kind == "ties":
        return rng.integers(0, 5, n).astype(np.float64)
    if kind == "peaked":
        logits = rng.normal(0.0, 3.0, n)
    elif kind == "flat":
        logits = rng.normal(0.0, 0.3, n)
    else:
        logits = np.log(rng.pareto(1.1, n) + 1e-3)
    a = np.exp(logits - logits.max())
    return a / a.sum()


def protected_mask(n: int, sinks: int = 4, recent: int = 32) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[: min(sinks, n)] = True
    m[max(0, n - recent) :] = True
    return m


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert P.philox4x32_10(ctr, key).tolist() == list(want)
    assert ref.philox4x32_10(np.array([ctr]), np.array([key]))[0].tolist() == list(want)


def test_uniforms_identical_bits_and_uniform():
    rng = np.random.default_rng(1)
    pos = np.concatenate([np.arange(50_000), rng.integers(0, 2**62, 1000)])
    for seed, rnd in [(0, 0), (12345, 7), (2**63 + 5, 2**40 + 1)]:
        u = P.uniforms(seed, rnd, pos)
        np.testing.assert_array_equal(u, ref.uniforms(seed, rnd, pos))
        assert u.min() >= 0.0 and u.max() < 1.0
    # Chi-square goodness of fit over 50 bins of 50k draws: 99.9% critical value ~ 86.7.
    counts = np.bincount((P.uniforms(99, 3, np.arange(50_000)) * 50).astype(int), minlength=50)
    chi2 = ((counts - 1000.0) ** 2 / 1000.0).sum()
    assert chi2 < 86.7
    # Different rounds and seeds give unrelated streams.
    a, b = P.uniforms(1, 0, np.arange(20_000)), P.uniforms(1, 1, np.arange(20_000))
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.03
    assert not np.array_equal(P.uniforms(1, 0, np.arange(10)), P.uniforms(2, 0, np.arange(10)))


def test_draw_identical_keep_sets():
    rng = np.random.default_rng(2)
    pi = rng.random(20_000)
    pi[:100] = 0.0
    pi[100:200] = 1.0
    pos = rng.permutation(20_000) + 1000
    keep = P.draw(pi, 42, 3, pos)
    np.testing.assert_array_equal(keep, ref.draw(pi, 42, 3, pos))
    assert not keep[:100].any() and keep[100:200].all()


CASES = [
    # dist, n, budget share, floor, top_share, page size
    ("peaked", 256, 0.25, 0.0, 0.0, 1),
    ("flat", 1024, 0.05, 1e-3, 0.0, 1),
    ("flat", 1024, 0.25, 1e-4, 0.0, 1),
    ("heavy", 4096, 0.10, 1e-6, 0.0, 1),
    ("peaked", 4096, 0.50, 0.0, 0.3, 1),
    ("heavy", 2048, 0.10, 1e-5, 0.5, 8),
    ("flat", 3000, 0.20, 0.0, 0.0, 16),
    ("heavy", 32768, 0.10, 1e-6, 0.25, 1),
    ("ties", 2048, 0.20, 0.0, 0.5, 1),
    ("ties", 2048, 0.30, 1e-3, 0.3, 4),
]


@pytest.mark.parametrize("method", P.METHODS)
@pytest.mark.parametrize("dist,n,share,floor,top_share,page", CASES)
def test_probabilities_and_plans_match_reference(method, dist, n, share, floor, top_share, page):
    rng = np.random.default_rng(n + page)
    r = scores_of(dist, n, rng)
    prot = protected_mask(n)
    msg = np.repeat(np.arange(n // 100 + 1), 100)[:n]
    units = P.make_units(n, page, msg, prot) if page > 1 else None
    budget = share * n
    kw = dict(pi_min=1e-3, top_share=top_share, unit_ids=units, method=method)
    pi = P.inclusion_probabilities(r, prot, budget, floor, **kw)
    pi_ref = ref.inclusion_probabilities(r, prot, budget, floor, **kw)
    np.testing.assert_allclose(pi, pi_ref, rtol=0, atol=1e-6)
    if method not in ("topk", "window"):
        assert abs(pi.sum() - budget) <= 1e-6 * budget
    pos = np.arange(n) * 3 + 11
    prev = -rng.exponential(0.5, n)
    plan = P.plan_eviction(r, prot, budget, method=method, unit_ids=units, top_share=top_share, floor=floor,
                           pi_min=1e-3, seed=7, round=2, positions=pos, prev_cum_logpi=prev)
    keep, pi2, kind, cum, bias, feasible = ref.plan_eviction(
        r, prot, budget, method=method, unit_ids=units, top_share=top_share, floor=floor, pi_min=1e-3, seed=7, rnd=2,
        positions=pos, prev_cum_logpi=prev,
    )  # fmt: skip
    np.testing.assert_array_equal(plan.keep, keep)
    np.testing.assert_array_equal(plan.kind, kind)
    np.testing.assert_allclose(plan.pi, pi2, rtol=0, atol=1e-6)
    np.testing.assert_allclose(plan.cum_logpi[keep], cum[keep], rtol=1e-12, atol=1e-12)
    assert np.isneginf(plan.cum_logpi[~keep]).all()
    np.testing.assert_allclose(plan.bias, bias, rtol=1e-6, atol=1e-6)
    assert plan.feasible == feasible
    if units is not None:
        # A unit is kept or evicted whole.
        for u in np.unique(units)[:50]:
            assert len(set(plan.keep[units == u].tolist())) == 1


def test_streaming_rounds_accumulate_log_pi():
    rng = np.random.default_rng(5)
    n = 2000
    r = scores_of("heavy", n, rng)
    alive = np.arange(n)
    cum = np.zeros(n)
    cum_ref = np.zeros(n)
    for rnd in range(4):
        m = alive.size
        plan = P.plan_eviction(r[alive], protected_mask(m, 4, 16), 0.7 * m, floor=1e-5, seed=11, round=rnd,
                               positions=alive, prev_cum_logpi=cum[alive])
        k, _, _, c, b, _ = ref.plan_eviction(r[alive], protected_mask(m, 4, 16), 0.7 * m, floor=1e-5, seed=11,
                                             rnd=rnd, positions=alive, prev_cum_logpi=cum_ref[alive])
        np.testing.assert_array_equal(plan.keep, k)
        np.testing.assert_allclose(plan.cum_logpi[k], c[k], rtol=1e-12, atol=1e-12)
        # The survivor's bias is minus the sum over rounds of its log pi.
        np.testing.assert_allclose(plan.bias[k], -plan.cum_logpi[k], rtol=1e-6)
        cum[alive[k]] = plan.cum_logpi[k]
        cum_ref[alive[k]] = c[k]
        alive = alive[k]
    assert alive.size < 0.7**3 * n
    assert (cum[alive] <= 0).all() and cum[alive].min() < np.log(0.5)


def test_update_log_pi_matches_reference():
    rng = np.random.default_rng(6)
    pi = rng.uniform(1e-3, 1.0, 500)
    keep = rng.random(500) < 0.5
    prev = -rng.exponential(1.0, 500)
    cum, bias = P.update_log_pi(pi, keep, prev)
    c2, b2 = ref.update_log_pi(pi, keep, prev)
    np.testing.assert_allclose(cum[keep], c2[keep], rtol=1e-14)
    np.testing.assert_array_equal(bias, b2)
    assert (bias[~keep] == 0).all() and (bias >= 0).all()


@pytest.mark.parametrize(
    "method,top_share,page", [("poisson", 0.0, 1), ("poisson", 0.4, 1), ("uniform", 0.0, 1), ("poisson", 0.0, 16)]
)
def test_size_budget_matches_reference_and_fits(method, top_share, page):
    rng = np.random.default_rng(8)
    n = 4000
    r = scores_of("heavy", n, rng)
    prot = protected_mask(n)
    units = P.make_units(n, page, None, prot) if page > 1 else None
    cap = 600.0
    b = P.size_budget(r, prot, cap, z=3.0, method=method, unit_ids=units, top_share=top_share, floor=1e-6)
    b_ref = ref.size_budget(r, prot, cap, z=3.0, method=method, unit_ids=units, top_share=top_share, floor=1e-6)
    assert b == pytest.approx(b_ref, abs=2e-3)
    pi = P.inclusion_probabilities(r, prot, b, 1e-6, method=method, unit_ids=units, top_share=top_share)
    sizes = np.ones(n) if units is None else P.unit_sizes(units)[units]
    # Per-token pi repeats within a unit: variance of the count is sum_u size_u^2 pi_u(1-pi_u).
    var = (sizes * pi * (1 - pi)).sum()
    assert b + 3.0 * np.sqrt(var) <= cap + 1e-6
    assert b > 0.5 * cap


def test_make_units_matches_reference_and_respects_boundaries():
    rng = np.random.default_rng(9)
    n = 1000
    msg = np.sort(rng.integers(0, 30, n))
    prot = protected_mask(n, 4, 40)
    for k in (1, 4, 16, 64):
        ids = P.make_units(n, k, msg, prot)
        np.testing.assert_array_equal(ids, ref.make_units(n, k, msg, prot))
        sizes = np.bincount(ids)
        assert sizes.max() <= k
        for u in range(ids.max() + 1):
            members = np.flatnonzero(ids == u)
            assert np.all(np.diff(members) == 1)
            assert len(set(msg[members])) == 1 and len(set(prot[members])) == 1


def attention_problem(n: int, d: int, rng: np.random.Generator, temp: float = 2.0):
    K = rng.standard_normal((n, d))
    V = rng.standard_normal((n, d))
    q = rng.standard_normal(d) * temp
    return K @ q / np.sqrt(d), V


@pytest.mark.parametrize("page", [1, 8])
def test_hajek_matches_reference(page):
    rng = np.random.default_rng(10)
    n, d = 600, 16
    logits, V = attention_problem(n, d, rng)
    a = np.exp(logits - logits.max())
    prot = protected_mask(n)
    units = P.make_units(n, page, None, prot) if page > 1 else None
    pi = P.inclusion_probabilities(a / a.sum(), prot, 0.2 * n, 1e-4, unit_ids=units)
    keep = np.stack([P.plan_eviction(a, prot, 0.2 * n, floor=1e-4, unit_ids=units, seed=s).keep for s in range(20)])
    est = P.hajek_estimate(logits, V, pi, keep, units)
    o, vt, vc, dof, dof_var = ref.hajek(logits, V, pi, keep, units)
    np.testing.assert_allclose(est.o_hat, o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(est.v_hat_token, vt, rtol=1e-9)
    np.testing.assert_allclose(est.v_hat_cluster, vc, rtol=1e-9)
    np.testing.assert_allclose(est.dof, dof, rtol=1e-7)
    np.testing.assert_allclose(est.dof_var, dof_var, rtol=1e-9)
    assert (est.dof_var >= 2).all() and (est.dof >= 1).all() and (est.dof <= d).all()
    if page == 1:
        np.testing.assert_allclose(est.v_hat_token, est.v_hat_cluster, rtol=1e-12)
    single = P.hajek_estimate(logits, V, pi, keep[0], units)
    np.testing.assert_allclose(single.o_hat, est.o_hat[0])


def test_certificates_and_quantiles_match_reference():
    rng = np.random.default_rng(11)
    v = rng.exponential(0.01, (3, 4, 5))
    v[0, 0, 0] = -1e-12  # cancellation in the expanded in-graph form
    o2 = rng.uniform(0.5, 2.0, (3, 4, 5))
    dof = rng.uniform(1.0, 64.0, (3, 4, 5))
    for delta in (0.05, 0.01, 0.2):
        a, rel = P.certificate(v, o2, delta)
        a2, rel2 = ref.certificate(v, o2, delta)
        np.testing.assert_allclose(a, a2, rtol=1e-12)
        np.testing.assert_allclose(rel, rel2, rtol=1e-12)
        ad, reld = P.certificate(v, o2, delta, dof=dof)
        ad2, reld2 = ref.certificate(v, o2, delta, dof=dof)
        np.testing.assert_allclose(ad, ad2, rtol=1e-9)
        np.testing.assert_allclose(reld, reld2, rtol=1e-9)
        m = rng.uniform(2.0, 500.0, v.shape)
        af, _ = P.certificate(v, o2, delta, dof=dof, dof_var=m)
        af2, _ = ref.certificate(v, o2, delta, dof=dof, dof_var=m)
        np.testing.assert_allclose(af, af2, rtol=1e-9)
        assert (af[v > 0] > ad[v > 0]).all(), "a finite-sample variance estimate must widen the certificate"
    assert a[0, 0, 0] == 0.0
    for p in (1e-10, 0.01, 0.3, 0.5, 0.9, 0.975, 1 - 1e-9):
        assert P.normal_quantile(p) == pytest.approx(ref.NormalDist().inv_cdf(p), rel=1e-12, abs=1e-14)
    for p, k in [(0.95, 1), (0.95, 2.5), (0.99, 64), (0.05, 3), (0.5, 10.3), (0.999, 200)]:
        assert P.chi2_quantile(p, k) == pytest.approx(ref.chi2_quantile(p, k), rel=1e-9)
    for p, a, b in [(0.95, 1, 1), (0.95, 5, 10), (0.99, 3.5, 7.2), (0.05, 10, 3), (0.95, 64, 40), (0.9, 1, 2)]:
        assert P.f_quantile(p, a, b) == pytest.approx(ref.f_quantile(p, a, b), rel=1e-9)
    # Closed forms: chi2_{1,0.95} = z_{0.975}^2, chi2_{2,p} = -2 log(1-p); F(1,1) is a squared
    # Cauchy, so F_{1,1;p} = tan^2(pi p / 2); F(1,2) a squared t_2, so F_{1,2;p} = 2p^2 / (1-p^2).
    assert P.chi2_quantile(0.95, 1) == pytest.approx(P.normal_quantile(0.975) ** 2, rel=1e-12)
    assert P.chi2_quantile(0.9, 2) == pytest.approx(-2 * np.log(0.1), rel=1e-12)
    assert P.f_quantile(0.95, 1, 1) == pytest.approx(np.tan(np.pi * 0.95 / 2) ** 2, rel=1e-10)
    assert P.f_quantile(0.9, 1, 2) == pytest.approx(2 * 0.9**2 / (1 - 0.9**2), rel=1e-10)
    assert P.f_quantile(0.95, 7, np.inf) == pytest.approx(P.chi2_quantile(0.95, 7) / 7, rel=1e-12)


def test_turn_statistics_match_reference():
    rng = np.random.default_rng(12)
    q = rng.exponential(0.1, (8, 6, 4))
    ans = rng.exponential(0.1, (5, 6, 4))
    stats = P.turn_statistics(q, ans, quantile=0.95)
    for label, c in (("question", q), ("answer", ans)):
        want = ref.window_statistics(c, 0.95)
        for key, value in want.items():
            assert stats[f"{label}.{key}"] == pytest.approx(value, rel=1e-12)
    assert set(P.turn_statistics(q)) == {f"question.{k}" for k in ref.window_statistics(q)}
    steps = P.step_statistics(q)
    assert steps["layer_max_head_mean"].shape == (8,)
    np.testing.assert_allclose(steps["max"], q.reshape(8, -1).max(axis=1))
