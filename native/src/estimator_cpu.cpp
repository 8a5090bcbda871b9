// The estimator side of the design core (CPU only): the Hajek estimate of one
// attention output from a retained set, its token- and cluster-form variance
// estimates, the effective degrees of freedom of the error and of the variance
// estimate, and the certificates built from them, with the normal, chi-square and F
// quantiles they need.
#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "certchat_core.h"
#include "status.hpp"

namespace certchat {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

double normal_pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI); }

// Lower-tail quantile for q in (0, 0.5]: a rational start (Abramowitz & Stegun 26.2.23,
// |error| < 4.5e-4) polished by Newton steps on erfc, which is accurate in the lower tail.
double normal_lower_quantile(double q) {
    const double t = std::sqrt(-2.0 * std::log(q));
    double x = -(t - (2.515517 + 0.802853 * t + 0.010328 * t * t) /
                         (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t));
    for (int it = 0; it < 50; ++it) {
        const double step = (normal_cdf(x) - q) / normal_pdf(x);
        x -= step;
        if (std::fabs(step) <= 1e-15 * std::max(1.0, std::fabs(x))) break;
    }
    return x;
}

// Regularised lower incomplete gamma P(a, x): series below a + 1, continued fraction
// (modified Lentz) for the upper tail above.
double gamma_p(double a, double x) {
    if (x <= 0.0) return 0.0;
    const double log_front = a * std::log(x) - x - std::lgamma(a);
    if (x < a + 1.0) {
        double term = 1.0 / a, sum = term;
        for (int k = 1; k < 100000; ++k) {
            term *= x / (a + k);
            sum += term;
            if (term < sum * 1e-17) break;
        }
        return std::exp(log_front) * sum;
    }
    const double tiny = 1e-300;
    double b = x + 1.0 - a, c = 1.0 / tiny, dd = 1.0 / b, h = dd;
    for (int k = 1; k < 100000; ++k) {
        const double an = -k * (k - a);
        b += 2.0;
        dd = an * dd + b;
        if (std::fabs(dd) < tiny) dd = tiny;
        c = b + an / c;
        if (std::fabs(c) < tiny) c = tiny;
        dd = 1.0 / dd;
        const double delta = dd * c;
        h *= delta;
        if (std::fabs(delta - 1.0) < 1e-16) break;
    }
    return 1.0 - std::exp(log_front) * h;
}

// Chi-square quantile: Wilson-Hilferty start, then safeguarded Newton on P(k/2, x/2).
double chi2_quantile(double p, double k) {
    const double a = 0.5 * k;
    const double z = p < 0.5 ? normal_lower_quantile(p) : -normal_lower_quantile(1.0 - p);
    const double h = 2.0 / (9.0 * k);
    double x = k * std::pow(std::max(1.0 - h + z * std::sqrt(h), 1e-3), 3.0);
    double lo = 0.0, hi = std::numeric_limits<double>::infinity();
    for (int it = 0; it < 200; ++it) {
        const double f = gamma_p(a, 0.5 * x) - p;
        if (f < 0.0)
            lo = x;
        else
            hi = x;
        const double dens = std::exp((a - 1.0) * std::log(0.5 * x) - 0.5 * x - std::lgamma(a)) * 0.5;
        double next = dens > 0.0 ? x - f / dens : kNaN;
        if (!(next > lo && next < hi)) next = std::isinf(hi) ? 2.0 * x + 1.0 : 0.5 * (lo + hi);
        if (std::fabs(next - x) <= 1e-14 * x) return next;
        x = next;
    }
    return x;
}

// Regularised incomplete beta I_x(a, b) by its continued fraction (modified Lentz),
// using the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where the fraction converges slowly.
double beta_cf(double a, double b, double x) {
    const double tiny = 1e-300;
    double c = 1.0, dd = 1.0 - (a + b) * x / (a + 1.0);
    if (std::fabs(dd) < tiny) dd = tiny;
    dd = 1.0 / dd;
    double h = dd;
    for (int m = 1; m < 100000; ++m) {
        const double m2 = 2.0 * m;
        double an = m * (b - m) * x / ((a + m2 - 1.0) * (a + m2));
        dd = 1.0 + an * dd;
        if (std::fabs(dd) < tiny) dd = tiny;
        c = 1.0 + an / c;
        if (std::fabs(c) < tiny) c = tiny;
        dd = 1.0 / dd;
        h *= dd * c;
        an = -(a + m) * (a + b + m) * x / ((a + m2) * (a + m2 + 1.0));
        dd = 1.0 + an * dd;
        if (std::fabs(dd) < tiny) dd = tiny;
        c = 1.0 + an / c;
        if (std::fabs(c) < tiny) c = tiny;
        dd = 1.0 / dd;
        const double delta = dd * c;
        h *= delta;
        if (std::fabs(delta - 1.0) < 1e-16) break;
    }
    return h;
}

