"""The page-form (cluster, multi-round) variance of native.poisson.page_variance.

(a) Identities: one round of single-cell units is the token form; one round of pages is the C++ cluster form
    of ``hajek_estimate``; protected and top-slice units add nothing.
(b) Coverage on synthetic attention with a known design (fixed seed): pages of 8 drawn in two rounds (the
    second samples the survivors of the first, with its own pages), a take-all top slice, values correlated
    along the sequence (as neighbouring tokens' are). For a scalar output the CLT interval
    |ô − o| ≤ z_{0.975}·sqrt(V̂_page) should cover 95%: over 2,000 independent draws the count is
    Binomial(2000, 0.95) if the estimator is exact, and the test accepts [0.932, 0.966], the central 99.9%
    of that binomial (false-alarm rate 0.1% for an exactly nominal estimator). The token form, which treats
    each cell of a page as its own draw, is shown to under-cover on the same draws.
"""

from __future__ import annotations

import numpy as np
import pytest

from native import poisson as P

Z975 = 1.959963984540054


def _ar1(n: int, d: int, rho: float, rng: np.random.Generator) -> np.ndarray:
    x = np.empty((n, d))
    x[0] = rng.standard_normal(d)
    for i in range(1, n):
        x[i] = rho * x[i - 1] + np.sqrt(1 - rho**2) * rng.standard_normal(d)
    return x


def test_one_round_identities() -> None:
    rng = np.random.default_rng(3)
    n, d = 600, 16
    logits = rng.standard_normal(n) * 1.5
    values = _ar1(n, d, 0.8, rng)
    protected = np.zeros(n, dtype=bool)
    protected[:4] = protected[-16:] = True
    plan = P.plan_eviction(np.exp(logits), protected, 150.0, method="poisson", page_size=8,
                           message_ids=np.repeat(np.arange(n // 50), 50), top_share=0.3, seed=5, round=0,
                           positions=np.arange(n))
    keep = plan.keep
    est = P.hajek_estimate(logits, values, plan.pi, keep, plan.unit_ids)
    s = logits[keep] - np.log(plan.pi[keep])
    p = np.exp(s - s.max())
    p /= p.sum()
    o_hat = p @ values[keep]
    assert np.allclose(o_hat, est.o_hat, rtol=1e-10, atol=1e-12)
    pages = P.page_variance(p, values[keep], o_hat, P.Stages.single(plan.unit_ids[keep], plan.pi[keep]))
    assert pages[0] == pytest.approx(est.v_hat_cluster, rel=1e-9)
    cells = P.page_variance(p, values[keep], o_hat, P.Stages.single(np.arange(keep.sum()), plan.pi[keep]))
    assert cells[0] == pytest.approx(est.v_hat_token, rel=1e-9)
    # protected and top-slice units (π = 1) are take-all strata: changing their values moves ô but their own
    # terms stay 0 — setting every π to 1 gives exactly 0
    assert P.page_variance(p, values[keep], o_hat, P.Stages.single(plan.unit_ids[keep], np.ones(keep.sum())))[0] == 0


def test_two_rounds_reduce_to_cumulative_pi_for_whole_pages() -> None:
    """A page never split: (1 − π₁) + π₁(1 − π₂) = 1 − π₁π₂, the one-round form with the cumulative π."""
    rng = np.random.default_rng(4)
    n, d = 40, 4
    p = rng.random((2, n))
    p /= p.sum(axis=1, keepdims=True)
    v = rng.standard_normal((n, d))
    o = p @ v
    units = np.repeat(np.arange(n // 8), 8)
    pi1, pi2 = rng.uniform(0.2, 1, n // 8)[units], rng.uniform(0.2, 1, n // 8)[units]
    two = P.page_variance(p, v, o, P.Stages.from_rounds([(units, pi1), (units, pi2)]))
    one = P.page_variance(p, v, o, P.Stages.single(units, pi1 * pi2))
    assert np.allclose(two, one, rtol=1e-12)


def _two_round_draw(logits: np.ndarray, values: np.ndarray, seed: int) -> tuple[float, float, float]:
    """(|ô − o|, V̂_page, V̂_token) after two eviction rounds of the agent's design."""
    n = len(logits)
    a = np.exp(logits - logits.max())
    a /= a.sum()
    o = float(a @ values[:, 0])
    protected = np.zeros(n, dtype=bool)
    protected[:4] = protected[-32:] = True
    msgs = np.repeat(np.arange(n // 64 + 1), 64)[:n]
    score = a + 0.02 / n  # importance (the query's own attention) plus a floor
    positions = np.arange(n)
    r1 = P.plan_eviction(score, protected, 0.5 * n, method="poisson", page_size=8, message_ids=msgs, top_share=0.3,
                         seed=seed, round=0, positions=positions)
    k1 = r1.keep
    pos2, score2, prot2 = positions[k1], score[k1], protected[k1]
    r2 = P.plan_eviction(score2, prot2, 0.25 * n, method="poisson", page_size=8, message_ids=msgs[k1], top_share=0.3,
                         seed=seed, round=1, positions=pos2, prev_cum_logpi=r1.cum_logpi[k1])
    k2 = r2.keep
    kept = pos2[k2]
    cum = np.exp(r2.cum_logpi[k2])
    s = logits[kept] - np.log(cum)
    p = np.exp(s - s.max())
    p /= p.sum()
    v = values[kept]
    o_hat = p @ v
    units1 = r1.unit_ids[kept]
    units2 = r2.unit_ids[k2]
    stages = P.Stages.from_rounds([(units1, r1.pi[kept]), (units2, r2.pi[k2])])
    vp = float(P.page_variance(p, v, o_hat, stages)[0])
    vt = float(P.page_variance(p, v, o_hat, P.Stages.single(np.arange(len(kept)), cum))[0])
    return abs(float(o_hat[0]) - o), vp, vt


@pytest.mark.slow
def test_page_form_covers_at_nominal_on_a_known_design() -> None:
    rng = np.random.default_rng(20261202)
    n = 4096
    logits = 1.2 * _ar1(n, 1, 0.9, rng)[:, 0]  # neighbouring cells alike in attention …
    values = _ar1(n, 1, 0.9, rng)  # … and in value: pages are clusters of similar cells
    draws = [_two_round_draw(logits, values, seed) for seed in range(2000)]
    err = np.array([x[0] for x in draws])
    page = np.mean(err <= Z975 * np.sqrt([x[1] for x in draws]))
    token = np.mean(err <= Z975 * np.sqrt([x[2] for x in draws]))
    print(f"\ncoverage at nominal 95% over 2000 two-round draws: page form {page:.4f}, token form {token:.4f}")
    assert 0.932 <= page <= 0.966
    assert token < 0.90
