// The evicted-key sketch: quantised K rows of evicted tokens, scored against the question's query rows
// on the scale of the kept cells' softmax (docs/POISSON.md, "Phase 1"). Stateless: the caller owns the
// storage (native/sketch.py keeps it per conversation).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "certchat_core.h"
#include "status.hpp"

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

// x86: an AVX2 clone of the two hot loops, picked at load time (the library itself targets baseline x86-64)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CERTCHAT_HOT __attribute__((target_clones("avx2", "default")))
#else
#define CERTCHAT_HOT
#endif

// out [n_q][n] = Q [n_q][d] . Kt [d][n]: blocks of 4 queries over chunks of 256 keys, so a chunk of Kt is read
// from cache once per 4 queries and the products run along the keys (vectorised without reassociation)
CERTCHAT_HOT void sketch_logits(int64_t n, int64_t d, int64_t n_q, const float *qm, const float *kt, float *out) {
    constexpr int64_t CH = 256;
    float acc[4][CH];
    for (int64_t i0 = 0; i0 < n; i0 += CH) {
        const int64_t m = std::min<int64_t>(CH, n - i0);
        for (int64_t b = 0; b < n_q; b += 4) {
            const int64_t nb = std::min<int64_t>(4, n_q - b);
            for (int64_t j = 0; j < 4; ++j) {
                std::fill(acc[j], acc[j] + CH, 0.0f);
            }
            for (int64_t c = 0; c < d; ++c) {
                const float *kc = kt + c * n + i0;
                const float q0 = qm[(b + 0) * d + c];
                const float q1 = nb > 1 ? qm[(b + 1) * d + c] : 0.0f;
                const float q2 = nb > 2 ? qm[(b + 2) * d + c] : 0.0f;
                const float q3 = nb > 3 ? qm[(b + 3) * d + c] : 0.0f;
                for (int64_t i = 0; i < m; ++i) {
                    const float k = kc[i];
                    acc[0][i] += q0 * k;
                    acc[1][i] += q1 * k;
                    acc[2][i] += q2 * k;
                    acc[3][i] += q3 * k;
                }
            }
            for (int64_t j = 0; j < nb; ++j) {
                std::copy(acc[j], acc[j] + m, out + (b + j) * n + i0);
            }
        }
    }
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
        // round to nearest even by the 1.5 * 2^23 trick (|y| < 2^22): no libm call, so the loop vectorises
        const float fl = (y + 12582912.0f) - 12582912.0f;
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

}  // namespace

