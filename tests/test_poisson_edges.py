"""Edge cases and contracts of the design core: every edge of the probability computation
(budget >= n, budget <= protected, zero/NaN/inf scores, n = 0), the invariants (sum = B,
pi >= pi_min, monotone in the score), units, the top slice, the baselines, sizing by capacity,
the draws and the certificate's own edges."""

from __future__ import annotations

import numpy as np
import pytest

from native import poisson as P


def _prot(n: int, k: int = 4) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[:k] = True
    return m


# ---------------------------------------------------------------- the invariants


@pytest.mark.parametrize("seed", range(6))
def test_sum_floor_and_monotonicity_invariants(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 5000))
    r = rng.pareto(float(rng.uniform(0.5, 3.0)), n)
    prot = rng.random(n) < 0.05
    m = prot.sum()
    budget = float(m + rng.uniform(0.02, 0.9) * (n - m))
    pi_min = float(rng.choice([1e-4, 1e-3, 1e-2]))
    pi = P.inclusion_probabilities(r, prot, budget, float(rng.choice([0.0, 1e-3])), pi_min=pi_min)
    assert pi.dtype == np.float64 and pi.shape == (n,)
    assert abs(pi.sum() - budget) <= 1e-6 * budget
    assert (pi[prot] == 1.0).all()
    assert (pi[~prot] >= pi_min).all() and (pi <= 1.0).all()
    order = np.argsort(r[~prot], kind="stable")
    assert (np.diff(pi[~prot][order]) >= 0).all(), "pi must not decrease as the score grows"


def test_pi_is_proportional_to_floored_score_between_the_clamps():
    r = np.linspace(0.0, 1.0, 1001)
    pi = P.inclusion_probabilities(r, None, 200.0, 0.01, pi_min=1e-3)
    mid = (pi > 1e-3) & (pi < 1.0)
    ratio = pi[mid] / (r[mid] + 0.01)
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-12)


# ---------------------------------------------------------------- the edges


@pytest.mark.parametrize("budget", [100.0, 150.0, np.inf])
def test_budget_at_or_above_n_keeps_everything(budget):
    r = np.random.default_rng(0).random(100)
    pi = P.inclusion_probabilities(r, _prot(100), budget, 0.0)
    assert (pi == 1.0).all()
    plan = P.plan_eviction(r, _prot(100), budget)
    assert plan.keep.all() and (plan.bias == 0).all() and plan.feasible


def test_budget_below_protected_is_a_clear_error_or_the_minimum_design():
    r = np.random.default_rng(1).random(100)
    prot = _prot(100, 30)
    with pytest.raises(P.BudgetInfeasible, match="budget infeasible"):
        P.inclusion_probabilities(r, prot, 20.0, 0.0)
    with pytest.raises(P.BudgetInfeasible):
        P.inclusion_probabilities(r, prot, 30.0, 0.0)  # = protected: nothing left for pi_min
    pi = P.inclusion_probabilities(r, prot, 20.0, 0.0, pi_min=0.01, strict=False)
    assert (pi[prot] == 1.0).all() and np.allclose(pi[~prot], 0.01)
    plan = P.plan_eviction(r, prot, 20.0, pi_min=0.01)
    assert not plan.feasible and plan.keep[prot].all()
    for method in ("topk", "window"):
        plan = P.plan_eviction(r, prot, 20.0, method=method)
        assert not plan.feasible and plan.keep.sum() == 30


def test_budget_exactly_at_the_minimum_design_is_feasible():
    r = np.random.default_rng(2).random(100)
    prot = _prot(100, 10)
    pi = P.inclusion_probabilities(r, prot, 10 + 90 * 0.01, 0.0, pi_min=0.01)
    assert np.allclose(pi[~prot], 0.01)


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_all_zero_scores_share_the_budget_equally(floor):
    pi = P.inclusion_probabilities(np.zeros(200), _prot(200), 54.0, floor)
    np.testing.assert_allclose(pi[4:], 50.0 / 196, rtol=1e-12)


