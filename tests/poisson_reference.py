"""Pure-numpy reference of the design core (native/poisson.py + native/src), for tests only.

Written from the specification in docs/POISSON.md with different algorithms where the
product uses clever ones: water-filling by sorting the breakpoints of the piecewise-linear
budget function and solving on the bracketing piece (the core uses safeguarded Newton),
the top slice by a full lexicographic sort (the core uses nth_element / bit-pattern
bisection), quantiles from the standard library and a series-only chi-square CDF. The
product never imports this module.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = np.uint64(0xFFFFFFFF)

SAMPLED, PROTECTED, TOP, CERTAIN, DROPPED = range(5)
METHODS = ("poisson", "topk", "window", "uniform")


# ---------------------------------------------------------------- Philox


def philox4x32_10(ctr: NDArray, key: NDArray) -> NDArray[np.uint64]:
    """Vectorised Philox4x32-10: ctr (..., 4), key (..., 2) as uint32 values -> (..., 4)."""
    c = [np.asarray(ctr, dtype=np.uint64)[..., j] for j in range(4)]
    k0 = np.asarray(key, dtype=np.uint64)[..., 0].copy()
    k1 = np.asarray(key, dtype=np.uint64)[..., 1].copy()
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(W0)) & MASK32
            k1 = (k1 + np.uint64(W1)) & MASK32
        p0 = np.uint64(M0) * c[0]
        p1 = np.uint64(M1) * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c, axis=-1)


def uniforms(seed: int, rnd: int, positions: NDArray) -> NDArray[np.float64]:
    """Block counter (position // 2, round), key seed; even positions read words 0-1, odd 2-3."""
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    n = pos.size
    pair = pos >> np.uint64(1)
    ctr = np.stack(
        [
            pair & MASK32,
            pair >> np.uint64(32),
            np.full(n, rnd & 0xFFFFFFFF, np.uint64),
            np.full(n, rnd >> 32, np.uint64),
        ],
        axis=-1,
    )
    key = np.tile(np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64), (n, 1))
    out = philox4x32_10(ctr, key)
    odd = (pos & np.uint64(1)).astype(bool)
    a = np.where(odd, out[:, 2], out[:, 0])
    b = np.where(odd, out[:, 3], out[:, 1])
    bits = ((a >> np.uint64(5)) << np.uint64(26)) | (b >> np.uint64(6))
    return bits.astype(np.float64) / 2.0**53


def draw(pi: NDArray, seed: int, rnd: int, positions: NDArray) -> NDArray[np.bool_]:
    return uniforms(seed, rnd, positions) < np.asarray(pi, dtype=np.float64)


# ---------------------------------------------------------------- units


def make_units(n: int, page_size: int = 1, message_ids=None, protected=None) -> NDArray[np.int32]:
    ids = np.zeros(n, dtype=np.int32)
    unit = -1
    run_len = 0
    for i in range(n):
        new_run = i == 0
        if message_ids is not None and i > 0 and message_ids[i] != message_ids[i - 1]:
            new_run = True
        if protected is not None and i > 0 and bool(protected[i]) != bool(protected[i - 1]):
            new_run = True
        if new_run:
            run_len = 0
        if run_len % page_size == 0:
            unit += 1
        ids[i] = unit
        run_len += 1
    return ids