extern "C" {

CERTCHAT_API int certchat_sketch_quantize(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                          const float *channel_scale, const float *k, uint8_t *codes,
                                          uint16_t *scales) {
    certchat::clear_error();
    const int rc = check_shape(n, n_kv_head, head_dim, bits);
    if (rc != CERTCHAT_OK || n == 0) {
        return rc;
    }
    if (!k || !codes || (bits < 32 && !scales)) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_quantize: k, codes and (bits < 32) scales must not be NULL");
    }
    const int64_t w = n_kv_head * head_dim;
    const int64_t rb = row_bytes(n_kv_head, head_dim, bits);
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    int crc = CERTCHAT_OK;
    for (int64_t j = 0; channel_scale && j < w && crc == CERTCHAT_OK; ++j) {
        if (!(channel_scale[j] > 0.0f) || !std::isfinite(channel_scale[j])) {
            crc = certchat::fail(CERTCHAT_ERR_INVALID, "sketch_quantize: channel_scale[%lld] = %g, need finite > 0",
                                 static_cast<long long>(j), static_cast<double>(channel_scale[j]));
        }
    }
    if (crc != CERTCHAT_OK) {
        return crc;
    }
    std::vector<float> xn(static_cast<size_t>(w));
    for (int64_t i = 0; i < n; ++i) {
        const float *x = k + i * w;
        if (channel_scale && bits < 32) {
            // quantise k / c: the channel scales take the outlier channels of RoPE'd keys out of the row scale
            for (int64_t j = 0; j < w; ++j) {
                xn[static_cast<size_t>(j)] = x[j] / channel_scale[j];
            }
            x = xn.data();
        }
        uint8_t *code = codes + i * rb;
        bool absent = false;
        for (int64_t j = 0; j < w; ++j) {
            absent = absent || std::isnan(x[j]);
        }
        if (bits == 32) {
            std::memcpy(code, x, static_cast<size_t>(w) * sizeof(float));
            if (scales) {
                for (int64_t h = 0; h < n_kv_head; ++h) {
                    scales[i * n_kv_head + h] = to_half(1.0f);
                }
            }
            continue;
        }
        for (int64_t h = 0; h < n_kv_head; ++h) {
            const float *xh = x + h * head_dim;
            uint16_t &sh = scales[i * n_kv_head + h];
            if (absent) {
                sh = to_half(std::numeric_limits<float>::quiet_NaN());
                std::memset(bits == 8 ? code + h * head_dim : code + h * head_dim / 2, bits == 8 ? 0 : 0x88,
                            static_cast<size_t>(bits == 8 ? head_dim : head_dim / 2));
                continue;
            }
            float amax = 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
                amax = std::fmax(amax, std::fabs(xh[d]));
            }
            // the codes are computed against the stored (half) scale, so dequantisation is what scoring sees
            sh = to_half(amax / qmax);
            const float s = from_half(sh);
            const float inv = s > 0.0f ? 1.0f / s : 0.0f;
            for (int64_t d = 0; d < head_dim; ++d) {
                float v = std::nearbyint(xh[d] * inv);
                v = std::fmin(std::fmax(v, -qmax), qmax);
                const int c = static_cast<int>(v);
                if (bits == 8) {
                    reinterpret_cast<int8_t *>(code)[h * head_dim + d] = static_cast<int8_t>(c);
                } else {
                    uint8_t &b = code[(h * head_dim + d) / 2];
                    const uint8_t nib = static_cast<uint8_t>(c + 8);
                    b = (d % 2 == 0) ? static_cast<uint8_t>((b & 0xf0) | nib) : static_cast<uint8_t>((b & 0x0f) | (nib << 4));
                }
            }
        }
    }
    return CERTCHAT_OK;
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

