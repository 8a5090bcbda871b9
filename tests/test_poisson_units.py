"""Sampling units measured, not assumed: what pages of k tokens do to the variance estimate
(token form vs cluster form), to the estimator's error, and to whether a contiguous span
(a verbatim fact) survives whole. Run with ``-s`` for the tables docs/POISSON.md quotes."""

from __future__ import annotations

import numpy as np
import pytest

from native import poisson as P


def ar1(n: int, d: int, rho: float, rng: np.random.Generator) -> np.ndarray:
    """Rows correlated along the sequence: neighbouring tokens carry similar keys/values."""
    x = rng.standard_normal((n, d))
    y = np.empty_like(x)
    y[0] = x[0]
    s = np.sqrt(1 - rho**2)
    for i in range(1, n):
        y[i] = rho * y[i - 1] + s * x[i]
    return y


def page_experiment(rho: float, page: int, n: int = 2048, d: int = 32, draws: int = 200, seed: int = 0):
    """(MSE, E[V_token]/MSE, E[V_cluster]/MSE, coverage with the cluster form) at a 10% budget."""
    rng = np.random.default_rng(seed)
    K, V = ar1(n, d, rho, rng), ar1(n, d, rho, rng)
    q = rng.standard_normal(d)
    Q = np.vstack([q, 0.9 * q + np.sqrt(0.19) * rng.standard_normal((15, d))])
    S = 2.0 * (Q @ K.T) / np.sqrt(d)
    A = np.exp(S - S.max(axis=1, keepdims=True))
    A /= A.sum(axis=1, keepdims=True)
    o = A[0] @ V
    prot = np.zeros(n, dtype=bool)
    prot[:4] = True
    prot[-32:] = True
    units = P.make_units(n, page, None, prot)
    budget = 0.1 * n
    pi = P.inclusion_probabilities(A.sum(axis=0), prot, budget, 1e-6, unit_ids=units)
    keep = np.stack([
        P.plan_eviction(A.sum(axis=0), prot, budget, floor=1e-6, unit_ids=units, seed=s).keep for s in range(draws)
    ])  # fmt: skip
    est = P.hajek_estimate(S[0], V, pi, keep, units)
    err2 = ((est.o_hat - o) ** 2).sum(axis=1)
    cert, _ = P.certificate(est.v_hat_cluster, (est.o_hat**2).sum(axis=1), 0.05, dof=est.dof, dof_var=est.dof_var)
    mse = err2.mean()
    return mse, est.v_hat_token.mean() / mse, est.v_hat_cluster.mean() / mse, float((np.sqrt(err2) <= cert).mean())


def test_cluster_form_is_the_variance_of_page_units():
    rows = {}
    for rho in (0.0, 0.9):
        for page in (1, 4, 16):
            rows[rho, page] = page_experiment(rho, page)
    print("\nrho  page  MSE        V_token/MSE  V_cluster/MSE  coverage(cluster, F)")
    for (rho, page), (mse, tok, clu, cov) in rows.items():
        print(f"{rho:3.1f}  {page:4d}  {mse:.3e}  {tok:11.3f}  {clu:13.3f}  {cov:.3f}")
    for (rho, page), (_, tok, clu, _) in rows.items():
        # The cluster form is the design variance whatever the page size or correlation.
        assert 0.8 < clu < 1.2, (rho, page, clu)
        if page == 1:
            assert tok == pytest.approx(clu, rel=1e-12)
    # With independent values the token form is close for pages too ...
    assert rows[0.0, 4][1] > 0.85
    # ... but neighbours with similar values make it miss the within-page covariance badly.
    assert rows[0.9, 4][1] < 0.6 and rows[0.9, 16][1] < 0.35
    # Pages cost accuracy at the same budget: whole pages in or out is a coarser sample.
    assert rows[0.0, 16][0] > 3 * rows[0.0, 1][0]


def span_experiment(seed: int = 0, n: int = 4096, span: int = 6, n_spans: int = 40, draws: int = 100):
    """P(a fact span survives whole) per design, at 10% and 25% budgets."""
    rng = np.random.default_rng(seed)
    msg = np.repeat(np.arange(n // 64), 64)
    prot = np.zeros(n, dtype=bool)
    prot[:4] = True
    prot[-64:] = True
    r = rng.pareto(1.5, n) + 0.05
    starts = rng.choice(np.arange(1, n // 64 - 2) * 64, n_spans, replace=False) + rng.integers(0, 64 - span, n_spans)
    spans = [np.arange(s, s + span) for s in starts]
    for s in spans:
        r[s] *= rng.uniform(2, 6)  # moderately important, unevenly so within the span
    designs = {
        "token": {},
        "token+top0.5": dict(top_share=0.5),
        "page4": dict(page_size=4, message_ids=msg),
        "page16": dict(page_size=16, message_ids=msg),
        "page16+top0.5": dict(page_size=16, message_ids=msg, top_share=0.5),
        "topk": dict(method="topk"),
        "topk page16": dict(method="topk", page_size=16, message_ids=msg),
    }
    out = {}
    for budget in (0.1, 0.25):
        for name, kw in designs.items():
            whole = [
                np.mean([plan.keep[s].all() for s in spans])
                for plan in (P.plan_eviction(r, prot, budget * n, floor=1e-3, seed=k, **kw) for k in range(draws))
            ]
            out[budget, name] = float(np.mean(whole))
    return out


def test_pages_keep_fact_spans_whole_more_often_than_tokens():
    out = span_experiment()
    print("\nbudget  design          P(6-token span survives whole)")
    for (budget, name), p in out.items():
        print(f"{budget:5.2f}   {name:14s}  {p:.3f}")
    for budget in (0.1, 0.25):
        assert out[budget, "page16"] > out[budget, "token"] + 0.05
        assert out[budget, "page16"] > out[budget, "page4"] - 0.02
    assert out[0.1, "token"] < 0.02  # the prototype's failure, reproduced: token-level sampling breaks spans