def test_zero_scores_without_floor_take_what_the_scored_ones_leave():
    r = np.zeros(100)
    r[:10] = 1.0
    pi = P.inclusion_probabilities(r, None, 40.0, 0.0, pi_min=1e-3)
    assert (pi[:10] == 1.0).all()
    np.testing.assert_allclose(pi[10:], 30.0 / 90, rtol=1e-12)
    pi = P.inclusion_probabilities(r, None, 5.0, 0.0, pi_min=1e-3)
    np.testing.assert_allclose(pi[10:], 1e-3)
    assert pi.sum() == pytest.approx(5.0, rel=1e-12)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_scores_are_rejected_with_the_index(bad):
    r = np.ones(50)
    r[17] = bad
    with pytest.raises(P.DesignError, match=r"scores\[17\]"):
        P.inclusion_probabilities(r, None, 10.0, 0.0)
    with pytest.raises(P.DesignError, match=r"scores\[17\]"):
        P.plan_eviction(r, None, 10.0)


def test_negative_scores_are_rejected():
    with pytest.raises(P.DesignError, match="negative"):
        P.inclusion_probabilities(np.array([1.0, -0.5, 2.0]), None, 1.0, 0.0)


def test_empty_input_gives_empty_outputs():
    assert P.inclusion_probabilities(np.zeros(0), None, 5.0, 0.0).shape == (0,)
    assert P.draw(np.zeros(0), 1, 2, np.zeros(0, dtype=np.int64)).shape == (0,)
    plan = P.plan_eviction(np.zeros(0), np.zeros(0, bool), 3.0, page_size=8)
    assert plan.keep.shape == plan.pi.shape == plan.bias.shape == (0,)
    cum, bias = P.update_log_pi(np.zeros(0), np.zeros(0, bool))
    assert cum.shape == bias.shape == (0,)
    assert P.make_units(0, 4).shape == (0,)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pi_min=0.0), "pi_min"),
        (dict(pi_min=1.5), "pi_min"),
        (dict(top_share=1.0), "top_share"),
        (dict(top_share=-0.1), "top_share"),
        (dict(method="lru"), "method"),
    ],
)
def test_invalid_settings_are_rejected(kwargs, match):
    with pytest.raises(P.DesignError, match=match):
        P.inclusion_probabilities(np.ones(10), None, 5.0, 0.0, **kwargs)


def test_invalid_arguments_are_rejected():
    r = np.ones(10)
    for budget in (-1.0, np.nan):
        with pytest.raises(P.DesignError, match="budget"):
            P.inclusion_probabilities(r, None, budget, 0.0)
    with pytest.raises(P.DesignError, match="floor"):
        P.inclusion_probabilities(r, None, 5.0, -1.0)
    with pytest.raises(P.DesignError, match="shape"):
        P.inclusion_probabilities(r, np.zeros(9, bool), 5.0, 0.0)
    with pytest.raises(P.DesignError, match="unit_ids"):
        P.inclusion_probabilities(r, None, 5.0, 0.0, unit_ids=np.arange(-1, 9))
    with pytest.raises(P.DesignError, match="prev_cum"):
        P.plan_eviction(r, None, 5.0, prev_cum_logpi=np.full(10, 0.5))
    with pytest.raises(P.DesignError, match="positions"):
        P.plan_eviction(r, None, 5.0, positions=np.arange(10) - 3)
    with pytest.raises(P.DesignError, match="seed"):
        P.draw(np.full(10, 0.5), -1, 0, np.arange(10))
    with pytest.raises(P.DesignError, match=r"pi\[3\]"):
        P.draw(np.array([0.5, 0.5, 0.5, 1.5]), 0, 0, np.arange(4))
    with pytest.raises(P.DesignError, match="device"):
        P.inclusion_probabilities(r, None, 5.0, 0.0, device="tpu")  # type: ignore[arg-type]


# ---------------------------------------------------------------- draws and bookkeeping


def test_draws_are_replayable_and_respect_zero_and_one():
    pi = np.concatenate([np.zeros(100), np.ones(100), np.full(10_000, 0.3)])
    pos = np.arange(pi.size)
    a = P.draw(pi, 5, 1, pos)
    assert np.array_equal(a, P.draw(pi, 5, 1, pos))
    assert not a[:100].any() and a[100:200].all()
    assert abs(a[200:].mean() - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 10_000)
    assert not np.array_equal(a, P.draw(pi, 5, 2, pos))
    # A token's draw depends on its own key only, not on its neighbours or the array order.
    perm = np.random.default_rng(0).permutation(pi.size)
    assert np.array_equal(P.draw(pi[perm], 5, 1, pos[perm]), a[perm])


