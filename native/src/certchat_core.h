/*
 * certchat design core: the plain C ABI of libcertchat_core.so (CPU) and
 * libcertchat_core_cuda.so (CUDA).
 *
 * It turns importance scores into a Poisson eviction design (inclusion
 * probabilities, counter-based draws, cumulative log-pi bookkeeping and the
 * logit bias every survivor carries) and per-step variance estimates into
 * error certificates. docs/POISSON.md explains the algorithms.
 *
 * Conventions
 *   - Every function returns a status (certchat_status); on a negative status
 *     certchat_core_last_error() holds a one-line message (per thread). A
 *     positive status is a warning: the outputs were written.
 *   - All buffers are allocated by the caller; n == 0 is valid everywhere and
 *     does nothing. Arrays are dense, C order.
 *   - Units: a token belongs to one sampling unit (unit_ids[i] in
 *     [0, n_units)); passing unit_ids == NULL makes every token its own unit.
 *     Everything about a unit is decided together: one inclusion probability,
 *     one draw keyed by the smallest position among its tokens.
 *   - Draws: u = uniform(Philox4x32-10, key = seed, counter = (position, round));
 *     a unit is kept iff u < pi. The CPU and the CUDA library draw bit-identical
 *     numbers.
 *
 * The CUDA library exports the same names with the same meaning for the
 * functions marked [cuda]; they take host pointers, copy to the device, run
 * there and copy back. Without a usable device they return
 * CERTCHAT_ERR_NO_DEVICE and never crash.
 */
#ifndef CERTCHAT_CORE_H
#define CERTCHAT_CORE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CERTCHAT_API __declspec(dllexport)
#else
#define CERTCHAT_API __attribute__((visibility("default")))
#endif

#define CERTCHAT_CORE_ABI_VERSION 1

typedef enum certchat_status {
    CERTCHAT_OK = 0,
    /* The budget cannot be met: protected units are kept, every other unit sits
       at pi_min (top slice empty) and the expected count exceeds the budget. */
    CERTCHAT_WARN_BUDGET_INFEASIBLE = 1,
    CERTCHAT_ERR_INVALID = -1,   /* a bad argument: null pointer, out-of-range value */
    CERTCHAT_ERR_NONFINITE = -2, /* NaN or infinity where a finite number is required */
    CERTCHAT_ERR_NO_DEVICE = -3, /* CUDA library: no usable device or driver */
    CERTCHAT_ERR_CUDA = -4,      /* CUDA library: a runtime call failed */
    CERTCHAT_ERR_ALLOC = -5,     /* out of memory */
    CERTCHAT_ERR_INTERNAL = -6   /* a numerical routine failed to converge */
} certchat_status;

typedef enum certchat_method {
    /* Poisson design: protected -> 1, a deterministic top slice of the rest, water-filled tail. */
    CERTCHAT_METHOD_POISSON = 0,
    /* Deterministic: protected plus the highest-scoring units that fit the budget. */
    CERTCHAT_METHOD_TOPK = 1,
    /* Deterministic: protected (sinks, ...) plus the most recent units that fit the budget. */
    CERTCHAT_METHOD_WINDOW = 2,
    /* Poisson design with equal probabilities for every unprotected unit (scores ignored). */
    CERTCHAT_METHOD_UNIFORM = 3
} certchat_method;

/* What decided a token's fate this round (kind_out arrays). */
typedef enum certchat_kind {
    CERTCHAT_KIND_SAMPLED = 0,   /* 0 < pi < 1: kept iff its draw says so */
    CERTCHAT_KIND_PROTECTED = 1, /* protected: pi = 1 */
    CERTCHAT_KIND_TOP = 2,       /* top slice (or kept by a deterministic method): pi = 1 */
    CERTCHAT_KIND_CERTAIN = 3,   /* water-filling reached pi = 1 */
    CERTCHAT_KIND_DROPPED = 4    /* deterministic methods only: evicted, pi = 0 */
} certchat_kind;

/* One eviction round's settings. Field order keeps the layout free of padding. */
typedef struct certchat_design {
    double budget;    /* expected number of tokens kept, protected ones included (>= 0) */
    double floor;     /* added to every token's score before units are formed (>= 0) */
    double pi_min;    /* lowest inclusion probability of an unprotected unit, in (0, 1] */
    double top_share; /* share of (budget - protected) kept deterministically by score, [0, 1) */
    uint64_t seed;    /* Philox key */
    uint64_t round;   /* eviction round: the high half of the Philox counter */
    int32_t method;   /* certchat_method */
    int32_t reserved; /* must be 0 */
} certchat_design;