CERTCHAT_API int certchat_sketch_score(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                       const float *channel_scale, const uint8_t *codes,
                                       const uint16_t *scales, int64_t n_rows,
                                       int64_t n_head, const float *q, const float *lse, float kq_scale,
                                       int32_t renormalise, float *out) {
    certchat::clear_error();
    int rc = check_shape(n, n_kv_head, head_dim, bits);
    if (rc != CERTCHAT_OK) {
        return rc;
    }
    if (n_rows < 0 || n_head < n_kv_head || n_head % n_kv_head != 0) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_score: n_rows = %lld, n_head = %lld: need n_rows >= 0 and "
                              "n_head a multiple of n_kv_head = %lld", static_cast<long long>(n_rows),
                              static_cast<long long>(n_head), static_cast<long long>(n_kv_head));
    }
    if (!std::isfinite(kq_scale)) {
        return certchat::fail(CERTCHAT_ERR_NONFINITE, "sketch_score: kq_scale is not finite");
    }
    if (n == 0) {
        return CERTCHAT_OK;
    }
    if (!out || !codes || (bits < 32 && !scales) || (n_rows > 0 && (!q || !lse))) {
        return certchat::fail(CERTCHAT_ERR_INVALID, "sketch_score: a required pointer is NULL");
    }
    const int64_t n_gqa = n_head / n_kv_head;
    const int64_t rb = row_bytes(n_kv_head, head_dim, bits);
    const int64_t w = n_kv_head * head_dim;

    std::memset(out, 0, static_cast<size_t>(n_head * n) * sizeof(float));

    // rows with data: a NaN lse or query (a layer without data) is skipped
    std::vector<uint8_t> valid(static_cast<size_t>(n_rows * n_head), 0);
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t h = 0; h < n_head; ++h) {
            bool ok = std::isfinite(lse[r * n_head + h]);
            const float *qr = q + (r * n_head + h) * head_dim;
            for (int64_t d = 0; d < head_dim && ok; ++d) {
                ok = std::isfinite(qr[d]);
            }
            valid[static_cast<size_t>(r * n_head + h)] = ok ? 1 : 0;
        }
    }

    // keys transposed per KV head, [head_dim][n]: the dot products then run along the keys (no float reduction
    // to reorder, so the compiler vectorises them under -fno-fast-math), absent rows as zeros with a mask
    std::vector<float> kt(static_cast<size_t>(w * n));
    std::vector<uint8_t> present(static_cast<size_t>(n));
    {
        std::vector<float> row(static_cast<size_t>(w));
        for (int64_t i = 0; i < n; ++i) {
            dequantize_row(n_kv_head, head_dim, bits, codes + i * rb, bits < 32 ? scales + i * n_kv_head : nullptr,
                           row.data());
            bool ok = true;
            for (int64_t j = 0; j < w; ++j) {
                ok = ok && !std::isnan(row[static_cast<size_t>(j)]);
            }
            present[static_cast<size_t>(i)] = ok ? 1 : 0;
            for (int64_t j = 0; j < w; ++j) {
                kt[static_cast<size_t>(j * n + i)] = ok ? row[static_cast<size_t>(j)] : 0.0f;
            }
        }
    }

    // logits of every (head, row) with data against every token: S [n_head][n_rows][n] (kernel below)
    std::vector<float> qc(static_cast<size_t>(n_head * n_rows * head_dim), 0.0f);
    for (int64_t h = 0; h < n_head; ++h) {
        const float *c_h = channel_scale && bits < 32 ? channel_scale + (h / n_gqa) * head_dim : nullptr;
        for (int64_t r = 0; r < n_rows; ++r) {
            // q . (c * k_code) = (q * c) . k_code: the channel scales fold into the query, and so does kq_scale
            const float *qr = q + (r * n_head + h) * head_dim;
            float *dst = qc.data() + (h * n_rows + r) * head_dim;
            for (int64_t d = 0; d < head_dim && valid[static_cast<size_t>(r * n_head + h)]; ++d) {
                dst[d] = kq_scale * (c_h ? qr[d] * c_h[d] : qr[d]);
            }
        }
    }
    std::vector<float> logits(static_cast<size_t>(n_head * n_rows * n));
    for (int64_t hk = 0; hk < n_kv_head; ++hk) {
        // the query heads of one KV head are adjacent: n_gqa * n_rows query vectors against one key matrix
        sketch_logits(n, head_dim, n_gqa * n_rows, qc.data() + hk * n_gqa * n_rows * head_dim,
                      kt.data() + hk * head_dim * n, logits.data() + hk * n_gqa * n_rows * n);
    }

    for (int64_t h = 0; h < n_head; ++h) {
        float *o = out + h * n;
        int64_t n_valid = 0;
        for (int64_t r = 0; r < n_rows; ++r) {
            if (!valid[static_cast<size_t>(r * n_head + h)]) {
                continue;
            }
            ++n_valid;
            float *e = logits.data() + (h * n_rows + r) * n;
            sketch_exp(n, e, lse[r * n_head + h], present.data());
            double z = 1.0;
            for (int64_t i = 0; renormalise && i < n; ++i) {
                z += e[i];
            }
            const float inv = renormalise ? static_cast<float>(1.0 / z) : 1.0f;
            for (int64_t i = 0; i < n; ++i) {
                o[i] += e[i] * inv;
            }
        }
        if (n_valid > 1) {
            const float inv = 1.0f / static_cast<float>(n_valid);
            for (int64_t i = 0; i < n; ++i) {
                o[i] *= inv;
            }
        }
    }
    rc = CERTCHAT_OK;
    return rc;
}

}  // extern "C"
