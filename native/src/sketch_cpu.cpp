// The evicted-key sketch: quantised K rows of evicted tokens, scored against the question's query rows
// on the scale of the kept cells' softmax (docs/POISSON.md, "Phase 1"). Stateless: the caller owns the
// storage (native/sketch.py keeps it per conversation). The multi-layer entry points split their work over
// threads by (layer, chunk of tokens): each output element is computed by one task in a fixed order, so the
// results do not depend on the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define CERTCHAT_X86 1
#endif

#include "certchat_core.h"
#include "status.hpp"

// x86: AVX2 clones of the plain hot loops, picked at load time (the library itself targets baseline x86-64)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CERTCHAT_HOT __attribute__((target_clones("avx2", "default")))
#else
#define CERTCHAT_HOT
#endif

namespace {

// IEEE half <-> float, round to nearest even (the scales are stored as half: 2 bytes per row and head).
uint16_t to_half(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u) {
        return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    }
    if (absx >= 0x477ff000u) {
        return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (>= 65520 rounds to inf)
    }
    if (absx < 0x38800000u) {  // subnormal half (or zero)
        if (absx < 0x33000000u) {
            return static_cast<uint16_t>(sign);
        }
        const uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        const int shift = 126 - static_cast<int>(absx >> 23);  // 14..24
        const uint32_t half_ulp = 1u << (shift - 1);
        uint32_t q = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        if (rem > half_ulp || (rem == half_ulp && (q & 1u))) {
            ++q;
        }
        return static_cast<uint16_t>(sign | q);
    }
    uint32_t h = ((absx - 0x38000000u) >> 13);
    const uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
        ++h;
    }
    return static_cast<uint16_t>(sign | h);
}

float from_half(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu;
    const uint32_t m = h & 0x3ffu;
    uint32_t x;
    if (e == 0) {
        if (m == 0) {
            x = sign;
        } else {
            float v = std::ldexp(static_cast<float>(m), -24);
            return sign ? -v : v;
        }
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}

int check_shape(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits) {
    if (n < 0 || n_kv_head < 1 || head_dim < 1) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch: n = %lld, n_kv_head = %lld, head_dim = %lld: need n >= 0 and "
                              "positive sizes", static_cast<long long>(n), static_cast<long long>(n_kv_head),
                              static_cast<long long>(head_dim));
    }
    if (bits != 32 && bits != 8 && bits != 4) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch: bits = %d, use 32, 8 or 4", bits);
    }
    if (bits == 4 && head_dim % 2 != 0) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch: 4-bit rows need an even head_dim, got %lld",
                              static_cast<long long>(head_dim));
    }
    return CERTCHAT_OK;
}

int64_t row_bytes(int64_t n_kv_head, int64_t head_dim, int32_t bits) { return n_kv_head * head_dim * bits / 8; }

// One row of one layer back to F32 (NaN for an absent row).
void dequantize_row(int64_t n_kv_head, int64_t head_dim, int32_t bits, const uint8_t *code, const uint16_t *scale,
                    float *k) {
    const int64_t w = n_kv_head * head_dim;
    if (bits == 32) {
        std::memcpy(k, code, static_cast<size_t>(w) * sizeof(float));
        return;
    }
    // (the channel scales are applied by the callers: scoring folds them into the query)
    for (int64_t h = 0; h < n_kv_head; ++h) {
        const float s = from_half(scale[h]);
        float *dst = k + h * head_dim;
        if (bits == 8) {
            const int8_t *c = reinterpret_cast<const int8_t *>(code) + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) {
                dst[d] = s * static_cast<float>(c[d]);
            }
        } else {
            const uint8_t *c = code + h * head_dim / 2;
            for (int64_t d = 0; d < head_dim; d += 2) {
                const uint8_t b = c[d / 2];
                dst[d] = s * static_cast<float>(static_cast<int>(b & 0x0f) - 8);
                dst[d + 1] = s * static_cast<float>(static_cast<int>(b >> 4) - 8);
            }
        }
    }
}