def test_bias_is_minus_cumulative_log_pi():
    pi = np.array([1.0, 0.5, 0.25, 0.1])
    keep = np.array([True, True, False, True])
    cum, bias = P.update_log_pi(pi, keep, np.array([0.0, -1.0, -1.0, 0.0]))
    np.testing.assert_allclose(cum[keep], [0.0, -1.0 + np.log(0.5), np.log(0.1)])
    assert np.isneginf(cum[2]) and bias[2] == 0
    np.testing.assert_allclose(bias[keep], -cum[keep], rtol=1e-7)
    assert bias.dtype == np.float32 and not np.signbit(bias[0])


# ---------------------------------------------------------------- units and the top slice


def test_units_share_one_probability_and_one_fate():
    rng = np.random.default_rng(3)
    n = 1000
    r = rng.exponential(size=n)
    msg = np.repeat(np.arange(10), 100)
    prot = _prot(n, 4)
    plan = P.plan_eviction(r, prot, 250.0, page_size=16, message_ids=msg, floor=1e-3, seed=4)
    ids = plan.unit_ids
    assert ids is not None and np.bincount(ids).max() <= 16
    for u in range(ids.max() + 1):
        members = ids == u
        assert np.ptp(plan.pi[members]) == 0 and len(set(plan.keep[members])) == 1
        assert len(set(msg[members])) == 1
    assert abs(plan.expected_kept - 250.0) < 1e-6


def test_unit_weight_is_mass_over_root_size():
    r = np.array([1.0, 1.0, 1.0, 1.0, 4.0, 0.0])
    ids = np.array([0, 0, 0, 0, 1, 2])
    pi = P.inclusion_probabilities(r, None, 2.0, 0.0, unit_ids=ids, pi_min=1e-6)
    # Weights 4/sqrt(4) = 2 and 4/1 = 4, so pi_1 = 2 pi_0 (not 1x as mass alone would give,
    # nor 4x as the mean score would), and 4 pi_0 + pi_1 + 1e-6 = 2.
    assert pi[4] / pi[0] == pytest.approx(2.0, rel=1e-12)
    assert 4 * pi[0] + pi[4] + pi[5] == pytest.approx(2.0, rel=1e-12)
    assert pi[5] == 1e-6


def test_top_slice_is_the_best_scoring_share_and_keeps_the_budget():
    rng = np.random.default_rng(4)
    n = 2000
    r = rng.pareto(1.5, n)
    prot = _prot(n)
    budget = 300.0
    plan = P.plan_eviction(r, prot, budget, top_share=0.5, floor=1e-4)
    top = plan.kind == P.Kind.TOP
    assert top.sum() == int(0.5 * (budget - 4))
    assert r[top].min() >= r[~top & ~prot].max()
    assert plan.keep[top].all()
    assert abs(plan.pi.sum() - budget) < 1e-6
    # Without a top slice the same tokens are not all certain: the slice changed the design.
    plain = P.plan_eviction(r, prot, budget, floor=1e-4)
    assert (plain.pi[top] < 1).any()


# ---------------------------------------------------------------- baselines


def test_topk_keeps_exactly_the_best_that_fit():
    r = np.random.default_rng(5).random(500)
    prot = _prot(500)
    plan = P.plan_eviction(r, prot, 100.0, method="topk")
    assert plan.keep.sum() == 100 and plan.keep[prot].all()
    assert r[plan.keep & ~prot].min() > r[~plan.keep].max()
    assert set(np.unique(plan.pi)) <= {0.0, 1.0} and (plan.bias == 0).all()
    assert (plan.kind[~plan.keep] == P.Kind.DROPPED).all()


