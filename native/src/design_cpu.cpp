// The CPU design path: units, inclusion probabilities (top slice + water-filling),
// the deterministic baselines, counter-based draws, cumulative log-pi bookkeeping and
// budget sizing. It is the reference the CUDA path is checked against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <new>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "certchat_core.h"
#include "design_common.hpp"
#include "status.hpp"

namespace certchat {
namespace {

struct Units {
    std::vector<double> mass;    // sum of (score + floor) over the unit's tokens
    std::vector<double> size;    // number of tokens
    std::vector<uint8_t> prot;   // any token protected
    std::vector<int64_t> pos;    // smallest position (draw key, window order); token index without positions
    std::vector<double> weight;  // unit_weight(mass, size)
};

struct KeyIndex {
    double key;
    int64_t index;
};

// Buffers reused across calls on a thread: fresh 100+ kB vectors per call cost more in
// page faults than the design itself.
struct Workspace {
    Units units;
    std::vector<int64_t> cands, rest;
    std::vector<KeyIndex> order;
    std::vector<uint8_t> chosen, kind_u, keep_u;
    std::vector<double> pi_u, key, key_tmp, wn, sz, ones;
};

// Not inlined: GCC would otherwise re-derive the TLS address (a __tls_get_addr call)
// inside hot loops instead of keeping the pointer.
__attribute__((noinline)) Workspace &workspace() {
    thread_local Workspace ws;
    return ws;
}

// Units from tokens, validating every token on the way (one pass over the inputs).
int build_units(int64_t n, const double *scores, const uint8_t *prot, const int32_t *unit_ids, int64_t n_units,
                const int64_t *positions, const double *prev_cum, double floor, Units *u) {
    const int64_t U = unit_ids != nullptr ? n_units : n;
    u->mass.resize(U);
    u->size.resize(U);
    u->prot.resize(U);
    u->pos.resize(U);
    u->weight.resize(U);
    // Raw restrict pointers: the uint8_t stores would otherwise make the compiler reload
    // every vector's data pointer on each token.
    double *__restrict mass = u->mass.data();
    double *__restrict size = u->size.data();
    uint8_t *__restrict uprot = u->prot.data();
    int64_t *__restrict upos = u->pos.data();
    double *__restrict weight = u->weight.data();
    constexpr double kMax = std::numeric_limits<double>::max();
    bool ok = true;
    if (prev_cum != nullptr)
        for (int64_t i = 0; i < n; ++i) ok &= prev_cum[i] <= 0.0 && prev_cum[i] >= -kMax;
    if (positions != nullptr)
        for (int64_t i = 0; i < n; ++i) ok &= positions[i] >= 0;
    if (unit_ids == nullptr) {
        for (int64_t i = 0; i < n; ++i) {
            const double sc = scores[i];
            ok &= sc >= 0.0 && sc <= kMax;  // false for NaN and inf
            mass[i] = weight[i] = sc + floor;
            size[i] = 1.0;
            uprot[i] = prot != nullptr ? (prot[i] != 0) : 0;
            upos[i] = positions != nullptr ? positions[i] : i;  // no positions: token order
        }
        return ok ? CERTCHAT_OK : explain_tokens(n, scores, unit_ids, n_units, positions, prev_cum);
    }
    std::fill(mass, mass + U, 0.0);
    std::fill(size, size + U, 0.0);
    std::fill(uprot, uprot + U, uint8_t{0});
    std::fill(upos, upos + U, std::numeric_limits<int64_t>::max());
    for (int64_t i = 0; i < n; ++i) {
        const int64_t k = unit_ids[i];
        if (k < 0 || k >= n_units) {
            ok = false;
            break;
        }
        const double sc = scores[i];
        ok &= sc >= 0.0 && sc <= kMax;
        // Summing in token order is the contract the CUDA path reproduces bit for bit.
        mass[k] += sc + floor;
        size[k] += 1.0;
        if (prot != nullptr && prot[i]) uprot[k] = 1;
        const int64_t p = positions != nullptr ? positions[i] : i;  // no positions: token order
        if (p < upos[k]) upos[k] = p;
    }
    if (!ok) return explain_tokens(n, scores, unit_ids, n_units, positions, prev_cum);
    for (int64_t k = 0; k < U; ++k) {
        weight[k] = size[k] > 0.0 ? unit_weight(mass[k], size[k]) : 0.0;
        if (size[k] == 0.0) upos[k] = 0;
    }
    return CERTCHAT_OK;
}

// Longest prefix of `cands` in (key desc, index asc) order whose sizes sum to <= target;
// marks the chosen units and returns their total size.
double select_prefix(const std::vector<int64_t> &cands, const double *key, const double *size, double target,
                     std::vector<uint8_t> &chosen, Workspace &ws) {
    double total = 0.0;
    for (int64_t k : cands) total += size[k];
    if (total <= target) {
        for (int64_t k : cands) chosen[k] = 1;
        return total;
    }
    if (target < 1.0) return 0.0;  // every unit holds at least one token
    // The prefix holds at most floor(target) units (each has a token), so only the first
    // k_need of the order matter, and all of them have a key >= the k_need-th largest key.
    const size_t k_need = std::min(cands.size(), static_cast<size_t>(std::floor(target)) + 1);
    std::vector<double> &keys = ws.key_tmp;
    keys.resize(cands.size());
    for (size_t j = 0; j < cands.size(); ++j) keys[j] = key[cands[j]];
    std::nth_element(keys.begin(), keys.begin() + (k_need - 1), keys.end(), std::greater<double>());
    const double kth = keys[k_need - 1];
    std::vector<KeyIndex> &order = ws.order;
    order.clear();
    for (int64_t k : cands)
        if (key[k] >= kth) order.push_back(KeyIndex{key[k], k});
    std::sort(order.begin(), order.end(), [](const KeyIndex &a, const KeyIndex &b) {
        return a.key > b.key || (a.key == b.key && a.index < b.index);
    });
    double cum = 0.0;
    for (size_t j = 0; j < order.size(); ++j) {
        const int64_t k = order[j].index;
        if (cum + size[k] > target) break;
        cum += size[k];
        chosen[k] = 1;
    }
    return cum;
}

// One sweep of the water-filling solver: token mass capped at 1, floored at p, and the
// slope of the unclamped middle at multiplier c. Which side of the clamp a unit falls on is
// unpredictable, so the sweep is branch-free (SSE2 masks, four lanes).
struct WaterfillSums {
    double hi, lo, slope;
};

// kUnitSizes: every size is 1 (token-level units), so the sizes array is not read.
template <bool kUnitSizes>
WaterfillSums waterfill_sums(const double *__restrict wn, const double *__restrict sz, size_t m, double c,
                             double p) {
    size_t j = 0;
    WaterfillSums out{0.0, 0.0, 0.0};
#if defined(__SSE2__)
    const __m128d vc = _mm_set1_pd(c), one = _mm_set1_pd(1.0), vp = _mm_set1_pd(p);
    __m128d hi0 = _mm_setzero_pd(), hi1 = hi0, lo0 = hi0, lo1 = hi0, sl0 = hi0, sl1 = hi0;
    for (; j + 4 <= m; j += 4) {
        const __m128d w0 = _mm_loadu_pd(wn + j), w1 = _mm_loadu_pd(wn + j + 2);
        const __m128d s0 = kUnitSizes ? one : _mm_loadu_pd(sz + j);
        const __m128d s1 = kUnitSizes ? one : _mm_loadu_pd(sz + j + 2);
        const __m128d cw0 = _mm_mul_pd(vc, w0), cw1 = _mm_mul_pd(vc, w1);
        const __m128d h0 = _mm_cmpge_pd(cw0, one), h1 = _mm_cmpge_pd(cw1, one);
        const __m128d l0 = _mm_cmple_pd(cw0, vp), l1 = _mm_cmple_pd(cw1, vp);
        hi0 = _mm_add_pd(hi0, _mm_and_pd(h0, s0));
        hi1 = _mm_add_pd(hi1, _mm_and_pd(h1, s1));
        lo0 = _mm_add_pd(lo0, _mm_and_pd(l0, s0));
        lo1 = _mm_add_pd(lo1, _mm_and_pd(l1, s1));
        const __m128d sw0 = kUnitSizes ? w0 : _mm_mul_pd(s0, w0);
        const __m128d sw1 = kUnitSizes ? w1 : _mm_mul_pd(s1, w1);
        sl0 = _mm_add_pd(sl0, _mm_andnot_pd(_mm_or_pd(h0, l0), sw0));
        sl1 = _mm_add_pd(sl1, _mm_andnot_pd(_mm_or_pd(h1, l1), sw1));
    }
    double lanes[2];
    _mm_storeu_pd(lanes, _mm_add_pd(hi0, hi1));
    out.hi = lanes[0] + lanes[1];
    _mm_storeu_pd(lanes, _mm_add_pd(lo0, lo1));
    out.lo = lanes[0] + lanes[1];
    _mm_storeu_pd(lanes, _mm_add_pd(sl0, sl1));
    out.slope = lanes[0] + lanes[1];
#endif
    for (; j < m; ++j) {
        const double cw = c * wn[j];
        const double sj = kUnitSizes ? 1.0 : sz[j];
        if (cw >= 1.0)
            out.hi += sj;
        else if (cw <= p)
            out.lo += sj;
        else
            out.slope += sj * wn[j];
    }
    return out;
}

// Water-fill the units in `rest` so that sum size * pi = target (see design_common.hpp).
int waterfill(const std::vector<int64_t> &rest, const double *weight, const double *size, double target, double p,
              double *pi, uint8_t *kind, Workspace &ws) {
    double s_rest = 0.0, wmax = 0.0;
    for (int64_t k : rest) {
        s_rest += size[k];
        wmax = std::max(wmax, weight[k]);
    }
    if (s_rest == 0.0) return CERTCHAT_OK;
    auto set = [&](int64_t k, double v) {
        pi[k] = v;
        kind[k] = v >= 1.0 ? CERTCHAT_KIND_CERTAIN : CERTCHAT_KIND_SAMPLED;
    };
    if (target <= p * s_rest) {
        for (int64_t k : rest) set(k, p);
        if (target < p * s_rest * (1.0 - 1e-12))
            return fail(CERTCHAT_WARN_BUDGET_INFEASIBLE,
                        "budget infeasible: %g tokens left for %g unprotected ones at pi_min = %g need %g", target,
                        s_rest, p, p * s_rest);
        return CERTCHAT_OK;
    }
    if (target >= s_rest) {
        for (int64_t k : rest) set(k, 1.0);
        return CERTCHAT_OK;
    }
    if (wmax == 0.0) {
        // All weights zero (zero scores, zero floor): nothing ranks them, so share equally.
        for (int64_t k : rest) set(k, target / s_rest);
        return CERTCHAT_OK;
    }
    // Compact (normalised weight, size) arrays in `rest` order: the solver sweeps them often.
    // Zero weights need no special case in a sweep: c * 0 <= p counts them at pi_min.
    const size_t m = rest.size();
    ws.wn.resize(m);
    ws.sz.resize(m);
    double *wn = ws.wn.data();
    double *sz = ws.sz.data();
    const double inv_wmax = 1.0 / wmax;
    double s_pos = 0.0, s_zero = 0.0, sw = 0.0, wmin_pos = 1.0;
    bool unit_sizes = true;
    for (size_t j = 0; j < m; ++j) {
        const int64_t k = rest[j];
        const double w = weight[k] * inv_wmax;
        wn[j] = w;
        sz[j] = size[k];
        unit_sizes &= size[k] == 1.0;
        if (w > 0.0) {
            s_pos += size[k];
            sw += size[k] * w;
            wmin_pos = std::min(wmin_pos, w);
        } else {
            s_zero += size[k];
        }
    }
    if (s_zero > 0.0 && target >= s_pos + p * s_zero) {
        // Every scored unit is kept for sure; the zero-weight ones share what is left.
        const double level = (target - s_pos) / s_zero;
        for (size_t j = 0; j < m; ++j) set(rest[j], wn[j] > 0.0 ? 1.0 : level);
        return CERTCHAT_OK;
    }
    WaterfillSolver solver;
    waterfill_init(&solver, target, (target - p * s_zero) / sw, 1.0 / wmin_pos);
    while (solver.done == 0) {
        const double c = solver.c;
        const WaterfillSums sums =
            unit_sizes ? waterfill_sums<true>(wn, sz, m, c, p) : waterfill_sums<false>(wn, sz, m, c, p);
        waterfill_step(&solver, WaterfillStats{sums.hi + p * sums.lo, sums.slope});
    }
    if (solver.done < 0) return fail(CERTCHAT_ERR_INTERNAL, "water-filling did not converge (target %g)", target);
    double got = 0.0;
    const double c = solver.c;
    for (size_t j = 0; j < m; ++j) {
        const int64_t k = rest[j];
        const double v = clamp_pi(c * wn[j], p);
        pi[k] = v;
        kind[k] = v >= 1.0 ? CERTCHAT_KIND_CERTAIN : CERTCHAT_KIND_SAMPLED;
        got += sz[j] * v;
    }
    if (std::fabs(got - target) > 1e-9 * std::max(1.0, target))
        return fail(CERTCHAT_ERR_INTERNAL, "water-filling missed its target: %.17g vs %.17g", got, target);
    return CERTCHAT_OK;
}

// Probabilities and kinds per unit for one round.
int design_units(const Units &u, const certchat_design &d, double *pi, uint8_t *kind, Workspace &ws) {
    const int64_t U = static_cast<int64_t>(u.size.size());
    const bool deterministic = d.method == CERTCHAT_METHOD_TOPK || d.method == CERTCHAT_METHOD_WINDOW;
    double s_tot = 0.0, m = 0.0;
    std::vector<int64_t> &cands = ws.cands;
    cands.clear();
    for (int64_t k = 0; k < U; ++k) {
        s_tot += u.size[k];
        if (u.size[k] == 0.0) {
            // A unit without tokens affects nothing; give it a harmless value.
            pi[k] = 1.0;
            kind[k] = CERTCHAT_KIND_CERTAIN;
        } else if (u.prot[k]) {
            m += u.size[k];
            pi[k] = 1.0;
            kind[k] = CERTCHAT_KIND_PROTECTED;
        } else {
            cands.push_back(k);
        }
    }
    if (d.budget >= s_tot) {
        for (int64_t k : cands) {
            pi[k] = 1.0;
            kind[k] = deterministic ? CERTCHAT_KIND_TOP : CERTCHAT_KIND_CERTAIN;
        }
        return CERTCHAT_OK;
    }
    const double t = d.budget - m;
    if (deterministic) {
        const double *key = u.weight.data();
        if (d.method == CERTCHAT_METHOD_WINDOW) {
            ws.key.resize(U);
            for (int64_t k = 0; k < U; ++k) ws.key[k] = static_cast<double>(u.pos[k]);
            key = ws.key.data();
        }
        ws.chosen.assign(U, 0);
        if (t > 0.0) select_prefix(cands, key, u.size.data(), t, ws.chosen, ws);
        for (int64_t k : cands) {
            pi[k] = ws.chosen[k] ? 1.0 : 0.0;
            kind[k] = ws.chosen[k] ? CERTCHAT_KIND_TOP : CERTCHAT_KIND_DROPPED;
        }
        if (t < 0.0)
            return fail(CERTCHAT_WARN_BUDGET_INFEASIBLE, "budget infeasible: %g is below the %g protected tokens",
                        d.budget, m);
        return CERTCHAT_OK;
    }
    if (d.method == CERTCHAT_METHOD_UNIFORM) {
        ws.ones.assign(U, 1.0);
        return waterfill(cands, ws.ones.data(), u.size.data(), t, d.pi_min, pi, kind, ws);
    }
    double top = 0.0;
    std::vector<int64_t> &rest = ws.rest;
    rest.clear();
    if (d.top_share > 0.0 && t > 0.0) {
        ws.chosen.assign(U, 0);
        top = select_prefix(cands, u.weight.data(), u.size.data(), d.top_share * t, ws.chosen, ws);
        for (int64_t k : cands) {
            if (ws.chosen[k]) {
                pi[k] = 1.0;
                kind[k] = CERTCHAT_KIND_TOP;
            } else {
                rest.push_back(k);
            }
        }
        return waterfill(rest, u.weight.data(), u.size.data(), t - top, d.pi_min, pi, kind, ws);
    }
    return waterfill(cands, u.weight.data(), u.size.data(), t, d.pi_min, pi, kind, ws);
}

void update_one(double pi, bool kept, double prev, double *cum, float *bias) {
    if (kept) {
        *cum = prev + std::log(pi);
        *bias = static_cast<float>(0.0 - *cum);
    } else {
        *cum = -std::numeric_limits<double>::infinity();
        *bias = 0.0f;
    }
}

// The full round on units; token outputs may be NULL where the caller wants fewer.
int plan(int64_t n, const double *scores, const uint8_t *prot, const int32_t *unit_ids, int64_t n_units,
         const int64_t *positions, const double *prev_cum, const certchat_design *design, uint8_t *keep_out,
         double *pi_out, uint8_t *kind_out, double *cum_out, float *bias_out) {
    int rc = check_design(design);
    if (rc != CERTCHAT_OK) return rc;
    rc = check_token_args(n, scores, unit_ids, n_units);
    if (rc != CERTCHAT_OK) return rc;
    if (n == 0) return CERTCHAT_OK;
    Workspace &ws = workspace();
    Units &u = ws.units;
    rc = build_units(n, scores, prot, unit_ids, n_units, positions, prev_cum, design->floor, &u);
    if (rc != CERTCHAT_OK) return rc;
    const size_t U = u.size.size();
    ws.pi_u.resize(U);
    ws.kind_u.resize(U);
    const int status = design_units(u, *design, ws.pi_u.data(), ws.kind_u.data(), ws);
    if (status < 0) return status;
    const double *pi_u = ws.pi_u.data();
    const uint8_t *kind_u = ws.kind_u.data();
    ws.keep_u.resize(keep_out != nullptr ? U : 0);
    uint8_t *keep_u = ws.keep_u.data();
    if (keep_out != nullptr) {
        // Only 0 < pi < 1 needs a draw: u in [0, 1) decides pi = 0 and pi = 1 the same way.
        const int64_t *upos = u.pos.data();
        UniformCache uniform{design->seed, design->round, 0, 0, {}};
        for (size_t k = 0; k < U; ++k) {
            const double p = pi_u[k];
            keep_u[k] = p >= 1.0 ? 1 : (p <= 0.0 ? 0 : (uniform(upos[k]) < p ? 1 : 0));
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t k = unit_ids != nullptr ? unit_ids[i] : i;
        if (pi_out != nullptr) pi_out[i] = pi_u[k];
        if (kind_out != nullptr) kind_out[i] = kind_u[k];
        if (keep_out != nullptr) {
            keep_out[i] = keep_u[k];
            if (cum_out != nullptr && bias_out != nullptr)
                update_one(pi_u[k], keep_u[k] != 0, prev_cum != nullptr ? prev_cum[i] : 0.0, &cum_out[i],
                           &bias_out[i]);
        }
    }
    return status;
}

}  // namespace
}  // namespace certchat

using namespace certchat;

extern "C" {

void certchat_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    U32x4 c;
    std::memcpy(c.v, ctr, sizeof c.v);
    const U32x4 r = philox4x32_10(c, key[0], key[1]);
    std::memcpy(out, r.v, sizeof r.v);
}

int certchat_uniforms(int64_t n, const int64_t *positions, uint64_t seed, uint64_t round, double *u_out) {
    clear_error();
    if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
    if (n > 0 && (positions == nullptr || u_out == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "positions and u_out are required");
    // Positions in pairs (2k, 2k+1) share one Philox block; the cache spends it once.
    UniformCache uniform{seed, round, 0, 0, {}};
    for (int64_t i = 0; i < n; ++i) u_out[i] = uniform(positions[i]);
    return CERTCHAT_OK;
}

int certchat_draw(int64_t n, const double *pi, const int64_t *positions, uint64_t seed, uint64_t round,
                  uint8_t *keep_out) {
    clear_error();
    if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
    if (n > 0 && (pi == nullptr || positions == nullptr || keep_out == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "pi, positions and keep_out are required");
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) ok &= pi[i] >= 0.0 && pi[i] <= 1.0;
    if (!ok) return explain_pi_range(n, pi);
    UniformCache uniform{seed, round, 0, 0, {}};
    for (int64_t i = 0; i < n; ++i) {
        // pi = 0 and pi = 1 need no uniform: u in [0, 1) decides them the same way.
        const double p = pi[i];
        keep_out[i] = p >= 1.0 ? 1 : (p <= 0.0 ? 0 : (uniform(positions[i]) < p ? 1 : 0));
    }
    return CERTCHAT_OK;
}

int certchat_inclusion_probabilities(int64_t n, const double *scores, const uint8_t *protected_,
                                     const int32_t *unit_ids, int64_t n_units, const certchat_design *design,
                                     double *pi_out, uint8_t *kind_out) {
    clear_error();
    if (n > 0 && pi_out == nullptr) return fail(CERTCHAT_ERR_INVALID, "pi_out is NULL");
    try {
        return plan(n, scores, protected_, unit_ids, n_units, nullptr, nullptr, design, nullptr, pi_out, kind_out,
                    nullptr, nullptr);
    } catch (const std::bad_alloc &) {
        return fail(CERTCHAT_ERR_ALLOC, "out of memory");
    }
}

int certchat_update_log_pi(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum,
                           double *cum_out, float *bias_out) {
    clear_error();
    if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0");
    if (n > 0 && (pi == nullptr || keep == nullptr || cum_out == nullptr || bias_out == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "pi, keep, cum_out and bias_out are required");
    bool ok = true;
    for (int64_t i = 0; i < n; ++i) {
        ok &= !keep[i] || (pi[i] > 0.0 && pi[i] <= 1.0);
        if (prev_cum != nullptr) ok &= prev_cum[i] <= 0.0 && prev_cum[i] >= -std::numeric_limits<double>::max();
    }
    if (!ok) return explain_update(n, pi, keep, prev_cum);
    for (int64_t i = 0; i < n; ++i)
        update_one(pi[i], keep[i] != 0, prev_cum != nullptr ? prev_cum[i] : 0.0, &cum_out[i], &bias_out[i]);
    return CERTCHAT_OK;
}

int certchat_plan_eviction(int64_t n, const double *scores, const uint8_t *protected_, const int32_t *unit_ids,
                           int64_t n_units, const int64_t *positions, const double *prev_cum,
                           const certchat_design *design, uint8_t *keep_out, double *pi_out, uint8_t *kind_out,
                           double *cum_out, float *bias_out) {
    clear_error();
    if (n > 0 && (positions == nullptr || keep_out == nullptr || pi_out == nullptr || cum_out == nullptr ||
                  bias_out == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "positions, keep_out, pi_out, cum_out and bias_out are required");
    try {
        return plan(n, scores, protected_, unit_ids, n_units, positions, prev_cum, design, keep_out, pi_out,
                    kind_out, cum_out, bias_out);
    } catch (const std::bad_alloc &) {
        return fail(CERTCHAT_ERR_ALLOC, "out of memory");
    }
}

int certchat_size_budget(int64_t n, const double *scores, const uint8_t *protected_, const int32_t *unit_ids,
                         int64_t n_units, const certchat_design *design, double capacity, double z,
                         double *budget_out) {
    clear_error();
    if (budget_out == nullptr) return fail(CERTCHAT_ERR_INVALID, "budget_out is NULL");
    if (!(capacity >= 0.0) || std::isinf(capacity))
        return fail(CERTCHAT_ERR_INVALID, "capacity must be finite and >= 0, got %g", capacity);
    if (!(z >= 0.0) || std::isinf(z)) return fail(CERTCHAT_ERR_INVALID, "z must be finite and >= 0, got %g", z);
    if (design == nullptr) return fail(CERTCHAT_ERR_INVALID, "design is NULL");
    certchat_design d = *design;
    d.budget = 0.0;
    int rc = check_design(&d);
    if (rc == CERTCHAT_OK) rc = check_token_args(n, scores, unit_ids, n_units);
    if (rc != CERTCHAT_OK) return rc;
    try {
        Workspace &ws = workspace();
        Units &u = ws.units;
        rc = build_units(n, scores, protected_, unit_ids, n_units, nullptr, nullptr, d.floor, &u);
        if (rc != CERTCHAT_OK) return rc;
        const size_t U = u.size.size();
        double s_tot = 0.0;
        for (double s : u.size) s_tot += s;
        std::vector<double> pi(U);
        std::vector<uint8_t> kind(U);
        // Upper end of the realized count at budget b: its mean plus z standard deviations.
        auto high = [&](double b, double *value) -> int {
            d.budget = b;
            const int st = design_units(u, d, pi.data(), kind.data(), ws);
            if (st < 0) return st;
            double mean = 0.0, var = 0.0;
            for (size_t k = 0; k < U; ++k) {
                mean += u.size[k] * pi[k];
                var += u.size[k] * u.size[k] * pi[k] * (1.0 - pi[k]);
            }
            *value = mean + z * std::sqrt(var);
            return CERTCHAT_OK;
        };
        double lo = 0.0, hi = std::min(capacity, s_tot), v = 0.0;
        if ((rc = high(hi, &v)) < 0) return rc;
        if (v <= capacity) {
            *budget_out = hi;
            return CERTCHAT_OK;
        }
        if ((rc = high(lo, &v)) < 0) return rc;
        if (v > capacity) {
            *budget_out = lo;
            return fail(CERTCHAT_WARN_BUDGET_INFEASIBLE,
                        "capacity %g cannot hold the protected tokens plus pi_min of the rest", capacity);
        }
        // Bisection to a thousandth of a token: h(b) is increasing wherever pi stays below 1.
        while (hi - lo > 1e-3) {
            const double mid = 0.5 * (lo + hi);
            if ((rc = high(mid, &v)) < 0) return rc;
            (v <= capacity ? lo : hi) = mid;
        }
        *budget_out = lo;
        return CERTCHAT_OK;
    } catch (const std::bad_alloc &) {
        return fail(CERTCHAT_ERR_ALLOC, "out of memory");
    }
}

}  // extern "C"