// Threads for a call: <= 0 asks for the hardware's; never more than there are tasks.
int64_t resolve_threads(int32_t n_threads, int64_t n_tasks) {
    int64_t t = n_threads > 0 ? n_threads : static_cast<int64_t>(std::thread::hardware_concurrency());
    t = std::min<int64_t>(std::max<int64_t>(t, 1), 64);
    return std::max<int64_t>(1, std::min(t, n_tasks));
}

// Run fn(task, worker) for task in [0, n_tasks) on n_workers threads (the caller's is worker 0). Tasks are handed
// out by an atomic counter; fn must not throw (callers catch inside and report through a flag).
template <typename Fn>
void parallel_tasks(int64_t n_tasks, int64_t n_workers, const Fn &fn) {
    std::atomic<int64_t> next{0};
    auto work = [&](int64_t worker) {
        for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
            fn(t, worker);
        }
    };
    if (n_workers <= 1) {
        work(0);
        return;
    }
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(n_workers - 1));
    try {
        for (int64_t w = 1; w < n_workers; ++w) {
            pool.emplace_back(work, w);
        }
    } catch (...) {
        // no thread could start: the ones that did and this one finish the tasks
    }
    work(0);
    for (auto &t : pool) {
        t.join();
    }
}

// Round half to even for |v| < 2^22 (the codes are within +-128): the 1.5 * 2^23 trick, as np.rint does, with no
// libm call so that the loop vectorises.
inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

// One row of one layer: k (F32, w = n_kv_head * head_dim) -> code, scales. tmp: w floats of scratch.
CERTCHAT_HOT void quantize_row(int64_t n_kv_head, int64_t head_dim, int32_t bits, const float *channel_scale,
                               const float *k, float *tmp, uint8_t *code, uint16_t *scales) {
    const int64_t w = n_kv_head * head_dim;
    const float *x = k;
    if (channel_scale && bits < 32) {
        // quantise k / c: the channel scales take the outlier channels of RoPE'd keys out of the row scale
        for (int64_t j = 0; j < w; ++j) {
            tmp[j] = k[j] / channel_scale[j];
        }
        x = tmp;
    }
    int nan = 0;
    for (int64_t j = 0; j < w; ++j) {
        nan |= x[j] != x[j] ? 1 : 0;
    }
    if (bits == 32) {
        std::memcpy(code, x, static_cast<size_t>(w) * sizeof(float));
        for (int64_t h = 0; scales && h < n_kv_head; ++h) {
            scales[h] = to_half(1.0f);
        }
        return;
    }
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    for (int64_t h = 0; h < n_kv_head; ++h) {
        const float *xh = x + h * head_dim;
        uint8_t *ch = bits == 8 ? code + h * head_dim : code + h * head_dim / 2;
        if (nan) {
            scales[h] = to_half(std::numeric_limits<float>::quiet_NaN());
            std::memset(ch, bits == 8 ? 0 : 0x88, static_cast<size_t>(bits == 8 ? head_dim : head_dim / 2));
            continue;
        }
        // max |x| in eight independent lanes (exact in any order; no NaN here)
        float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t d = 0;
        for (; d + 8 <= head_dim; d += 8) {
            for (int u = 0; u < 8; ++u) {
                const float a = std::fabs(xh[d + u]);
                lane[u] = a > lane[u] ? a : lane[u];
            }
        }
        float amax = 0.0f;
        for (; d < head_dim; ++d) {
            amax = std::fmax(amax, std::fabs(xh[d]));
        }
        for (float a : lane) {
            amax = std::fmax(amax, a);
        }
        // the codes are computed against the stored (half) scale, so dequantisation is what scoring sees
        scales[h] = to_half(amax / qmax);
        const float s = from_half(scales[h]);
        const float inv = s > 0.0f ? 1.0f / s : 0.0f;
        if (bits == 8) {
            int8_t *c8 = reinterpret_cast<int8_t *>(ch);
            for (int64_t j = 0; j < head_dim; ++j) {
                float v = round_even(xh[j] * inv);
                v = v > -qmax ? v : -qmax;  // (a NaN takes -qmax, as fmax would give it)
                v = v < qmax ? v : qmax;
                c8[j] = static_cast<int8_t>(static_cast<int>(v));
            }
        } else {
            for (int64_t j = 0; j + 1 < head_dim; j += 2) {
                float v0 = round_even(xh[j] * inv);
                float v1 = round_even(xh[j + 1] * inv);
                v0 = v0 > -qmax ? v0 : -qmax;
                v0 = v0 < qmax ? v0 : qmax;
                v1 = v1 > -qmax ? v1 : -qmax;
                v1 = v1 < qmax ? v1 : qmax;
                const int lo = static_cast<int>(v0) + 8;
                const int hi = static_cast<int>(v1) + 8;
                ch[j / 2] = static_cast<uint8_t>(lo | (hi << 4));
            }
        }
    }
}

