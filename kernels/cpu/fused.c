/* intqat's fused CPU kernels: the elementwise passes around torch._int_mm, one memory pass each.
 *
 * Every function computes exactly what the torch reference in intqat/ops computes (NUMERICS.md),
 * bit for bit: the same float32 operations in the same order, one rounding each. That is why this
 * file is compiled with -ffp-contract=off (no FMA contraction) and without -ffast-math, and why
 * rounding is nearbyint (round half to even, the default rounding mode), as torch.round.
 *
 * Layout: row-major, contiguous. "rows" are what a scale is shared along: activations (M, K) with
 * one scale per row (per token) or one for all, weights (N, K) with one scale per output channel.
 * Parallel over rows with OpenMP; the library links libgomp.so.1, which resolves to the copy torch
 * has already loaded, so these loops share torch's thread pool and its thread count.
 */
#include <math.h>
#include <stdint.h>

#define OMP_FOR _Pragma("omp parallel for schedule(static)")

/* One code: q = clamp(nearbyint(x * inv) + z, qmin, qmax) as float; r is the value before clamp. */
static inline float round_shift(float x, float inv, float z) { return nearbyintf(x * inv) + z; }
static inline float clampf(float r, float lo, float hi) { return r < lo ? lo : (r > hi ? hi : r); }

/* Quantize x (rows, cols) with scale[i * scale_stride] (stride 0: one scale for all rows) and zero
 * point z. Writes int8 codes; optionally the clip mask (qmin <= r <= qmax, as torch's bool) and the
 * int32 sum of each row's codes (the colsum of q_w that the zero-point correction needs). */
void intqat_quantize_rows(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                          float z, float qmin, float qmax, int8_t *out, uint8_t *mask, int32_t *rowsum) {
    OMP_FOR
    for (int64_t i = 0; i < rows; ++i) {
        const float inv = 1.0f / scale[i * scale_stride];
        const float *xi = x + i * cols;
        int8_t *oi = out + i * cols;
        if (mask) {
            uint8_t *mi = mask + i * cols;
            for (int64_t k = 0; k < cols; ++k) {
                const float r = round_shift(xi[k], inv, z);
                const float q = clampf(r, qmin, qmax);
                oi[k] = (int8_t)(int32_t)q;
                mi[k] = (uint8_t)(q == r);
            }
        } else {
            for (int64_t k = 0; k < cols; ++k) oi[k] = (int8_t)(int32_t)clampf(round_shift(xi[k], inv, z), qmin, qmax);
        }
        if (rowsum) {
            int32_t s = 0;
            for (int64_t k = 0; k < cols; ++k) s += oi[k];
            rowsum[i] = s;
        }
    }
}

/* Fake quantization, x -> x_hat = (q - z) * s with q as in intqat_quantize_rows, in fp32, plus the
 * optional clip mask: torch.fake_quantize_per_{tensor,channel}_affine in one pass. */
void intqat_fake_quantize_rows(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                               float z, float qmin, float qmax, float *out, uint8_t *mask) {
    OMP_FOR
    for (int64_t i = 0; i < rows; ++i) {
        const float s = scale[i * scale_stride];
        const float inv = 1.0f / s;
        const float *xi = x + i * cols;
        float *oi = out + i * cols;
        if (mask) {
            uint8_t *mi = mask + i * cols;
            for (int64_t k = 0; k < cols; ++k) {
                const float r = round_shift(xi[k], inv, z);
                const float q = clampf(r, qmin, qmax);
                oi[k] = (q - z) * s;
                mi[k] = (uint8_t)(q == r);
            }
        } else {
            for (int64_t k = 0; k < cols; ++k) oi[k] = (clampf(round_shift(xi[k], inv, z), qmin, qmax) - z) * s;
        }
    }
}

/* Dynamic symmetric per-row quantization: scale[i] = max(max_k |x[i, k]| / qmax, eps), z = 0.
 * Per-token activation scales, and min-max per-channel weight scales (rowsum: the weight colsum).
 * The row is read twice, the second time from cache: one pass over memory. */
void intqat_quantize_rows_dynamic(const float *x, int64_t rows, int64_t cols, float qmin, float qmax, float eps,
                                  int8_t *out, float *scale, int32_t *rowsum) {
    OMP_FOR
    for (int64_t i = 0; i < rows; ++i) {
        const float *xi = x + i * cols;
        /* max |x| on the bit patterns: for non-negative floats the integer order is the float
         * order, and a NaN (above +inf) wins as in torch's max; integer max vectorizes. */
        uint32_t abits = 0;
        for (int64_t k = 0; k < cols; ++k) {
            uint32_t b;
            __builtin_memcpy(&b, xi + k, 4);
            b &= 0x7fffffffu;
            abits = b > abits ? b : abits;
        }
        float amax;
        __builtin_memcpy(&amax, &abits, 4);
        float s = amax / qmax;
        s = s < eps ? eps : s;
        scale[i] = s;
        const float inv = 1.0f / s;
        int8_t *oi = out + i * cols;
        for (int64_t k = 0; k < cols; ++k) oi[k] = (int8_t)(int32_t)clampf(round_shift(xi[k], inv, 0.0f), qmin, qmax);
        if (rowsum) {
            int32_t sum = 0;
            for (int64_t k = 0; k < cols; ++k) sum += oi[k];
            rowsum[i] = sum;
        }
    }
}

/* The straight-through mask, in place: g[i] = mask[i] ? g[i] : 0 (torch.where(mask, g, 0.0)). */
void intqat_mask_zero(float *g, const uint8_t *mask, int64_t n) {
    OMP_FOR
    for (int64_t i = 0; i < n; ++i) g[i] = mask[i] ? g[i] : 0.0f;
}

/* The integer epilogue, acc (M, N) int32 -> y (M, N) fp32:
 *     y = float32(acc - z_x * colsum[n]) * (s_x[m * sx_stride] * s_w[n]) (+ b[n])
 * colsum may be NULL (symmetric activations), bias may be NULL. The int32 arithmetic wraps like torch's. */
void intqat_epilogue(const int32_t *acc, int64_t M, int64_t N, int32_t z_x, const int32_t *colsum,
                     const float *s_x, int64_t sx_stride, const float *s_w, const float *bias, float *y) {
    OMP_FOR
    for (int64_t m = 0; m < M; ++m) {
        const int32_t *am = acc + m * N;
        float *ym = y + m * N;
        const float sx = s_x[m * sx_stride];
        for (int64_t n = 0; n < N; ++n) {
            int32_t a = am[n];
            if (colsum) a = (int32_t)((uint32_t)a - (uint32_t)z_x * (uint32_t)colsum[n]);
            const float sc = sx * s_w[n];
            float v = (float)a * sc;
            if (bias) v = v + bias[n];
            ym[n] = v;
        }
    }
}

/* Dequantize q (rows, cols) int8 -> fp32: (float(q) - z) * scale[i * scale_stride]; scale NULL means
 * a plain conversion float(q) (exact), which is what the backward's g @ float(q_w) needs. */
void intqat_dequantize_rows(const int8_t *q, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                            float z, float *out) {
    OMP_FOR
    for (int64_t i = 0; i < rows; ++i) {
        const int8_t *qi = q + i * cols;
        float *oi = out + i * cols;
        if (scale) {
            const float s = scale[i * scale_stride];
            for (int64_t k = 0; k < cols; ++k) oi[k] = ((float)qi[k] - z) * s;
        } else {
            for (int64_t k = 0; k < cols; ++k) oi[k] = (float)qi[k];
        }
    }
}
