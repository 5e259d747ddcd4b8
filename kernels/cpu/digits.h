/* The digit combine for one output row, shared by fused.c (after torch._int_mm) and amx_digits.c
 * (after the AMX tiles), so both write the same bits (intqat/ops/digit_gemm.py has the why):
 *     o[k] = float32(2^-(shift + 14) * ((a0[k] - c0) * 2^14 + (a1[k] - c1) * 2^7 + (a2[k] - c2)))
 * exact in double until the one rounding; c_j = z * rowsum_j (the zero-point correction); NaN for a
 * row the split flagged (shift == INTQAT_BAD_ROW); o[k] = 0 where the mask mr (optional) is 0. */
#ifndef INTQAT_DIGITS_H
#define INTQAT_DIGITS_H
#include <math.h>
#include <stdint.h>

#define INTQAT_BAD_ROW INT32_MIN

static inline void combine_digit_row(const int32_t *a0, const int32_t *a1, const int32_t *a2, int64_t n,
                                     int32_t shift, double c0, double c1, double c2, const uint8_t *mr,
                                     float *o) {
    if (shift == INTQAT_BAD_ROW) {
        for (int64_t k = 0; k < n; ++k) o[k] = (mr && !mr[k]) ? 0.0f : NAN;
        return;
    }
    const double p = ldexp(1.0, -(shift + 14));
    for (int64_t k = 0; k < n; ++k) {
        const double T = ((double)a0[k] - c0) * 16384.0 + ((double)a1[k] - c1) * 128.0 + ((double)a2[k] - c2);
        const float y = (float)(T * p);
        o[k] = mr ? (mr[k] ? y : 0.0f) : y;
    }
}

#endif