// Keys per scoring tile: a tile's transposed keys [head_dim][TILE], its logits [vectors][TILE] and the query
// block stay in L1/L2 while the products, the exps and the sums run over them.
constexpr int64_t TILE = 64;
// Tokens per task: eight tiles (a 4k history at one layer is ~8 tasks, enough to balance two to eight threads).
constexpr int64_t CHUNK = 8 * TILE;

// lg [n_vec][TILE] = Q [n_vec][d] . Kt [d][TILE], n_vec a multiple of 4: plain loops (the compiler vectorises along
// the keys; used where AVX2/FMA is missing).
void logits_tile_generic(const float *qm, int64_t n_vec, int64_t d, const float *kt, float *lg) {
    for (int64_t v = 0; v < n_vec; ++v) {
        float *o = lg + v * TILE;
        std::fill(o, o + TILE, 0.0f);
        for (int64_t c = 0; c < d; ++c) {
            const float qv = qm[v * d + c];
            const float *kc = kt + c * TILE;
            for (int64_t t = 0; t < TILE; ++t) {
                o[t] += qv * kc[t];
            }
        }
    }
}

#ifdef CERTCHAT_X86
// The same with AVX2 FMAs: blocks of 4 query vectors x 16 keys held in 8 registers over the head dimension.
__attribute__((target("avx2,fma"))) void logits_tile_avx2(const float *qm, int64_t n_vec, int64_t d, const float *kt,
                                                          float *lg) {
    for (int64_t v = 0; v < n_vec; v += 4) {
        const float *q0 = qm + v * d;
        const float *q1 = q0 + d;
        const float *q2 = q1 + d;
        const float *q3 = q2 + d;
        for (int64_t t = 0; t < TILE; t += 16) {
            __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps();
            __m256 a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
            __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps();
            __m256 a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; ++c) {
                const float *kc = kt + c * TILE + t;
                const __m256 k0 = _mm256_loadu_ps(kc);
                const __m256 k1 = _mm256_loadu_ps(kc + 8);
                __m256 b = _mm256_broadcast_ss(q0 + c);
                a00 = _mm256_fmadd_ps(b, k0, a00);
                a01 = _mm256_fmadd_ps(b, k1, a01);
                b = _mm256_broadcast_ss(q1 + c);
                a10 = _mm256_fmadd_ps(b, k0, a10);
                a11 = _mm256_fmadd_ps(b, k1, a11);
                b = _mm256_broadcast_ss(q2 + c);
                a20 = _mm256_fmadd_ps(b, k0, a20);
                a21 = _mm256_fmadd_ps(b, k1, a21);
                b = _mm256_broadcast_ss(q3 + c);
                a30 = _mm256_fmadd_ps(b, k0, a30);
                a31 = _mm256_fmadd_ps(b, k1, a31);
            }
            float *o = lg + v * TILE + t;
            _mm256_storeu_ps(o, a00);
            _mm256_storeu_ps(o + 8, a01);
            _mm256_storeu_ps(o + TILE, a10);
            _mm256_storeu_ps(o + TILE + 8, a11);
            _mm256_storeu_ps(o + 2 * TILE, a20);
            _mm256_storeu_ps(o + 2 * TILE + 8, a21);
            _mm256_storeu_ps(o + 3 * TILE, a30);
            _mm256_storeu_ps(o + 3 * TILE + 8, a31);
        }
    }
}
#endif

using LogitsFn = void (*)(const float *, int64_t, int64_t, const float *, float *);

LogitsFn pick_logits() {
#ifdef CERTCHAT_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return logits_tile_avx2;
    }