def unit_table(scores, protected, unit_ids, floor, positions=None):
    """(weight, size, protected, position) per unit, summed in token order."""
    s = np.asarray(scores, dtype=np.float64)
    n = s.size
    ids = np.arange(n) if unit_ids is None else np.asarray(unit_ids, dtype=np.int64)
    n_units = n if unit_ids is None else (int(ids.max()) + 1 if n else 0)
    mass = np.bincount(ids, weights=s + floor, minlength=n_units)
    size = np.bincount(ids, minlength=n_units).astype(np.float64)
    prot = np.zeros(n_units, dtype=bool)
    if protected is not None:
        prot[ids[np.asarray(protected, dtype=bool)]] = True
    positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    pos = np.full(n_units, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(pos, ids, positions)
    pos[size == 0] = 0
    with np.errstate(divide="ignore", invalid="ignore"):
        weight = np.where(size == 1, mass, mass / np.sqrt(size))
    weight[size == 0] = 0.0
    return weight, size, prot, pos, ids


# ---------------------------------------------------------------- water-filling


def _g(c: float, w: NDArray, s: NDArray, p: float) -> float:
    return float((s * np.clip(c * w, p, 1.0)).sum())


def waterfill(w: NDArray, s: NDArray, target: float, p: float) -> tuple[NDArray, bool]:
    """pi for units with weights w, sizes s so that sum s*pi = target; (pi, feasible)."""
    total = s.sum()
    if total == 0:
        return np.ones_like(w), True
    if target <= p * total:
        return np.full_like(w, p), not target < p * total * (1 - 1e-12)
    if target >= total:
        return np.ones_like(w), True
    if w.max() == 0:
        return np.full_like(w, target / total), True
    wn = w * (1.0 / w.max())
    pos = wn > 0
    s_pos, s_zero = s[pos].sum(), s[~pos].sum()
    if s_zero > 0 and target >= s_pos + p * s_zero:
        return np.where(pos, 1.0, (target - s_pos) / s_zero), True
    # g is linear between consecutive breakpoints p/w and 1/w: find the bracketing pair.
    bp = np.unique(np.concatenate([p / wn[pos], 1.0 / wn[pos]]))
    lo, hi = 0, bp.size - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _g(bp[mid], wn, s, p) <= target:
            lo = mid
        else:
            hi = mid
    b0, b1 = bp[lo], bp[hi]
    g0, g1 = _g(b0, wn, s, p), _g(b1, wn, s, p)
    c = b0 if g1 == g0 else b0 + (target - g0) * (b1 - b0) / (g1 - g0)
    pi = np.where(pos, np.clip(c * wn, p, 1.0), p)
    return pi, True


def select_prefix(cands: NDArray, key: NDArray, size: NDArray, target: float) -> NDArray[np.bool_]:
    """Units of `cands` in the longest (key desc, index asc) prefix with total size <= target."""
    chosen = np.zeros(key.size, dtype=bool)
    if cands.size == 0:
        return chosen
    order = cands[np.lexsort((cands, -key[cands]))]
    cum = np.cumsum(size[order])
    chosen[order[cum <= target]] = True
    return chosen


def design_units(weight, size, prot, pos, method, budget, pi_min, top_share):
    """(pi, kind, feasible) per unit."""
    n_units = size.size
    pi = np.ones(n_units)
    kind = np.full(n_units, CERTAIN, dtype=np.uint8)
    live = size > 0
    kind[live & prot] = PROTECTED
    cands = np.flatnonzero(live & ~prot)
    deterministic = method in ("topk", "window")
    if budget >= size.sum():
        kind[cands] = TOP if deterministic else CERTAIN
        return pi, kind, True
    t = budget - size[live & prot].sum()
    if deterministic:
        key = weight if method == "topk" else pos.astype(np.float64)
        chosen = select_prefix(cands, key, size, t) if t > 0 else np.zeros(n_units, bool)
        pi[cands] = np.where(chosen[cands], 1.0, 0.0)
        kind[cands] = np.where(chosen[cands], TOP, DROPPED)
        return pi, kind, t >= 0
    if method == "uniform":
        rest, w = cands, np.ones(cands.size)
        top = 0.0
    else:
        top = 0.0
        rest = cands
        if top_share > 0 and t > 0:
            chosen = select_prefix(cands, weight, size, top_share * t)
            pi[chosen] = 1.0
            kind[chosen] = TOP
            top = size[chosen].sum()
            rest = cands[~chosen[cands]]
        w = weight[rest]
    p_rest, feasible = waterfill(w, size[rest], t - top, pi_min)
    pi[rest] = p_rest
    kind[rest] = np.where(p_rest >= 1.0, CERTAIN, SAMPLED)
    return pi, kind, feasible


def inclusion_probabilities(
    scores, protected, budget, floor=0.0, *, pi_min=1e-3, top_share=0.0, unit_ids=None, method="poisson"
):
    weight, size, prot, pos, ids = unit_table(scores, protected, unit_ids, floor)
    pi_u, _, _ = design_units(weight, size, prot, pos, method, budget, pi_min, top_share)
    return pi_u[ids]


def update_log_pi(pi, keep, prev=None):
    pi = np.asarray(pi, dtype=np.float64)
    keep = np.asarray(keep, dtype=bool)
    prev = np.zeros(pi.size) if prev is None else np.asarray(prev, dtype=np.float64)
    with np.errstate(divide="ignore"):
        cum = np.where(keep, prev + np.log(np.where(keep, pi, 1.0)), -np.inf)
    bias = np.where(keep, -cum, 0.0).astype(np.float32) + np.float32(0.0)
    return cum, bias


def plan_eviction(scores, protected, budget, *, method="poisson", unit_ids=None, top_share=0.0, floor=0.0,
                  pi_min=1e-3, seed=0, rnd=0, positions=None, prev_cum_logpi=None):
    """(keep, pi, kind, cum, bias, feasible) per token."""
    n = len(scores)
    positions = np.arange(n) if positions is None else np.asarray(positions, dtype=np.int64)
    weight, size, prot, pos, ids = unit_table(scores, protected, unit_ids, floor, positions)
    pi_u, kind_u, feasible = design_units(weight, size, prot, pos, method, budget, pi_min, top_share)
    keep_u = uniforms(seed, rnd, pos) < pi_u
    keep, pi = keep_u[ids], pi_u[ids]
    cum, bias = update_log_pi(pi, keep, prev_cum_logpi)
    return keep, pi, kind_u[ids], cum, bias, feasible


def size_budget(
    scores, protected, capacity, *, z=3.0, method="poisson", unit_ids=None, top_share=0.0, floor=0.0, pi_min=1e-3
):
    weight, size, prot, pos, _ = unit_table(scores, protected, unit_ids, floor)

    def high(b: float) -> float:
        pi, _, _ = design_units(weight, size, prot, pos, method, b, pi_min, top_share)
        return (size * pi).sum() + z * math.sqrt((size**2 * pi * (1 - pi)).sum())

    lo, hi = 0.0, min(capacity, size.sum())
    if high(hi) <= capacity:
        return hi
    if high(lo) > capacity:
        return lo
    while hi - lo > 1e-3:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if high(mid) <= capacity else (lo, mid)
    return lo


# ---------------------------------------------------------------- estimator


def hajek(logits, values, pi, keep, unit_ids=None):
    """(o_hat (R,d), v_token, v_cluster, dof, dof_var), per draw, for keep of shape (R, n)."""
    logits = np.asarray(logits, dtype=np.float64)
    V = np.asarray(values, dtype=np.float64)
    pi = np.asarray(pi, dtype=np.float64)
    keep = np.atleast_2d(np.asarray(keep, dtype=bool))
    n, d = V.shape
    ids = np.arange(n) if unit_ids is None else np.asarray(unit_ids)
    n_units = int(ids.max()) + 1
    unit_pi = np.zeros(n_units)
    unit_pi[ids] = pi
    L = np.where(keep, logits - np.log(pi), -np.inf)
    P = np.exp(L - L.max(axis=1, keepdims=True))
    P /= P.sum(axis=1, keepdims=True)
    o = P @ V
    R = keep.shape[0]
    vt, vc, dof, dof_var = np.empty(R), np.empty(R), np.empty(R), np.empty(R)
    for r in range(R):
        resid = V - o[r]
        vt[r] = ((1 - pi) * P[r] ** 2 * (resid**2).sum(axis=1)).sum()
        Y = np.zeros((n_units, d))
        np.add.at(Y, ids, P[r][:, None] * resid)
        w = 1 - unit_pi
        y2 = (Y**2).sum(axis=1)
        vc[r] = (w * y2).sum()
        C = np.einsum("u,ua,ub->ab", w, Y, Y)
        dterm = (w * (w * y2) ** 2).sum()
        num, den = vc[r] ** 2 - dterm, (C**2).sum() - dterm
        h = num / den if num > 0 and den > 0 else 1.0
        dof[r] = min(max(h, 1.0), d)
        dof_var[r] = 2 * vc[r] ** 2 / dterm if dterm > 0 else np.inf
    return o, vt, vc, dof, dof_var


def _chi2_cdf(x: float, k: float) -> float:
    """P(k/2, x/2) by its power series alone (converges everywhere; slow but simple)."""
    a, y = 0.5 * k, 0.5 * x
    if y <= 0:
        return 0.0
    term = 1.0 / a
    total = term
    j = 1
    while term > total * 1e-17 or j < 10:
        term *= y / (a + j)
        total += term
        j += 1
    return math.exp(a * math.log(y) - y - math.lgamma(a)) * total


def chi2_quantile(p: float, k: float) -> float:
    lo, hi = 0.0, max(10.0, 10 * k)
    while _chi2_cdf(hi, k) < p:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _chi2_cdf(mid, k) < p else (lo, mid)
    return 0.5 * (lo + hi)


def _beta_inc(a: float, b: float, x: float) -> float:
    """I_x(a, b) from the hypergeometric series, kept at x <= 1/2 by symmetry."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > 0.5:
        return 1.0 - _beta_inc(b, a, 1.0 - x)
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    term, total, j = 1.0, 1.0, 0
    while term > total * 1e-17:
        term *= (a + b + j) / (a + 1 + j) * x
        total += term
        j += 1
    return math.exp(log_front) * total / a


def f_quantile(p: float, d1: float, d2: float) -> float:
    if math.isinf(d2):
        return chi2_quantile(p, d1) / d1
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _beta_inc(d1 / 2, d2 / 2, mid) < p else (lo, mid)
    y = 0.5 * (lo + hi)
    return d2 * y / (d1 * (1 - y))


def certificate(v_hat, o_norm2, delta, dof=None, dof_var=None):
    v = np.maximum(np.asarray(v_hat, dtype=np.float64), 0.0)
    o2 = np.broadcast_to(np.asarray(o_norm2, dtype=np.float64), v.shape)
    if dof is None:
        k = np.full(v.shape, NormalDist().inv_cdf(1 - delta))
    else:
        dd = np.broadcast_to(np.asarray(dof, dtype=np.float64), v.shape)
        mm = np.broadcast_to(np.inf if dof_var is None else np.asarray(dof_var, dtype=np.float64), v.shape)
        k = np.vectorize(lambda h, m: math.sqrt(f_quantile(1 - delta, h, m)))(dd, mm)
    a = k * np.sqrt(v)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(o2 > 0, a / np.sqrt(o2), np.where(a == 0, 0.0, np.inf))
    return a, rel


# ---------------------------------------------------------------- aggregates


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default definition), by hand."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    i = int(math.floor(pos))
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (pos - i)


def window_statistics(cert, quantile=0.95) -> dict[str, float]:
    c = np.asarray(cert, dtype=np.float64)
    S, L, H = c.shape
    layer_means = [sum(c[s, ly, h] for s in range(S) for h in range(H)) / (S * H) for ly in range(L)]
    step_lmhm = [max(sum(c[s, ly, h] for h in range(H)) / H for ly in range(L)) for s in range(S)]
    step_q = [_quantile([c[s, ly, h] for ly in range(L) for h in range(H)], quantile) for s in range(S)]
    flat = [float(x) for x in c.reshape(-1)]
    return {
        "layer_max_head_mean": max(layer_means),
        "q": _quantile(flat, quantile),
        "mean": sum(flat) / len(flat),
        "max": max(flat),
        "step_max_layer_max_head_mean": max(step_lmhm),
        "step_max_q": max(step_q),
    }