/* Library version ("MAJOR.MINOR.PATCH+abiN[-cuda]"). */
CERTCHAT_API const char *certchat_core_version(void); /* [cuda] */

/* The last error message of the calling thread ("" if none). [cuda] */
CERTCHAT_API const char *certchat_core_last_error(void);

/* Philox4x32-10 block function (Random123's definition), for known-answer tests. */
CERTCHAT_API void certchat_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* The uniforms in [0, 1) that draw() compares against: one per position. [cuda] */
CERTCHAT_API int certchat_uniforms(int64_t n, const int64_t *positions, uint64_t seed, uint64_t round,
                                   double *u_out);

/* Token-level draws: keep_out[i] = uniforms(positions[i]) < pi[i]. pi in [0, 1]. [cuda] */
CERTCHAT_API int certchat_draw(int64_t n, const double *pi, const int64_t *positions, uint64_t seed,
                               uint64_t round, uint8_t *keep_out);

/*
 * Inclusion probabilities of one round, per token (all tokens of a unit share
 * their unit's value). design->method selects the design; seed/round are
 * unused; the window method orders units by token index (no positions here).
 * scores >= 0 and finite; protected_ may be NULL (nothing protected).
 * kind_out may be NULL. Returns CERTCHAT_WARN_BUDGET_INFEASIBLE when
 * budget < protected + pi_min * (other tokens). [cuda]
 */
CERTCHAT_API int certchat_inclusion_probabilities(int64_t n, const double *scores, const uint8_t *protected_,
                                                  const int32_t *unit_ids, int64_t n_units,
                                                  const certchat_design *design, double *pi_out,
                                                  uint8_t *kind_out);

/*
 * Streaming bookkeeping: cum_out[i] = prev_cum[i] + log(pi[i]) for kept tokens
 * (-inf for evicted ones); bias_out[i] = -cum_out[i] >= 0 for kept tokens, 0 for
 * evicted ones. prev_cum may be NULL (all zero); its values must be finite and
 * <= 0. [cuda]
 */
CERTCHAT_API int certchat_update_log_pi(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum,
                                        double *cum_out, float *bias_out);

/*
 * One eviction round, end to end: probabilities, draws (one per unit, keyed by
 * the unit's smallest position), cumulative log pi and the bias vector. Every
 * output has n entries; kind_out may be NULL. positions must be distinct per
 * unit key for the draws to be independent. [cuda]
 */
CERTCHAT_API int certchat_plan_eviction(int64_t n, const double *scores, const uint8_t *protected_,
                                        const int32_t *unit_ids, int64_t n_units, const int64_t *positions,
                                        const double *prev_cum, const certchat_design *design, uint8_t *keep_out,
                                        double *pi_out, uint8_t *kind_out, double *cum_out, float *bias_out);

/*
 * Largest expected budget B whose realized count fits `capacity` cells with
 * `z` standard deviations to spare: B + z * sqrt(sum_u size_u^2 pi_u (1 - pi_u))
 * <= capacity, for the design described by `design` (its budget field is
 * ignored). Returns CERTCHAT_WARN_BUDGET_INFEASIBLE (and the minimum feasible
 * budget) when not even that fits.
 */
CERTCHAT_API int certchat_size_budget(int64_t n, const double *scores, const uint8_t *protected_,
                                      const int32_t *unit_ids, int64_t n_units, const certchat_design *design,
                                      double capacity, double z, double *budget_out);

/*
 * The Hajek estimate and its variance for n_draws retained sets of one query:
 * logits[n] (scale * q.k), values[n*d], pi[n] (cumulative inclusion
 * probabilities, in (0, 1]), keep[n_draws*n]. Per draw r, with y_u the residual
 * sum sum_{i in u, S} p_i (v_i - o_hat) and t_u = (1 - pi_u) |y_u|^2:
 *   o_hat[r*d .. ]    = sum_S p_i v_i with p = softmax_S(logit - log pi)
 *   vhat_token[r]     = sum_S (1 - pi_i) p_i^2 |v_i - o_hat|^2
 *   vhat_cluster[r]   = sum_units t_u (the exact form for units; equal to the
 *                       token form for single-token units)
 *   dof[r]            = effective dimension of the error, (V^2 - D) / (|C|_F^2 - D)
 *                       clamped to [1, d] (1 where undefined), where
 *                       C = sum_u (1 - pi_u) y_u y_u^T and D = sum_u (1 - pi_u) t_u^2
 *   dof_var[r]        = degrees of freedom of V itself, 2 V^2 / D (+inf when D = 0)
 * (docs/POISSON.md). Tokens of one unit must share pi. Any output pointer may be
 * NULL; dof costs O(|S| d^2). A draw that keeps nothing is an error.
 */