#endif
    return logits_tile_generic;
}

// e[i] = exp(e[i] - l) for present tokens, else 0: 2^(y) with y = x log2(e) split into an integer and a
// fraction in [-1/2, 1/2], a degree-6 polynomial for 2^f (relative error ~2e-7) and the exponent set by bits;
// branch-free so that it vectorises (std::exp does not), 0 below e^-87
CERTCHAT_HOT void sketch_exp(int64_t n, float *e, float l, const uint8_t *present) {
    for (int64_t i = 0; i < n; ++i) {
        float x = e[i] - l;
        const bool keep = present[i] != 0 && x > -87.0f;
        x = x > 88.0f ? 88.0f : x;
        x = x < -87.0f ? -87.0f : x;
        const float y = x * 1.44269504088896341f;
        const float fl = round_even(y);
        const float f = (y - fl) * 0.693147180559945309f;  // 2^(y - fl) = e^f, |f| <= 0.347
        float p = 1.0f / 720.0f;
        p = p * f + 1.0f / 120.0f;
        p = p * f + 1.0f / 24.0f;
        p = p * f + 1.0f / 6.0f;
        p = p * f + 0.5f;
        p = p * f + 1.0f;
        p = p * f + 1.0f;
        int32_t bits;
        std::memcpy(&bits, &p, 4);
        bits += static_cast<int32_t>(fl) * (1 << 23);
        float r;
        std::memcpy(&r, &bits, 4);
        e[i] = keep ? r : 0.0f;
    }
}

CERTCHAT_HOT void add_scaled(int64_t n, float *o, const float *e, float s) {
    for (int64_t i = 0; i < n; ++i) {
        o[i] += e[i] * s;
    }
}

// One multi-layer scoring call, prepared: the query vectors with data grouped by KV head, the kq and channel
// scales folded in, padded with zero vectors to a multiple of 4.
struct Scoring {
    int64_t n_layers = 0, n = 0, n_kv_head = 1, head_dim = 1, stride = 0, n_rows = 0, n_head = 1;
    int32_t bits = 32;
    const float *channel_scale = nullptr;
    const uint8_t *codes = nullptr;
    const uint16_t *scales = nullptr;
    float *out = nullptr;
    int64_t n_gqa = 1, rb = 0, w = 0, n_pad = 0;  // n_pad: vectors per (layer, KV head), a multiple of 4
    std::vector<float> qc;        // [L][n_kv][n_pad][d]
    std::vector<float> vlse;      // [L][n_kv][n_pad]
    std::vector<int32_t> vhead;   // [L][n_kv][n_pad] the query head of each vector
    std::vector<int32_t> n_vec;   // [L][n_kv] vectors with data
    std::vector<float> vscale;    // [L][n_kv][n_pad] 1, or 1 / (1 + sum_i e) when renormalising
    std::vector<float> head_inv;  // [L][n_head] 1 / rows with data (1 when at most one)
    LogitsFn logits = logits_tile_generic;

    int64_t tasks_per_layer() const { return (n + CHUNK - 1) / CHUNK; }