double log_beta(double a, double b) { return std::lgamma(a) + std::lgamma(b) - std::lgamma(a + b); }

double beta_inc(double a, double b, double x) {
    if (x <= 0.0) return 0.0;
    if (x >= 1.0) return 1.0;
    const double front = std::exp(a * std::log(x) + b * std::log1p(-x) - log_beta(a, b));
    if (x < (a + 1.0) / (a + b + 2.0)) return front * beta_cf(a, b, x) / a;
    return 1.0 - front * beta_cf(b, a, 1.0 - x) / b;
}

// F quantile: solve I_y(d1/2, d2/2) = p for y (safeguarded Newton in y), then
// x = d2 y / (d1 (1 - y)).
double f_quantile(double p, double d1, double d2) {
    const double a = 0.5 * d1, b = 0.5 * d2;
    double lo = 0.0, hi = 1.0, y = 0.5;
    const double lb = log_beta(a, b);
    for (int it = 0; it < 300; ++it) {
        const double f = beta_inc(a, b, y) - p;
        if (f < 0.0)
            lo = y;
        else
            hi = y;
        const double dens = std::exp((a - 1.0) * std::log(y) + (b - 1.0) * std::log1p(-y) - lb);
        double next = dens > 0.0 ? y - f / dens : kNaN;
        if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
        if (std::fabs(next - y) <= 1e-15 * std::max(y, 1e-300) || hi - lo <= 1e-17) {
            y = next;
            break;
        }
        y = next;
    }
    return d2 * y / (d1 * (1.0 - y));
}

int check_count(int64_t n) {
    return n < 0 ? fail(CERTCHAT_ERR_INVALID, "n must be >= 0, got %lld", static_cast<long long>(n)) : CERTCHAT_OK;
}

}  // namespace
}  // namespace certchat

using namespace certchat;

extern "C" {

double certchat_normal_quantile(double p) {
    if (!(p > 0.0 && p < 1.0)) return kNaN;
    if (p == 0.5) return 0.0;
    return p < 0.5 ? normal_lower_quantile(p) : -normal_lower_quantile(1.0 - p);
}

double certchat_chi2_quantile(double p, double dof) {
    if (!(p > 0.0 && p < 1.0) || !(dof > 0.0) || std::isinf(dof)) return kNaN;
    return chi2_quantile(p, dof);
}

double certchat_f_quantile(double p, double d1, double d2) {
    if (!(p > 0.0 && p < 1.0) || !(d1 > 0.0) || !(d2 > 0.0) || std::isinf(d1)) return kNaN;
    if (std::isinf(d2)) return chi2_quantile(p, d1) / d1;
    return f_quantile(p, d1, d2);
}

int certchat_certificate(int64_t n, const double *v_hat, const double *o_norm2, double delta, const double *dof,
                         const double *dof_var, double *abs_out, double *rel_out) {
    clear_error();
    int rc = check_count(n);
    if (rc != CERTCHAT_OK) return rc;
    if (!(delta > 0.0 && delta < 1.0)) return fail(CERTCHAT_ERR_INVALID, "delta must be in (0, 1), got %g", delta);
    if (n > 0 && (v_hat == nullptr || o_norm2 == nullptr || abs_out == nullptr || rel_out == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "v_hat, o_norm2, abs_out and rel_out are required");
    if (dof == nullptr && dof_var != nullptr) return fail(CERTCHAT_ERR_INVALID, "dof_var needs dof");
    for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(v_hat[i]))
            return fail(CERTCHAT_ERR_NONFINITE, "v_hat[%lld] is %g", static_cast<long long>(i), v_hat[i]);
        if (!(std::isfinite(o_norm2[i]) && o_norm2[i] >= 0.0))
            return fail(CERTCHAT_ERR_INVALID, "o_norm2[%lld] = %g must be finite and >= 0",
                        static_cast<long long>(i), o_norm2[i]);
        if (dof != nullptr && !(dof[i] >= 1.0 && std::isfinite(dof[i])))
            return fail(CERTCHAT_ERR_INVALID, "dof[%lld] = %g must be finite and >= 1", static_cast<long long>(i),
                        dof[i]);
        if (dof_var != nullptr && !(dof_var[i] > 0.0))
            return fail(CERTCHAT_ERR_INVALID, "dof_var[%lld] = %g must be > 0", static_cast<long long>(i),
                        dof_var[i]);
    }
    const double z = certchat_normal_quantile(1.0 - delta);
    double last_h = -1.0, last_m = -1.0, last_k = 0.0;  // dof repeats across heads; skip re-solving
    for (int64_t i = 0; i < n; ++i) {
        double k = z;
        if (dof != nullptr) {
            const double h = dof[i];
            const double m = dof_var != nullptr ? dof_var[i] : HUGE_VAL;
            if (h != last_h || m != last_m) {
                last_h = h;
                last_m = m;
                last_k = std::sqrt(certchat_f_quantile(1.0 - delta, h, m));
            }
            k = last_k;
        }
        // A slightly negative v_hat is cancellation in the expanded in-graph formula.
        const double a = k * std::sqrt(std::max(v_hat[i], 0.0));
        abs_out[i] = a;
        rel_out[i] = o_norm2[i] > 0.0 ? a / std::sqrt(o_norm2[i]) : (a == 0.0 ? 0.0 : HUGE_VAL);
    }
    return CERTCHAT_OK;
}