def test_window_keeps_sinks_and_the_most_recent():
    n = 500
    r = np.random.default_rng(6).random(n)
    plan = P.plan_eviction(r, _prot(n), 100.0, method="window")
    assert plan.keep[:4].all() and plan.keep[-96:].all() and plan.keep.sum() == 100
    # Positions, not array order, define recency; without positions the token index does.
    shuffled = P.plan_eviction(r, _prot(n), 100.0, method="window", positions=np.arange(n)[::-1].copy())
    assert shuffled.keep[:100].all() and shuffled.keep.sum() == 100
    pi = P.inclusion_probabilities(r, _prot(n), 100.0, 0.0, method="window")
    assert (pi[-96:] == 1).all() and pi.sum() == 100


def test_uniform_spreads_the_budget_evenly():
    r = np.random.default_rng(7).pareto(1.0, 1000)
    prot = _prot(1000)
    plan = P.plan_eviction(r, prot, 200.0, method="uniform", seed=3)
    np.testing.assert_allclose(plan.pi[~prot], 196 / 996)
    assert abs(plan.keep.sum() - 200) < 4 * np.sqrt(996 * 0.2 * 0.8)


# ---------------------------------------------------------------- capacity sizing


def test_size_budget_leaves_three_sd_of_headroom():
    rng = np.random.default_rng(8)
    n = 5000
    r = rng.exponential(size=n)
    prot = _prot(n, 40)
    cap = 700.0
    b = P.size_budget(r, prot, cap, floor=1e-3)
    pi = P.inclusion_probabilities(r, prot, b, 1e-3)
    assert b + 3 * np.sqrt((pi * (1 - pi)).sum()) <= cap + 1e-6
    assert b + 3 * np.sqrt((pi * (1 - pi)).sum()) > cap - 0.01
    counts = [P.plan_eviction(r, prot, b, floor=1e-3, seed=s).n_kept for s in range(200)]
    assert max(counts) <= cap
    assert P.size_budget(r, prot, 1e9) == n
    assert P.size_budget(r, prot, cap, method="topk") == cap
    with pytest.raises(P.BudgetInfeasible):
        P.size_budget(r, prot, 30.0)
    with pytest.raises(P.DesignError, match="capacity"):
        P.size_budget(r, prot, -1.0)


# ---------------------------------------------------------------- certificates


def test_certificate_edges():
    a, rel = P.certificate(np.array([0.0, -1e-15, 4.0, 4.0]), np.array([0.0, 1.0, 0.0, 4.0]), 0.05)
    z = P.normal_quantile(0.95)
    np.testing.assert_allclose(a, [0.0, 0.0, 2 * z, 2 * z])
    assert rel[0] == 0.0 and rel[1] == 0.0 and np.isinf(rel[2]) and rel[3] == pytest.approx(z)
    with pytest.raises(P.DesignError, match="delta"):
        P.certificate(np.ones(3), np.ones(3), 1.0)
    with pytest.raises(P.DesignError, match=r"v_hat\[1\]"):
        P.certificate(np.array([1.0, np.nan]), np.ones(2), 0.05)
    with pytest.raises(P.DesignError, match="dof"):
        P.certificate(np.ones(2), np.ones(2), 0.05, dof=np.array([1.0, 0.5]))
    with pytest.raises(P.DesignError, match="broadcast"):
        P.certificate(np.ones((2, 3)), np.ones(4), 0.05)
    # dof = 1 is the two-sided normal quantile; many dof shrink k towards 1.
    a1, _ = P.certificate(np.ones(1), np.ones(1), 0.05, dof=1.0)
    assert a1[0] == pytest.approx(P.normal_quantile(0.975), rel=1e-12)
    a64, _ = P.certificate(np.ones(1), np.ones(1), 0.05, dof=64.0)
    assert 1.0 < a64[0] < 1.2
    # Shapes: (steps, layers, heads) in, same shape out.
    v = np.ones((3, 4, 5))
    a, rel = P.certificate(v, 1.0, 0.1)
    assert a.shape == rel.shape == (3, 4, 5)


def test_turn_statistics_reject_bad_input():
    with pytest.raises(P.DesignError, match="steps, layers, heads"):
        P.turn_statistics(np.ones((4, 5)))
    with pytest.raises(P.DesignError, match="NaN"):
        P.turn_statistics(np.full((1, 2, 2), np.nan))
    with pytest.raises(P.DesignError, match="no steps"):
        P.turn_statistics(np.ones((0, 2, 2)))
    assert P.turn_statistics() == {}