    // Tokens [i0, i1) of layer l. z (n_kv * n_pad doubles, zeroed by the caller): add sum_i e per vector;
    // else add the weights to out and scale by the heads' row counts.
    void run(int64_t l, int64_t i0, int64_t i1, double *z, std::vector<float> &kt, std::vector<float> &lg,
             std::vector<uint8_t> &present) const {
        const int64_t d = head_dim;
        if (!z) {
            for (int64_t h = 0; h < n_head; ++h) {
                std::fill(out + (l * n_head + h) * n + i0, out + (l * n_head + h) * n + i1, 0.0f);
            }
        }
        for (int64_t t0 = i0; t0 < i1; t0 += TILE) {
            const int64_t m = std::min<int64_t>(TILE, i1 - t0);
            // present: absent rows were stored with NaN scales (F32: a NaN in the row); a row scores 0 unless
            // every head's scale is finite
            for (int64_t t = 0; t < TILE; ++t) {
                bool ok = t < m;
                const int64_t row = l * stride + t0 + t;
                if (ok && bits < 32) {
                    for (int64_t h = 0; h < n_kv_head; ++h) {
                        ok = ok && std::isfinite(from_half(scales[row * n_kv_head + h]));
                    }
                } else if (ok) {
                    const float *r = reinterpret_cast<const float *>(codes + row * rb);
                    for (int64_t j = 0; j < w; ++j) {
                        ok = ok && !std::isnan(r[j]);
                    }
                }
                present[static_cast<size_t>(t)] = ok ? 1 : 0;
            }
            for (int64_t hk = 0; hk < n_kv_head; ++hk) {
                const int64_t nv = n_vec[static_cast<size_t>(l * n_kv_head + hk)];
                if (nv == 0) {
                    continue;
                }
                // this KV head's keys of the tile, transposed to [d][TILE], absent rows and padding as zeros
                std::fill(kt.begin(), kt.end(), 0.0f);
                for (int64_t t = 0; t < m; ++t) {
                    if (!present[static_cast<size_t>(t)]) {
                        continue;
                    }
                    const int64_t row = l * stride + t0 + t;
                    const uint8_t *code = codes + row * rb;
                    float *col = kt.data() + t;
                    if (bits == 32) {
                        const float *r = reinterpret_cast<const float *>(code) + hk * d;
                        for (int64_t c = 0; c < d; ++c) {
                            col[c * TILE] = r[c];
                        }
                    } else if (bits == 8) {
                        const float s = from_half(scales[row * n_kv_head + hk]);
                        const int8_t *c8 = reinterpret_cast<const int8_t *>(code) + hk * d;
                        for (int64_t c = 0; c < d; ++c) {
                            col[c * TILE] = s * static_cast<float>(c8[c]);
                        }
                    } else {
                        const float s = from_half(scales[row * n_kv_head + hk]);
                        const uint8_t *c4 = code + hk * d / 2;
                        for (int64_t c = 0; c < d; c += 2) {
                            const uint8_t b = c4[c / 2];
                            col[c * TILE] = s * static_cast<float>(static_cast<int>(b & 0x0f) - 8);
                            col[(c + 1) * TILE] = s * static_cast<float>(static_cast<int>(b >> 4) - 8);
                        }
                    }
                }
                const size_t base = static_cast<size_t>((l * n_kv_head + hk) * n_pad);
                const int64_t nv4 = (nv + 3) / 4 * 4;
                logits(qc.data() + base * static_cast<size_t>(d), nv4, d, kt.data(), lg.data());
                for (int64_t v = 0; v < nv; ++v) {
                    float *e = lg.data() + v * TILE;
                    sketch_exp(m, e, vlse[base + static_cast<size_t>(v)], present.data());
                    if (z) {
                        double sum = 0.0;
                        for (int64_t t = 0; t < m; ++t) {
                            sum += e[t];
                        }
                        z[hk * n_pad + v] += sum;
                    } else {
                        const int64_t h = vhead[base + static_cast<size_t>(v)];
                        add_scaled(m, out + (l * n_head + h) * n + t0, e, vscale[base + static_cast<size_t>(v)]);
                    }
                }
            }
        }
        for (int64_t h = 0; !z && h < n_head; ++h) {
            const float inv = head_inv[static_cast<size_t>(l * n_head + h)];
            float *o = out + (l * n_head + h) * n;
            for (int64_t i = i0; inv != 1.0f && i < i1; ++i) {
                o[i] *= inv;
            }
        }
    }
};

int check_channel(const float *channel_scale, int64_t count, const char *who) {
    for (int64_t j = 0; channel_scale && j < count; ++j) {
        if (!(channel_scale[j] > 0.0f) || !std::isfinite(channel_scale[j])) {
            return certchat::fail(CERTCHAT_ERR_INVALID, "%s: channel_scale[%lld] = %g, need finite > 0", who,
                                  static_cast<long long>(j), static_cast<double>(channel_scale[j]));
        }
    }
    return CERTCHAT_OK;
}

}  // namespace