int certchat_hajek(int64_t n, int64_t d, int64_t n_draws, const double *logits, const double *values,
                   const double *pi, const uint8_t *keep, const int32_t *unit_ids, int64_t n_units,
                   double *o_hat_out, double *vhat_token_out, double *vhat_cluster_out, double *dof_out,
                   double *dof_var_out) {
    clear_error();
    if (n <= 0 || d <= 0 || n_draws < 0)
        return fail(CERTCHAT_ERR_INVALID, "need n > 0, d > 0 and n_draws >= 0 (got %lld, %lld, %lld)",
                    static_cast<long long>(n), static_cast<long long>(d), static_cast<long long>(n_draws));
    if (logits == nullptr || values == nullptr || pi == nullptr || (n_draws > 0 && keep == nullptr))
        return fail(CERTCHAT_ERR_INVALID, "logits, values, pi and keep are required");
    const int64_t U = unit_ids != nullptr ? n_units : n;
    for (int64_t i = 0; i < n; ++i) {
        if (!std::isfinite(logits[i]))
            return fail(CERTCHAT_ERR_NONFINITE, "logits[%lld] is %g", static_cast<long long>(i), logits[i]);
        if (!(pi[i] > 0.0 && pi[i] <= 1.0))
            return fail(CERTCHAT_ERR_INVALID, "pi[%lld] = %g must be in (0, 1]", static_cast<long long>(i), pi[i]);
        if (unit_ids != nullptr && (unit_ids[i] < 0 || unit_ids[i] >= n_units))
            return fail(CERTCHAT_ERR_INVALID, "unit_ids[%lld] = %d is outside [0, %lld)", static_cast<long long>(i),
                        unit_ids[i], static_cast<long long>(n_units));
    }
    for (int64_t i = 0; i < n * d; ++i)
        if (!std::isfinite(values[i]))
            return fail(CERTCHAT_ERR_NONFINITE, "values[%lld] is %g", static_cast<long long>(i), values[i]);
    try {
        std::vector<double> unit_pi(U, -1.0);
        for (int64_t i = 0; i < n; ++i) {
            const int64_t u = unit_ids != nullptr ? unit_ids[i] : i;
            if (unit_pi[u] < 0.0)
                unit_pi[u] = pi[i];
            else if (std::fabs(unit_pi[u] - pi[i]) > 1e-12 * unit_pi[u])
                return fail(CERTCHAT_ERR_INVALID, "tokens of unit %lld have different pi (%g vs %g)",
                            static_cast<long long>(u), unit_pi[u], pi[i]);
        }
        std::vector<double> lw(n), p(n), o(d), y, cmat;
        std::vector<int64_t> kept, slot(U, -1), touched;
        for (int64_t r = 0; r < n_draws; ++r) {
            const uint8_t *kr = keep + r * n;
            kept.clear();
            double lmax = -HUGE_VAL;
            for (int64_t i = 0; i < n; ++i) {
                if (!kr[i]) continue;
                kept.push_back(i);
                lw[i] = logits[i] - std::log(pi[i]);
                lmax = std::max(lmax, lw[i]);
            }
            if (kept.empty())
                return fail(CERTCHAT_ERR_INVALID, "draw %lld keeps no token", static_cast<long long>(r));
            double z = 0.0;
            for (int64_t i : kept) z += (p[i] = std::exp(lw[i] - lmax));
            std::fill(o.begin(), o.end(), 0.0);
            for (int64_t i : kept) {
                p[i] /= z;
                const double *v = values + i * d;
                for (int64_t j = 0; j < d; ++j) o[j] += p[i] * v[j];
            }
            // Residual sums per unit: y_u = sum_{i in u, kept} p_i (v_i - o_hat).
            touched.clear();
            y.clear();
            double vt = 0.0;
            for (int64_t i : kept) {
                const int64_t u = unit_ids != nullptr ? unit_ids[i] : i;
                if (slot[u] < 0) {
                    slot[u] = static_cast<int64_t>(touched.size());
                    touched.push_back(u);
                    y.resize(y.size() + d, 0.0);
                }
                double *yu = y.data() + slot[u] * d;
                const double *v = values + i * d;
                double r2 = 0.0;
                for (int64_t j = 0; j < d; ++j) {
                    const double e = v[j] - o[j];
                    r2 += e * e;
                    yu[j] += p[i] * e;
                }
                vt += (1.0 - pi[i]) * p[i] * p[i] * r2;
            }
            double vc = 0.0, dterm = 0.0;
            for (size_t s = 0; s < touched.size(); ++s) {
                const double *yu = y.data() + s * d;
                double y2 = 0.0;
                for (int64_t j = 0; j < d; ++j) y2 += yu[j] * yu[j];
                const double w = 1.0 - unit_pi[touched[s]];
                vc += w * y2;
                dterm += w * (w * y2) * (w * y2);
            }
            if (dof_out != nullptr) {
                // |C|_F^2 for C = sum_u (1 - pi_u) y_u y_u^T, upper triangle doubled.
                cmat.assign(d * d, 0.0);
                for (size_t s = 0; s < touched.size(); ++s) {
                    const double w = 1.0 - unit_pi[touched[s]];
                    if (w == 0.0) continue;
                    const double *yu = y.data() + s * d;
                    for (int64_t a = 0; a < d; ++a) {
                        const double wa = w * yu[a];
                        double *row = cmat.data() + a * d;
                        for (int64_t b = a; b < d; ++b) row[b] += wa * yu[b];
                    }
                }
                double fro = 0.0;
                for (int64_t a = 0; a < d; ++a) {
                    fro += cmat[a * d + a] * cmat[a * d + a];
                    for (int64_t b = a + 1; b < d; ++b) fro += 2.0 * cmat[a * d + b] * cmat[a * d + b];
                }
                const double num = vc * vc - dterm, den = fro - dterm;
                double h = (num > 0.0 && den > 0.0) ? num / den : 1.0;
                dof_out[r] = std::min(std::max(h, 1.0), static_cast<double>(d));
            }
            if (dof_var_out != nullptr) dof_var_out[r] = dterm > 0.0 ? 2.0 * vc * vc / dterm : HUGE_VAL;
            for (int64_t u : touched) slot[u] = -1;
            if (o_hat_out != nullptr) std::copy(o.begin(), o.end(), o_hat_out + r * d);
            if (vhat_token_out != nullptr) vhat_token_out[r] = vt;
            if (vhat_cluster_out != nullptr) vhat_cluster_out[r] = vc;
        }
        return CERTCHAT_OK;
    } catch (const std::bad_alloc &) {
        return fail(CERTCHAT_ERR_ALLOC, "out of memory");
    }
}

}  // extern "C"
