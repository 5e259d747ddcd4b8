/* The integer epilogue for one output row, shared by fused.c (after torch._int_mm) and amx_linear.c
 * (after the AMX tiles), so both write the same bits:
 *     y[n] = float32(a[n] - z_x * colsum[n]) * (sx * s_w[n]) (+ bias[n])
 * The int32 arithmetic wraps like torch's; colsum NULL: symmetric activations (no correction);
 * bias may be NULL. docs/numerics.md has the why of each step. */
#ifndef INTQAT_EPILOGUE_H
#define INTQAT_EPILOGUE_H
#include <stdint.h>

static inline void epilogue_row(const int32_t *a, int64_t n, int32_t z_x, const int32_t *colsum, float sx,
                                const float *s_w, const float *bias, float *y) {
    for (int64_t j = 0; j < n; ++j) {
        int32_t v = a[j];
        if (colsum) v = (int32_t)((uint32_t)v - (uint32_t)z_x * (uint32_t)colsum[j]);
        float o = (float)v * (sx * s_w[j]);
        if (bias) o = o + bias[j];
        y[j] = o;
    }
}

#endif