extern "C" {

CERTCHAT_API int certchat_sketch_channel_scales(int64_t n_layers, int64_t n, int64_t width, const float *k,
                                                float *out) {
    certchat::clear_error();
    if (n_layers < 0 || n < 0 || width < 1 || (n_layers > 0 && (!k || !out))) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_channel_scales: n_layers = %lld, n = %lld, width = %lld: "
                              "need sizes >= 0, width > 0 and non-NULL arrays", static_cast<long long>(n_layers),
                              static_cast<long long>(n), static_cast<long long>(width));
    }
    for (int64_t l = 0; l < n_layers; ++l) {
        float *c = out + l * width;
        std::fill(c, c + width, 0.0f);
        for (int64_t i = 0; i < n; ++i) {
            const float *row = k + (l * n + i) * width;
            for (int64_t j = 0; j < width; ++j) {
                const float a = std::fabs(row[j]);
                c[j] = a > c[j] ? a : c[j];  // a NaN never wins
            }
        }
        for (int64_t j = 0; j < width; ++j) {
            c[j] = std::isfinite(c[j]) && c[j] > 0.0f ? c[j] : 1.0f;
        }
    }
    return CERTCHAT_OK;
}

CERTCHAT_API int certchat_sketch_quantize_layers(int64_t n_layers, int64_t n, int64_t n_kv_head, int64_t head_dim,
                                                 int32_t bits, const float *channel_scale, const float *k,
                                                 uint8_t *codes, uint16_t *scales, int64_t stride,
                                                 int32_t n_threads) {
    certchat::clear_error();
    int rc = check_shape(n, n_kv_head, head_dim, bits);
    if (rc != CERTCHAT_OK) {
        return rc;
    }
    if (n_layers < 0 || stride < n) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_quantize: n_layers = %lld, stride = %lld: need n_layers "
                              ">= 0 and stride >= n = %lld", static_cast<long long>(n_layers),
                              static_cast<long long>(stride), static_cast<long long>(n));
    }
    if (n == 0 || n_layers == 0) {
        return CERTCHAT_OK;
    }
    if (!k || !codes || (bits < 32 && !scales)) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_quantize: k, codes and (bits < 32) scales must not be NULL");
    }
    const int64_t w = n_kv_head * head_dim;
    rc = check_channel(bits < 32 ? channel_scale : nullptr, n_layers * w, "sketch_quantize");
    if (rc != CERTCHAT_OK) {
        return rc;
    }
    const int64_t rb = row_bytes(n_kv_head, head_dim, bits);
    constexpr int64_t ROWS = 256;
    const int64_t per_layer = (n + ROWS - 1) / ROWS;
    const int64_t n_tasks = n_layers * per_layer;
    // a steady round (a turn's worth of tokens) is quicker on one thread than the start of a second
    const int64_t workers = resolve_threads(n_threads, std::max<int64_t>(1, n_layers * n * w / 65536));
    std::vector<std::vector<float>> tmp(static_cast<size_t>(workers), std::vector<float>(static_cast<size_t>(w)));
    parallel_tasks(n_tasks, workers, [&](int64_t task, int64_t worker) {
        const int64_t l = task / per_layer;
        const int64_t r0 = (task % per_layer) * ROWS;
        const int64_t r1 = std::min(n, r0 + ROWS);
        const float *c = channel_scale ? channel_scale + l * w : nullptr;
        for (int64_t i = r0; i < r1; ++i) {
            quantize_row(n_kv_head, head_dim, bits, c, k + (l * n + i) * w, tmp[static_cast<size_t>(worker)].data(),
                         codes + (l * stride + i) * rb, scales ? scales + (l * stride + i) * n_kv_head : nullptr);
        }
    });
    return CERTCHAT_OK;
}

CERTCHAT_API int certchat_sketch_quantize(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                          const float *channel_scale, const float *k, uint8_t *codes,
                                          uint16_t *scales) {
    return certchat_sketch_quantize_layers(1, n, n_kv_head, head_dim, bits, channel_scale, k, codes, scales, n, 1);
}

