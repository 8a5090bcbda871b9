// Error reporting shared by the CPU and CUDA libraries: a per-thread last-error
// string behind certchat_core_last_error(), and the validation helpers every entry
// point uses so both libraries reject the same inputs with the same words.
#pragma once

#include <cstdint>

#include "certchat_core.h"

namespace certchat {

// Record a one-line message for the calling thread and return `code`.
int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

// Forget the calling thread's last message (every entry point starts with this).
void clear_error();

// Checks on a design struct; returns CERTCHAT_OK or the failure code (message set).
int check_design(const certchat_design *design);

// Checks on token arrays that both libraries validate on the host side of the call
// (pointer presence and sizes); value checks run where the data lives.
int check_token_args(int64_t n, const double *scores, const int32_t *unit_ids, int64_t n_units);

// After a fast check (CPU loop or device kernel) found a bad token value: name the first
// offending entry, categories in a fixed order, from the caller's host arrays. Both
// libraries report through these, so their messages agree.
int explain_tokens(int64_t n, const double *scores, const int32_t *unit_ids, int64_t n_units,
                   const int64_t *positions, const double *prev_cum);
int explain_pi_range(int64_t n, const double *pi);  // draw(): pi outside [0, 1]
int explain_update(int64_t n, const double *pi, const uint8_t *keep, const double *prev_cum);

}  // namespace certchat
