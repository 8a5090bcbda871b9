// Per-thread error messages, the version string and design-struct validation, shared
// by libcertchat_core.so and libcertchat_core_cuda.so.
#include "status.hpp"

#include <cmath>
#include <cstdarg>
#include <cstdio>

#ifndef CERTCHAT_VERSION_STRING
#error "CERTCHAT_VERSION_STRING must be defined by the build"
#endif

namespace certchat {

namespace {
thread_local char g_last_error[512] = "";
}

int fail(int code, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
    va_end(args);
    return code;
}

void clear_error() { g_last_error[0] = '\0'; }

int check_design(const certchat_design *d) {
    if (d == nullptr) return fail(CERTCHAT_ERR_INVALID, "design is NULL");
    if (d->method < CERTCHAT_METHOD_POISSON || d->method > CERTCHAT_METHOD_UNIFORM)
        return fail(CERTCHAT_ERR_INVALID, "unknown method %d", static_cast<int>(d->method));
    if (d->reserved != 0) return fail(CERTCHAT_ERR_INVALID, "design.reserved must be 0");
    if (std::isnan(d->budget) || d->budget < 0.0)
        return fail(CERTCHAT_ERR_INVALID, "budget must be a number >= 0, got %g", d->budget);
    if (!std::isfinite(d->floor) || d->floor < 0.0)
        return fail(CERTCHAT_ERR_INVALID, "floor must be finite and >= 0, got %g", d->floor);
    if (!(d->pi_min > 0.0 && d->pi_min <= 1.0))
        return fail(CERTCHAT_ERR_INVALID, "pi_min must be in (0, 1], got %g", d->pi_min);
    if (!(d->top_share >= 0.0 && d->top_share < 1.0))
        return fail(CERTCHAT_ERR_INVALID,
                    "top_share must be in [0, 1), got %g (use method topk for a purely deterministic top-k)",
                    d->top_share);
    return CERTCHAT_OK;
}

int check_token_args(int64_t n, const double *scores, const int32_t *unit_ids, int64_t n_units) {
    if (n < 0) return fail(CERTCHAT_ERR_INVALID, "n must be >= 0, got %lld", static_cast<long long>(n));
    if (n > 0 && scores == nullptr) return fail(CERTCHAT_ERR_INVALID, "scores is NULL");
    if (unit_ids != nullptr) {
        if (n_units < 0 || n_units > INT32_MAX)
            return fail(CERTCHAT_ERR_INVALID, "n_units must be in [0, 2^31), got %lld",
                        static_cast<long long>(n_units));
        if (n > 0 && n_units == 0) return fail(CERTCHAT_ERR_INVALID, "n_units is 0 but there are tokens");
    }
    return CERTCHAT_OK;
}

int explain_tokens(int64_t n, const double *scores, const int32_t *unit_ids, int64_t n_units,
                   const int64_t *positions, const double *prev_cum) {
    if (unit_ids != nullptr) {
        for (int64_t i = 0; i < n; ++i)
            if (unit_ids[i] < 0 || unit_ids[i] >= n_units)
                return fail(CERTCHAT_ERR_INVALID, "unit_ids[%lld] = %d is outside [0, %lld)",
                            static_cast<long long>(i), unit_ids[i], static_cast<long long>(n_units));
    }
    for (int64_t i = 0; i < n; ++i)
        if (!std::isfinite(scores[i]))
            return fail(CERTCHAT_ERR_NONFINITE, "scores[%lld] is %g: scores must be finite",
                        static_cast<long long>(i), scores[i]);
    for (int64_t i = 0; i < n; ++i)
        if (scores[i] < 0.0)
            return fail(CERTCHAT_ERR_INVALID, "scores[%lld] = %g is negative: scores must be >= 0",
                        static_cast<long long>(i), scores[i]);
    if (positions != nullptr) {
        for (int64_t i = 0; i < n; ++i)
            if (positions[i] < 0)
                return fail(CERTCHAT_ERR_INVALID, "positions[%lld] = %lld is negative", static_cast<long long>(i),
                            static_cast<long long>(positions[i]));
    }
    if (prev_cum != nullptr) {
        for (int64_t i = 0; i < n; ++i)
            if (!(std::isfinite(prev_cum[i]) && prev_cum[i] <= 0.0))
                return fail(CERTCHAT_ERR_INVALID, "prev_cum[%lld] = %g: cumulative log pi must be finite and <= 0",
                            static_cast<long long>(i), prev_cum[i]);
    }
    return fail(CERTCHAT_ERR_INTERNAL, "input check disagreed with its explanation");
}

int explain_pi_range(int64_t n, const double *pi) {
    for (int64_t i = 0; i < n; ++i)
        if (!(pi[i] >= 0.0 && pi[i] <= 1.0))
            return fail(CERTCHAT_ERR_INVALID, "pi[%lld] = %g is outside [0, 1]", static_cast<long long>(i), pi[i]);
    return fail(CERTCHAT_ERR_INTERNAL, "input check disagreed with its explanation");
}

int explain_update(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum) {
    for (int64_t i = 0; i < n; ++i) {
        if (keep[i] && !(pi[i] > 0.0 && pi[i] <= 1.0))
            return fail(CERTCHAT_ERR_INVALID, "pi[%lld] = %g: a kept token needs pi in (0, 1]",
                        static_cast<long long>(i), pi[i]);
        if (prev_cum != nullptr && !(std::isfinite(prev_cum[i]) && prev_cum[i] <= 0.0))
            return fail(CERTCHAT_ERR_INVALID, "prev_cum[%lld] = %g: cumulative log pi must be finite and <= 0",
                        static_cast<long long>(i), prev_cum[i]);
    }
    return fail(CERTCHAT_ERR_INTERNAL, "input check disagreed with its explanation");
}

}  // namespace certchat

extern "C" {

const char *certchat_core_version(void) { return CERTCHAT_VERSION_STRING; }

const char *certchat_core_last_error(void) { return certchat::g_last_error; }
}