CERTCHAT_API int certchat_sketch_dequantize(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                            const float *channel_scale, const uint8_t *codes,
                                            const uint16_t *scales, float *k) {
    certchat::clear_error();
    const int rc = check_shape(n, n_kv_head, head_dim, bits);
    if (rc != CERTCHAT_OK || n == 0) {
        return rc;
    }
    if (!k || !codes || (bits < 32 && !scales)) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_dequantize: k, codes and (bits < 32) scales must not be NULL");
    }
    const int64_t rb = row_bytes(n_kv_head, head_dim, bits);
    for (int64_t i = 0; i < n; ++i) {
        float *row = k + i * n_kv_head * head_dim;
        dequantize_row(n_kv_head, head_dim, bits, codes + i * rb, bits < 32 ? scales + i * n_kv_head : nullptr, row);
        for (int64_t j = 0; channel_scale && bits < 32 && j < n_kv_head * head_dim; ++j) {
            row[j] *= channel_scale[j];
        }
    }
    return CERTCHAT_OK;
}

CERTCHAT_API int certchat_sketch_score_layers(int64_t n_layers, int64_t n, int64_t n_kv_head, int64_t head_dim,
                                              int32_t bits, const float *channel_scale, const uint8_t *codes,
                                              const uint16_t *scales, int64_t stride, int64_t n_rows,
                                              int64_t n_head, const float *q, const float *lse,
                                              const float *kq_scale, int32_t renormalise, int32_t n_threads,
                                              float *out) {
    certchat::clear_error();
    int rc = check_shape(n, n_kv_head, head_dim, bits);
    if (rc != CERTCHAT_OK) {
        return rc;
    }
    if (n_layers < 0 || stride < n || n_rows < 0 || n_head < n_kv_head || n_head % n_kv_head != 0) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_score: n_layers = %lld, stride = %lld, n_rows = %lld, "
                              "n_head = %lld: need n_layers >= 0, stride >= n, n_rows >= 0 and n_head a multiple "
                              "of n_kv_head = %lld", static_cast<long long>(n_layers), static_cast<long long>(stride),
                              static_cast<long long>(n_rows), static_cast<long long>(n_head),
                              static_cast<long long>(n_kv_head));
    }
    for (int64_t l = 0; kq_scale && l < n_layers; ++l) {
        if (!std::isfinite(kq_scale[l])) {
            return certchat::fail(CERTCHAT_ERR_NONFINITE, "sketch_score: kq_scale is not finite");
        }
    }
    if (n == 0 || n_layers == 0) {
        return CERTCHAT_OK;
    }
    if (!out || !codes || !kq_scale || (bits < 32 && !scales) || (n_rows > 0 && (!q || !lse))) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_score: a required pointer is NULL");
    }
    Scoring sc;
    sc.n_layers = n_layers;
    sc.n = n;
    sc.n_kv_head = n_kv_head;
    sc.head_dim = head_dim;
    sc.stride = stride;
    sc.n_rows = n_rows;
    sc.n_head = n_head;
    sc.bits = bits;
    sc.channel_scale = bits < 32 ? channel_scale : nullptr;
    sc.codes = codes;
    sc.scales = scales;
    sc.out = out;
    const int64_t d = head_dim;
    sc.n_gqa = n_head / n_kv_head;
    sc.rb = row_bytes(n_kv_head, head_dim, bits);
    sc.w = n_kv_head * head_dim;
    sc.n_pad = (sc.n_gqa * n_rows + 3) / 4 * 4;
    sc.logits = pick_logits();
    const size_t n_vec_all = static_cast<size_t>(n_layers * n_kv_head * sc.n_pad);
    sc.qc.assign(n_vec_all * static_cast<size_t>(d), 0.0f);
    sc.vlse.assign(n_vec_all, 0.0f);
    sc.vhead.assign(n_vec_all, 0);
    sc.vscale.assign(n_vec_all, 1.0f);
    sc.n_vec.assign(static_cast<size_t>(n_layers * n_kv_head), 0);
    sc.head_inv.assign(static_cast<size_t>(n_layers * n_head), 1.0f);
    // the vectors with data: a NaN lse or query (a layer without data) is skipped; per KV head in (head, row)
    // order, so each output sums its rows in row order
    for (int64_t l = 0; l < n_layers; ++l) {
        for (int64_t h = 0; h < n_head; ++h) {
            const int64_t hk = h / sc.n_gqa;
            const size_t slot = static_cast<size_t>(l * n_kv_head + hk);
            const float *c_h = sc.channel_scale ? sc.channel_scale + l * sc.w + hk * d : nullptr;
            int64_t valid = 0;
            for (int64_t r = 0; r < n_rows; ++r) {
                const float *qr = q + ((l * n_rows + r) * n_head + h) * d;
                const float lr = lse[(l * n_rows + r) * n_head + h];
                bool ok = std::isfinite(lr);
                for (int64_t c = 0; c < d && ok; ++c) {
                    ok = std::isfinite(qr[c]);
                }
                if (!ok) {
                    continue;
                }
                ++valid;
                const size_t v = slot * static_cast<size_t>(sc.n_pad) + static_cast<size_t>(sc.n_vec[slot]++);
                // q . (c * k_code) = (q * c) . k_code: the channel scales fold into the query, and so does kq_scale
                float *dst = sc.qc.data() + v * static_cast<size_t>(d);
                for (int64_t c = 0; c < d; ++c) {
                    dst[c] = kq_scale[l] * (c_h ? qr[c] * c_h[c] : qr[c]);
                }
                sc.vlse[v] = lr;
                sc.vhead[v] = static_cast<int32_t>(h);
            }
            if (valid > 1) {
                sc.head_inv[static_cast<size_t>(l * n_head + h)] = 1.0f / static_cast<float>(valid);
            }
        }
    }
    const int64_t per_layer = sc.tasks_per_layer();
    const int64_t n_tasks = n_layers * per_layer;
    const int64_t workers = resolve_threads(n_threads, n_tasks);
    auto scratch = [&]() {
        return std::make_tuple(std::vector<float>(static_cast<size_t>(d * TILE)),
                               std::vector<float>(static_cast<size_t>(sc.n_pad * TILE)),
                               std::vector<uint8_t>(static_cast<size_t>(TILE)));
    };
    std::vector<decltype(scratch())> work;
    try {
        for (int64_t t = 0; t < workers; ++t) {
            work.push_back(scratch());
        }
    } catch (const std::bad_alloc &) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_score: out of memory");
    }
    if (renormalise) {
        // a softmax over the kept cells and these rows: first 1 + sum_i e per vector, summed over the tasks
        // in token order so that the total does not depend on the threads
        const size_t per_task = static_cast<size_t>(n_kv_head * sc.n_pad);
        std::vector<double> zpart(static_cast<size_t>(n_tasks) * per_task, 0.0);
        parallel_tasks(n_tasks, workers, [&](int64_t task, int64_t worker) {
            auto &[kt, lg, present] = work[static_cast<size_t>(worker)];
            const int64_t l = task / per_layer;
            const int64_t i0 = (task % per_layer) * CHUNK;
            sc.run(l, i0, std::min(n, i0 + CHUNK), zpart.data() + static_cast<size_t>(task) * per_task, kt, lg,
                   present);
        });
        for (int64_t l = 0; l < n_layers; ++l) {
            for (size_t v = 0; v < per_task; ++v) {
                double z = 1.0;
                for (int64_t c = 0; c < per_layer; ++c) {
                    z += zpart[static_cast<size_t>(l * per_layer + c) * per_task + v];
                }
                sc.vscale[static_cast<size_t>(l) * per_task + v] = static_cast<float>(1.0 / z);
            }
        }
    }
    parallel_tasks(n_tasks, workers, [&](int64_t task, int64_t worker) {
        auto &[kt, lg, present] = work[static_cast<size_t>(worker)];
        const int64_t l = task / per_layer;
        const int64_t i0 = (task % per_layer) * CHUNK;
        sc.run(l, i0, std::min(n, i0 + CHUNK), nullptr, kt, lg, present);
    });
    return CERTCHAT_OK;
}

CERTCHAT_API int certchat_sketch_score(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                       const float *channel_scale, const uint8_t *codes,
                                       const uint16_t *scales, int64_t n_rows,
                                       int64_t n_head, const float *q, const float *lse, float kq_scale,
                                       int32_t renormalise, float *out) {
    return certchat_sketch_score_layers(1, n, n_kv_head, head_dim, bits, channel_scale, codes, scales, n, n_rows,
                                        n_head, q, lse, &kq_scale, renormalise, 1, out);
}

}  // extern "C"
