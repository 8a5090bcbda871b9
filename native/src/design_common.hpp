// Pieces of the design that the CPU and the CUDA paths must compute identically:
// the Philox generator and its key/counter layout, the uniform built from it, the
// unit weight, and the water-filling root finder (a state machine both paths drive
// with their own reductions). Everything here is header-only and host/device.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define CERTCHAT_HD __host__ __device__ __forceinline__
#else
#define CERTCHAT_HD inline
#endif

namespace certchat {

// ---- Philox4x32-10 (Salmon et al., SC'11; Random123's constants) ----

struct U32x4 {
    uint32_t v[4];
};

CERTCHAT_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
    const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
    *hi = static_cast<uint32_t>(p >> 32);
    *lo = static_cast<uint32_t>(p);
}

CERTCHAT_HD U32x4 philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
    constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += W0;
            k1 += W1;
        }
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo32(M0, ctr.v[0], &hi0, &lo0);
        mulhilo32(M1, ctr.v[2], &hi1, &lo1);
        U32x4 next;
        next.v[0] = hi1 ^ ctr.v[1] ^ k0;
        next.v[1] = lo1;
        next.v[2] = hi0 ^ ctr.v[3] ^ k1;
        next.v[3] = lo0;
        ctr = next;
    }
    return ctr;
}

// Uniform in [0, 1) from two words: 53 random bits, exactly representable, so both paths
// agree bit for bit.
CERTCHAT_HD double uniform_from_words(uint32_t a, uint32_t b) {
    const uint64_t hi27 = a >> 5;
    const uint64_t lo26 = b >> 6;
    return static_cast<double>((hi27 << 26) | lo26) * (1.0 / 9007199254740992.0);
}

// The key is the 64-bit seed; the counter is (position / 2, round) as two 64-bit halves.
// One block holds four words, so it serves two neighbouring positions: the even one takes
// words 0-1, the odd one words 2-3. Every (seed, round, position) still names its own bits.
CERTCHAT_HD U32x4 design_block(uint64_t seed, uint64_t round, uint64_t pair) {
    U32x4 ctr;
    ctr.v[0] = static_cast<uint32_t>(pair);
    ctr.v[1] = static_cast<uint32_t>(pair >> 32);
    ctr.v[2] = static_cast<uint32_t>(round);
    ctr.v[3] = static_cast<uint32_t>(round >> 32);
    return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

CERTCHAT_HD double uniform_of_block(const U32x4 &block, uint64_t position) {
    return (position & 1u) ? uniform_from_words(block.v[2], block.v[3]) : uniform_from_words(block.v[0], block.v[1]);
}

CERTCHAT_HD double design_uniform(uint64_t seed, uint64_t round, int64_t position) {
    const uint64_t pos = static_cast<uint64_t>(position);
    return uniform_of_block(design_block(seed, round, pos >> 1), pos);
}

// Sequential callers see positions in pairs (2k, 2k+1) most of the time: keep the last
// block so each pair costs one Philox call.
struct UniformCache {
    uint64_t seed, round;
    uint64_t pair;
    int valid;
    U32x4 block;

    CERTCHAT_HD double operator()(int64_t position) {
        const uint64_t pos = static_cast<uint64_t>(position);
        if (!valid || (pos >> 1) != pair) {
            pair = pos >> 1;
            block = design_block(seed, round, pair);
            valid = 1;
        }
        return uniform_of_block(block, pos);
    }
};

// ---- units ----

// Weight of a unit with total (floored) score `mass` over `size` tokens. mass/sqrt(size)
// is the allocation that minimises the design variance for a fixed expected token count
// (Neyman-style with cost = size); for single tokens it is the score itself.
CERTCHAT_HD double unit_weight(double mass, double size) {
    return size == 1.0 ? mass : mass / sqrt(size);
}

// ---- water-filling ----
//
// Solve g(c) = sum_u s_u * clamp(c * w_u, p, 1) = target for c > 0, where w_u >= 0
// are normalised so max w = 1. g is continuous, non-decreasing and piecewise linear;
// on the piece containing c it equals fixed + c * slope with
//   fixed = sum_{c w >= 1} s + p * sum_{c w <= p} s,   slope = sum_{p < c w < 1} s w.
// The caller evaluates those sums at the proposed c (its own reduction) and feeds
// them back; the solver answers with the next c. Newton on the current piece lands
// exactly on the root once it is in the right piece; a bracket with a geometric
// bisection every 8th step (and whenever Newton leaves the bracket) guarantees progress.

struct WaterfillStats {
    double fixed;
    double slope;
};

struct WaterfillSolver {
    double target;
    double lo;
    double hi;
    double c;
    int iterations;
    int done;   // 1: c is the root; -1: failed to converge
};

constexpr int kWaterfillMaxIterations = 300;
constexpr double kWaterfillRelTol = 1e-13;

CERTCHAT_HD void waterfill_init(WaterfillSolver *s, double target, double c_start, double c_max) {
    s->target = target;
    s->lo = 0.0;
    s->hi = c_max;
    s->c = (c_start > 0.0 && c_start < c_max) ? c_start : 0.5 * c_max;
    s->iterations = 0;
    s->done = 0;
}

CERTCHAT_HD void waterfill_step(WaterfillSolver *s, WaterfillStats st) {
    const double g = st.fixed + s->c * st.slope;
    const double tol = kWaterfillRelTol * (s->target > 1.0 ? s->target : 1.0);
    s->iterations += 1;
    if (fabs(g - s->target) <= tol) {
        s->done = 1;
        return;
    }
    if (g < s->target) {
        s->lo = s->c;
    } else {
        s->hi = s->c;
    }
    if (s->iterations >= kWaterfillMaxIterations || !(s->hi > s->lo)) {
        s->done = -1;
        return;
    }
    double next = -1.0;
    if (st.slope > 0.0 && (s->iterations % 8) != 0) {
        next = (s->target - st.fixed) / st.slope;
    }
    if (!(next > s->lo && next < s->hi)) {
        next = s->lo > 0.0 ? sqrt(s->lo * s->hi) : 0.5 * s->hi;
    }
    if (next == s->c) {
        // The bracket has collapsed onto representable neighbours of the root.
        s->done = fabs(g - s->target) <= 1e-9 * (s->target > 1.0 ? s->target : 1.0) ? 1 : -1;
        return;
    }
    s->c = next;
}

CERTCHAT_HD double clamp_pi(double cw, double p) {
    return cw >= 1.0 ? 1.0 : (cw <= p ? p : cw);
}

}  // namespace certchat
