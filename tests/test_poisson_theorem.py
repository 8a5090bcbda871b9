"""The theorem made concrete (DESIGN.md §1): for deterministic top-k, altering the values of
evicted tokens leaves the estimate and everything computable from the retained set unchanged
while the true error grows without bound; under the Poisson design the same alteration shows
up in the certificate, which grows with the error and keeps covering it."""

from __future__ import annotations

import numpy as np

from native import poisson as P

N, D, BUDGET = 2048, 32, 0.1
SCALES = (1.0, 10.0, 100.0, 1000.0)


def problem(seed: int = 3):
    rng = np.random.default_rng(seed)
    K = rng.standard_normal((N, D))
    V = rng.standard_normal((N, D))
    q = rng.standard_normal(D)
    Q = np.vstack([q, 0.9 * q + np.sqrt(0.19) * rng.standard_normal((15, D))])
    S = 2.0 * (Q @ K.T) / np.sqrt(D)
    A = np.exp(S - S.max(axis=1, keepdims=True))
    A /= A.sum(axis=1, keepdims=True)
    prot = np.zeros(N, dtype=bool)
    prot[:4] = True
    prot[-32:] = True
    return S[0], V, A[0], A.sum(axis=0), prot, rng


def altered(V: np.ndarray, rows: np.ndarray, t: float, direction: np.ndarray) -> np.ndarray:
    """Values with `rows` pushed t units along a fixed direction: any alteration will do."""
    out = V.copy()
    out[rows] = V[rows] + t * direction
    return out


def retained_view(logits, V, keep):
    """Everything a deterministic scheme has after eviction: the survivors' logits and values,
    their attention output and any variance-like statistic computed from them."""
    s, v = logits[keep], V[keep]
    p = np.exp(s - s.max())
    p /= p.sum()
    o_hat = p @ v
    spread = (p**2 * ((v - o_hat) ** 2).sum(axis=1)).sum()
    return s.copy(), v.copy(), o_hat, spread


def test_topk_error_moves_while_everything_retained_stays_fixed():
    logits, V, a, r, prot, rng = problem()
    plan = P.plan_eviction(r, prot, BUDGET * N, method="topk")
    keep = plan.keep
    evicted = np.flatnonzero(~keep)
    direction = rng.standard_normal(D)
    direction /= np.linalg.norm(direction)
    views, errors = [], []
    for t in SCALES:
        Vt = altered(V, evicted, t, direction)
        # The selection depends on scores, never on values: the plan is the same.
        assert np.array_equal(P.plan_eviction(r, prot, BUDGET * N, method="topk").keep, keep)
        view = retained_view(logits, Vt, keep)
        views.append(view)
        errors.append(np.linalg.norm(view[2] - a @ Vt))
    for view in views[1:]:
        for x, y in zip(view, views[0]):
            assert np.array_equal(x, y), "a retained quantity changed although only evicted values moved"
    assert all(e2 > e1 for e1, e2 in zip(errors, errors[1:]))
    assert errors[-1] > 50 * errors[0]


def test_poisson_certificate_tracks_the_same_alteration():
    logits, V, a, r, prot, rng = problem()
    topk = P.plan_eviction(r, prot, BUDGET * N, method="topk")
    # The tokens ranked just below top-k's cut: evicted by top-k, sampled by the Poisson design.
    order = np.argsort(-r[~prot & ~topk.keep], kind="stable")
    rows = np.flatnonzero(~prot & ~topk.keep)[order[:200]]
    direction = rng.standard_normal(D)
    direction /= np.linalg.norm(direction)
    pi = P.inclusion_probabilities(r, prot, BUDGET * N, 1e-6)
    assert 0.01 < pi[rows].min() and pi[rows].max() < 1.0
    keep = np.stack([P.draw(pi, s, 0, np.arange(N)) for s in range(400)])
    medians_cert, medians_err = [], []
    print("\nscale  median error  median certificate  coverage  E|e|^2 / E[V]")
    for t in SCALES:
        Vt = altered(V, rows, t, direction)
        est = P.hajek_estimate(logits, Vt, pi, keep)
        err = np.linalg.norm(est.o_hat - a @ Vt, axis=1)
        cert, _ = P.certificate(est.v_hat_cluster, (est.o_hat**2).sum(axis=1), 0.05, dof=est.dof, dof_var=est.dof_var)
        ratio = np.mean(err**2) / np.mean(est.v_hat_cluster)
        print(f"{t:6.0f}  {np.median(err):12.4g}  {np.median(cert):18.4g}  {np.mean(err <= cert):8.3f}  {ratio:.3f}")
        assert np.mean(err <= cert) >= 0.9
        assert 0.7 < ratio < 1.4
        medians_cert.append(np.median(cert))
        medians_err.append(np.median(err))
    # Both grow with the alteration, in step.
    assert medians_cert[-1] > 100 * medians_cert[0]
    growth = np.array(medians_cert) / np.array(medians_err)
    assert growth.max() / growth.min() < 3