CERTCHAT_API int certchat_hajek(int64_t n, int64_t d, int64_t n_draws, const double *logits, const double *values,
                                const double *pi, const uint8_t *keep, const int32_t *unit_ids, int64_t n_units,
                                double *o_hat_out, double *vhat_token_out, double *vhat_cluster_out,
                                double *dof_out, double *dof_var_out);

/*
 * Certificates at confidence 1 - delta: absolute = k * sqrt(max(v_hat, 0)),
 * relative = absolute / sqrt(o_norm2), with
 *   k = z_{1-delta}                               dof == NULL (DESIGN.md's form)
 *   k = sqrt(chi2_{h, 1-delta} / h)               dof given, dof_var == NULL
 *   k = sqrt(F_{h, m; 1-delta})                   both given (h = dof_i >= 1, m = dof_var_i > 0;
 *                                                 m = +inf falls back to the chi-square form)
 * relative is 0 when both are 0 and +inf when only o_norm2 is 0.
 */
CERTCHAT_API int certchat_certificate(int64_t n, const double *v_hat, const double *o_norm2, double delta,
                                      const double *dof, const double *dof_var, double *abs_out, double *rel_out);

/* Standard normal quantile Phi^{-1}(p), p in (0, 1); NaN outside. */
CERTCHAT_API double certchat_normal_quantile(double p);

/* Chi-square quantile with `dof` > 0 degrees of freedom, p in (0, 1); NaN outside. */
CERTCHAT_API double certchat_chi2_quantile(double p, double dof);

/* F quantile with (d1, d2) > 0 degrees of freedom, p in (0, 1); NaN outside. */
CERTCHAT_API double certchat_f_quantile(double p, double d1, double d2);

/* ---- Evicted-key sketch (CPU library only; docs/POISSON.md, "Phase 1") ----
 *
 * A row is one evicted token's K for one layer: n_kv_head heads of head_dim values.
 * bits = 8 or 4: symmetric per-(row, head) quantisation, scale = max|x| / qmax (qmax = 127 or 7),
 * stored as IEEE half (raw uint16 bits); codes are int8, or two 4-bit values per byte (value + 8,
 * low nibble first). bits = 32: the F32 row itself (scales unused). Row bytes:
 * n_kv_head * head_dim * bits / 8 (+ 2 * n_kv_head for the scales when bits < 32).
 * A row holding NaN (a position the cache did not have) is stored as absent: it scores 0.
 * channel_scale [n_kv_head * head_dim] (> 0, or NULL = ones; ignored for bits 32): the rows quantised are
 * k / channel_scale, so that the few large channels of RoPE'd keys do not set every row's step; the
 * same array must be passed to dequantize and score (which folds it into the query). */

/* k: [n][n_kv_head * head_dim] F32 -> codes [n][row bytes], scales [n][n_kv_head] (may be NULL for bits 32). */
CERTCHAT_API int certchat_sketch_quantize(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                          const float *channel_scale, const float *k, uint8_t *codes,
                                          uint16_t *scales);

/* The inverse (for tests and the numpy reference): codes -> k [n][n_kv_head * head_dim], NaN for absent rows. */
CERTCHAT_API int certchat_sketch_dequantize(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                            const float *channel_scale, const uint8_t *codes,
                                            const uint16_t *scales, float *k);

/* Score one layer's rows against the question's query rows q [n_rows][n_head][head_dim] with their
 * log-sum-exp lse [n_rows][n_head] (the graph's softmax over the kept cells, biases included):
 *   e(r, h, i) = exp(kq_scale * q(r, h) . k_i(h / (n_head / n_kv_head)) - lse(r, h))
 * (renormalise != 0: divided by 1 + sum_i e(r, h, i), i.e. put on a softmax over kept + these rows),
 * out [n_head][n] = mean over the rows of e (rows whose q or lse is NaN are skipped; none: 0). */
CERTCHAT_API int certchat_sketch_score(int64_t n, int64_t n_kv_head, int64_t head_dim, int32_t bits,
                                       const float *channel_scale, const uint8_t *codes,
                                       const uint16_t *scales, int64_t n_rows,
                                       int64_t n_head, const float *q, const float *lse, float kq_scale,
                                       int32_t renormalise, float *out);

/* ---- CUDA library only ---- */

/* Number of usable CUDA devices (0 without a driver or device). */
CERTCHAT_API int certchat_cuda_device_count(void);

/* Timings of the last [cuda] call on this thread, in milliseconds (CUDA events). */
CERTCHAT_API int certchat_cuda_last_timing(double *h2d_ms, double *kernel_ms, double *d2h_ms);

#ifdef __cplusplus
}
#endif

#endif /* CERTCHAT_CORE_H */
