/* intqat's fused CPU kernels: the elementwise passes around torch._int_mm, one memory pass each.
 *
 * Every function computes exactly what the torch reference in intqat/ops computes (docs/numerics.md),
 * bit for bit: the same float32 operations in the same order, one rounding each. That is why this
 * file is compiled with -ffp-contract=off (no FMA contraction) and without -ffast-math, and why
 * rounding is nearbyint (round half to even, the default rounding mode), as torch.round.
 *
 * Layout: row-major, contiguous. "rows" are what a scale is shared along: activations (M, K) with
 * one scale per row (per token) or one for all, weights (N, K) with one scale per output channel.
 * Parallel over rows with OpenMP; the library links libgomp.so.1, which resolves to the copy torch
 * has already loaded, so these loops share torch's thread pool and its thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "epilogue.h" /* epilogue_row */

/* Parallel over rows when the pass touches at least INTQAT_GRAIN elements, one thread below: torch's own
 * grain for elementwise work (at::internal::GRAIN_SIZE), under which waking a second thread costs more
 * than it saves (a BERT-tiny layer's passes are 1K-64K elements, ~10 of them per layer and step). Each
 * element is computed the same way either way: the thread count never changes a bit of the result. */
#define INTQAT_GRAIN 32768
#define INTQAT_PRAGMA(x) _Pragma(#x)
#define OMP_FOR_IF(work) INTQAT_PRAGMA(omp parallel for schedule(static) if ((work) >= INTQAT_GRAIN))

/* One code: q = clamp(nearbyint(x * inv) + z, qmin, qmax) as float; r is the value before clamp. */
static inline float round_shift(float x, float inv, float z) { return nearbyintf(x * inv) + z; }
static inline float clampf(float r, float lo, float hi) { return r < lo ? lo : (r > hi ? hi : r); }

/* Quantize x (rows, cols) with scale[i * scale_stride] (stride 0: one scale for all rows) and zero
 * point z. Writes int8 codes; optionally the clip mask (qmin <= r <= qmax, as torch's bool) and the
 * int32 sum of each row's codes (the colsum of q_w that the zero-point correction needs). */
void intqat_quantize_rows(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                          float z, float qmin, float qmax, int8_t *out, uint8_t *mask, int32_t *rowsum) {
    OMP_FOR_IF(rows * cols)
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
    OMP_FOR_IF(rows * cols)
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
    OMP_FOR_IF(rows * cols)
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

/* (min, max) of x (n floats) in one pass, NaN if any element is NaN (as torch.aminmax): the activation
 * observer's reduction at every training step. `v < lo ? v : lo` is exactly minps' semantics, so it
 * vectorizes without -ffast-math; min / max select elements, so the result is exact. */
void intqat_minmax(const float *x, int64_t n, float *out) {
    float lo = INFINITY, hi = -INFINITY;
    int nan = 0;
#pragma omp parallel for simd reduction(min : lo) reduction(max : hi) reduction(| : nan) schedule(static) \
    if (n >= INTQAT_GRAIN)
    for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        nan |= v != v;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    out[0] = nan ? NAN : lo;
    out[1] = nan ? NAN : hi;
}

/* STE clip masks as bits (intqat/ops/masks.py): bit i of byte j is mask[8 j + i]; n elements.
 * Eight mask bytes at a time: a bool byte is 0 or 1, so the eight of them as one little-endian uint64
 * hold the bits at 0, 8, ..., 56, and the multiply by _GATHER (masks.py: the same constant) moves bit
 * 8 i to bit 56 + i with every cross term below bit 56 or past bit 63. */
#define MASK_GATHER 0x0102040810204080ULL
#define MASK_LOW_BITS 0x0101010101010101ULL

static inline uint64_t load_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

void intqat_pack_bits(const uint8_t *mask, int64_t n, uint8_t *packed) {
    const int64_t full = n / 8;
    OMP_FOR_IF(n)
    for (int64_t j = 0; j < full; ++j)
        packed[j] = (uint8_t)(((load_u64(mask + 8 * j) & MASK_LOW_BITS) * MASK_GATHER) >> 56);
    if (n % 8) {
        uint8_t b = 0;
        for (int64_t k = 8 * full; k < n; ++k) b |= (uint8_t)((mask[k] != 0) << (k - 8 * full));
        packed[full] = b;
    }
}

/* spread[b] = the 8 bool bytes of the bits of b: unpacking is one table load and one 8-byte store a byte. */
static uint64_t spread[256];

__attribute__((constructor)) static void fill_spread(void) {
    for (int b = 0; b < 256; ++b) {
        uint64_t v = 0;
        for (int i = 0; i < 8; ++i) v |= (uint64_t)((b >> i) & 1) << (8 * i);
        spread[b] = v;
    }
}

void intqat_unpack_bits(const uint8_t *packed, int64_t n, uint8_t *mask) {
    const int64_t full = n / 8;
    OMP_FOR_IF(n)
    for (int64_t j = 0; j < full; ++j) memcpy(mask + 8 * j, &spread[packed[j]], 8);
    for (int64_t k = 8 * full; k < n; ++k) mask[k] = (packed[k >> 3] >> (k & 7)) & 1;
}

/* The straight-through mask from its bits, in place: g[k] = bit k ? g[k] : 0 (torch.where(mask, g, 0.0)
 * with mask = unpack(packed)): the backward's mask pass without the bool tensor. A cleared element becomes
 * +0.0 whatever it held (NaN too), as torch.where gives. */
void intqat_mask_zero_bits(float *g, const uint8_t *packed, int64_t n) {
    const int64_t pairs = n / 16;
    OMP_FOR_IF(n)
    for (int64_t j = 0; j < pairs; ++j) {
        float *gj = g + 16 * j;
#if defined(__AVX512F__)
        const __mmask16 m = (__mmask16)(packed[2 * j] | (packed[2 * j + 1] << 8));
        _mm512_storeu_ps(gj, _mm512_maskz_loadu_ps(m, gj));
#elif defined(__AVX2__)
        /* each lane i tests bit i of its byte: all-ones where set, and the float's bits are kept */
        const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        for (int h = 0; h < 2; ++h) {
            const __m256i b = _mm256_and_si256(_mm256_set1_epi32(packed[2 * j + h]), bit);
            const __m256 keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, bit));
            _mm256_storeu_ps(gj + 8 * h, _mm256_and_ps(_mm256_loadu_ps(gj + 8 * h), keep));
        }
#else
        const unsigned m = packed[2 * j] | (packed[2 * j + 1] << 8);
        for (int i = 0; i < 16; ++i) gj[i] = (m >> i) & 1 ? gj[i] : 0.0f;
#endif
    }
    for (int64_t k = 16 * pairs; k < n; ++k) g[k] = (packed[k >> 3] >> (k & 7)) & 1 ? g[k] : 0.0f;
}

/* The integer epilogue, acc (M, N) int32 -> y (M, N) fp32, row m with activation scale s_x[m * sx_stride]
 * (epilogue.h has the expression). */
void intqat_epilogue(const int32_t *acc, int64_t M, int64_t N, int32_t z_x, const int32_t *colsum,
                     const float *s_x, int64_t sx_stride, const float *s_w, const float *bias, float *y) {
    OMP_FOR_IF(M * N)
    for (int64_t m = 0; m < M; ++m) epilogue_row(acc + m * N, N, z_x, colsum, s_x[m * sx_stride], s_w, bias, y + m * N);
}

/* Dequantize q (rows, cols) int8 -> fp32: (float(q) - z) * scale[i * scale_stride]; scale NULL means
 * a plain conversion float(q) (exact), which is what the backward's g @ float(q_w) needs. */
void intqat_dequantize_rows(const int8_t *q, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                            float z, float *out) {
    OMP_FOR_IF(rows * cols)
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

/* ---------------------------------------------------------------------------------------------
 * The backward GEMMs through int8 digits (intqat/ops/digit_gemm.py has the torch twin and the why).
 *
 * Split: v = a[r, c] * col_scale[c] (one float32 rounding, as torch), then per row r a power of two
 * 2^t with max_c |v| * 2^t in [63.75, 127.5), and three int8 digits, exact in double:
 *     v * 2^t = d0 + d1 / 2^7 + d2 / 2^14 + residual,   |d0| <= 127, |d1|, |d2| <= 64, |residual| <= 2^-15
 * a (R, C) is read through strides (rs, cs), so a transposed view needs no copy. A row holding a
 * NaN or an infinity gets shift INTQAT_BAD_ROW and zero digits; the combine writes NaN there.
 * rowsum (3, R), optional: each digit plane's row sums, for the zero-point correction. */
#include "digits.h" /* INTQAT_BAD_ROW, combine_digit_row */

/* One row; inlined with constant strides for the common contiguous case, so that it vectorizes. */
static inline void split_row(const float *ar, int64_t C, int64_t cs, const float *col_scale, int64_t ss,
                             int8_t *d0, int8_t *d1, int8_t *d2, int32_t *shift, int32_t *sums) {
    /* max |v| on the bit patterns (as intqat_quantize_rows_dynamic): an integer max vectorizes, and
     * a NaN or an infinity shows as bits >= those of +inf */
    uint32_t abits = 0;
    for (int64_t c = 0; c < C; ++c) {
        const float v = ar[c * cs] * col_scale[c * ss];
        uint32_t b;
        __builtin_memcpy(&b, &v, 4);
        b &= 0x7fffffffu;
        abits = b > abits ? b : abits;
    }
    float amax;
    __builtin_memcpy(&amax, &abits, 4);
    int32_t s0 = 0, s1 = 0, s2 = 0;
    if (abits >= 0x7f800000u) {
        *shift = INTQAT_BAD_ROW;
        for (int64_t c = 0; c < C; ++c) d0[c] = d1[c] = d2[c] = 0;
    } else {
        int e;
        frexp((double)amax, &e);
        int t = 7 - e;
        double p = ldexp(1.0, t);
        if ((double)amax * p >= 127.5) { t -= 1; p *= 0.5; }
        *shift = t;
        if (t <= 127) {
            /* The same digits in float32, twice the SIMD width: x = v 2^t is exact (a power of two,
             * |x| < 127.5; where it would fall below float32's normal range its digits are 0 either way),
             * x - q0 and r1 - q1 are exact (Sterbenz: |x - q0| <= 1/2 on x's own grid), and the
             * multiplications by 128 are exact. t > 127 (a row of subnormals) keeps the double path. */
            const float pf = ldexpf(1.0f, t);
            for (int64_t c = 0; c < C; ++c) {
                const float x = (ar[c * cs] * col_scale[c * ss]) * pf;
                const float q0 = nearbyintf(x);
                const float r1 = (x - q0) * 128.0f;
                const float q1 = nearbyintf(r1);
                const float q2 = nearbyintf((r1 - q1) * 128.0f);
                d0[c] = (int8_t)(int32_t)q0; d1[c] = (int8_t)(int32_t)q1; d2[c] = (int8_t)(int32_t)q2;
                s0 += (int32_t)q0; s1 += (int32_t)q1; s2 += (int32_t)q2;
            }
        } else {
            for (int64_t c = 0; c < C; ++c) {
                const double x = (double)(ar[c * cs] * col_scale[c * ss]) * p;
                const double q0 = nearbyint(x);
                const double r1 = (x - q0) * 128.0;
                const double q1 = nearbyint(r1);
                const double q2 = nearbyint((r1 - q1) * 128.0);
                d0[c] = (int8_t)(int32_t)q0; d1[c] = (int8_t)(int32_t)q1; d2[c] = (int8_t)(int32_t)q2;
                s0 += (int32_t)q0; s1 += (int32_t)q1; s2 += (int32_t)q2;
            }
        }
    }
    sums[0] = s0; sums[1] = s1; sums[2] = s2;
}

/* Row r of the split into the planes (row stride ld, plane stride plane), zeroing digits C..ld. */
static inline void split_into(const float *ar, int64_t C, int64_t cs, const float *col_scale, int64_t ss,
                              int8_t *digits, int64_t ld, int64_t plane, int64_t r, int64_t R, int32_t *shift,
                              int32_t *rowsum) {
    int8_t *d0 = digits + r * ld;
    int32_t sums[3];
    if (cs == 1 && ss == 1)
        split_row(ar, C, 1, col_scale, 1, d0, d0 + plane, d0 + 2 * plane, shift + r, sums);
    else if (cs == 1 && ss == 0)
        split_row(ar, C, 1, col_scale, 0, d0, d0 + plane, d0 + 2 * plane, shift + r, sums);
    else
        split_row(ar, C, cs, col_scale, ss, d0, d0 + plane, d0 + 2 * plane, shift + r, sums);
    for (int64_t c = C; c < ld; ++c) d0[c] = d0[plane + c] = d0[2 * plane + c] = 0;
    if (rowsum) { rowsum[r] = sums[0]; rowsum[R + r] = sums[1]; rowsum[2 * R + r] = sums[2]; }
}

/* buf (n, C) = the transpose of the (C, n) block at a (row stride cs, n <= 16 contiguous floats a row):
 * rows r0..r0+n of a transposed view. 8x8 blocks go through registers (AVX2), the edges one by one. */
static void gather_rows_t(const float *a, int64_t cs, int64_t n, int64_t C, float *buf) {
    int64_t c0 = 0;
#if defined(__AVX2__)
    for (; c0 + 8 <= C; c0 += 8)
        for (int64_t i0 = 0; i0 + 8 <= n; i0 += 8) {
            __m256 r[8];
            for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(a + (c0 + k) * cs + i0);
            const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            const __m256 o[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
                                 _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
                                 _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
                                 _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
            for (int k = 0; k < 8; ++k) _mm256_storeu_ps(buf + (i0 + k) * C + c0, o[k]);
        }
    /* rows past the last full 8 (n % 8) of these columns */
    for (int64_t c = 0; c < c0; ++c)
        for (int64_t i = n - n % 8; i < n; ++i) buf[i * C + c] = a[c * cs + i];
#endif
    for (int64_t c = c0; c < C; ++c)
        for (int64_t i = 0; i < n; ++i) buf[i * C + c] = a[c * cs + i];
}

/* digits: plane j, row r at digits + j * plane + r * ld; ld >= C, and the digits past C in each row
 * are zeroed (the AMX kernel runs 64-deep contraction steps over them). */
void intqat_split_digits(const float *a, int64_t R, int64_t C, int64_t rs, int64_t cs, const float *col_scale,
                         int64_t ss, int8_t *digits, int64_t ld, int64_t plane, int32_t *shift, int32_t *rowsum) {
    if (cs != 1) {
        /* a strided view (grad_w splits gᵀ): gather blocks of 16 rows into a contiguous buffer
         * first, reading 16 neighbouring floats at a time instead of one per cache line */
#pragma omp parallel if (R * C >= INTQAT_GRAIN)
        {
            float *buf = (float *)malloc(sizeof(float) * 16 * (size_t)(C ? C : 1));
#pragma omp for schedule(static)
            for (int64_t r0 = 0; r0 < R; r0 += 16) {
                const int64_t n = R - r0 < 16 ? R - r0 : 16;
                if (!buf) { /* no memory for the buffer: read through the strides, slower, same digits */
                    for (int64_t r = r0; r < r0 + n; ++r)
                        split_into(a + r * rs, C, cs, col_scale, ss, digits, ld, plane, r, R, shift, rowsum);
                    continue;
                }
                if (rs == 1) {
                    gather_rows_t(a + r0, cs, n, C, buf);
                } else {
                    for (int64_t i = 0; i < n; ++i)
                        for (int64_t c = 0; c < C; ++c) buf[i * C + c] = a[(r0 + i) * rs + c * cs];
                }
                for (int64_t i = 0; i < n; ++i)
                    split_into(buf + i * C, C, 1, col_scale, ss, digits, ld, plane, r0 + i, R, shift, rowsum);
            }
            free(buf);
        }
        return;
    }
    OMP_FOR_IF(R * C)
    for (int64_t r = 0; r < R; ++r) split_into(a + r * rs, C, 1, col_scale, ss, digits, ld, plane, r, R, shift, rowsum);
}

/* Combine: acc (3R, K) int32 = the three digit planes times int8 codes q (C, K), and
 *     out[r, k] = float32(2^-(t + 14) * sum_j 2^(14 - 7j) * (acc_j[r, k] - z * rowsum_j[r]))
 * The sum is an integer below 2^53, exact in double, and the power of two is exact: one rounding.
 * mask (R, K) optional: out = mask ? out : 0 (the straight-through clip mask). */
void intqat_combine_digits(const int32_t *acc, int64_t R, int64_t K, const int32_t *shift, const int32_t *rowsum,
                           int32_t z, const uint8_t *mask, float *out) {
    const int64_t plane = R * K;
    OMP_FOR_IF(R * K)
    for (int64_t r = 0; r < R; ++r) {
        const int32_t *a0 = acc + r * K;
        combine_digit_row(a0, a0 + plane, a0 + 2 * plane, K, shift[r], rowsum ? (double)z * rowsum[r] : 0.0,
                          rowsum ? (double)z * rowsum[R + r] : 0.0, rowsum ? (double)z * rowsum[2 * R + r] : 0.0,
                          mask ? mask + r * K : 0, out + r * K);
    }
}

/* ---------------------------------------------------------------------------------------------
 * NCHW <-> NHWC for the C++ conv step (train_conv.cpp; nchw_layout.h has the why). Values are moved, never
 * changed, except where a function says which float32 steps it applies on the way (the epilogue's, in its order). */
#include "nchw_layout.h" /* intqat_transpose_f32, intqat_transpose_i8 */

/* n blocks: dst + b * dbs gets block b of src + b * sbs, (rows, cols) at stride sld transposed to stride dld */
void intqat_transpose_f32_batch(const float *src, int64_t n, int64_t rows, int64_t cols, int64_t sld, int64_t sbs,
                                float *dst, int64_t dld, int64_t dbs) {
    OMP_FOR_IF(n * rows * cols)
    for (int64_t b = 0; b < n; ++b) intqat_transpose_f32(src + b * sbs, rows, cols, sld, dst + b * dbs, dld);
}

/* the same for int8 codes, each byte XORed with flip (0: the codes; 0x80: u8 codes q + 128) */
void intqat_transpose_i8_batch(const int8_t *src, int64_t n, int64_t rows, int64_t cols, int64_t sld, int64_t sbs,
                               uint8_t *dst, int64_t dld, int64_t dbs, uint8_t flip) {
    OMP_FOR_IF(n * rows * cols)
    for (int64_t b = 0; b < n; ++b) intqat_transpose_i8(src + b * sbs, rows, cols, sld, dst + b * dbs, dld, flip);
}

/* rows (B * P, N) -> y (B, N, P): each tile of up to 16 rows computed by one row function into a buffer, then
 * transposed into y (the output pass and the NHWC -> NCHW copy in one).
 *   kind 0 (intqat_epilogue's rows): y = float32(acc - z_x * colsum) * (sx * s_w[n]) (+ bias[n])   (epilogue_row)
 *   kind 1 (a float accumulator):    y = accf * scale[n] (+ bias[n])   (_scaled_'s mul_, then add_) */
static void rows_to_nchw(int kind, const int32_t *acc, const float *accf, int64_t B, int64_t P, int64_t N,
                         int32_t z_x, const int32_t *colsum, float sx, const float *s_w, const float *bias, float *y) {
    const int64_t tiles = (P + 15) / 16;
    INTQAT_PRAGMA(omp parallel if (B * P * N >= INTQAT_GRAIN))
    {
        float *buf = (float *)malloc(sizeof(float) * 16 * (N > 0 ? N : 1));
        INTQAT_PRAGMA(omp for schedule(static))
        for (int64_t t = 0; t < B * tiles; ++t) {
            const int64_t b = t / tiles, p0 = t % tiles * 16, rn = P - p0 < 16 ? P - p0 : 16;
            for (int64_t r = 0; r < rn; ++r) {
                const int64_t m = b * P + p0 + r;
                if (kind == 0) {
                    epilogue_row(acc + m * N, N, z_x, colsum, sx, s_w, bias, buf + r * N);
                } else {
                    const float *a = accf + m * N;
                    float *o = buf + r * N;
                    if (bias)
                        for (int64_t n = 0; n < N; ++n) o[n] = a[n] * s_w[n] + bias[n];
                    else
                        for (int64_t n = 0; n < N; ++n) o[n] = a[n] * s_w[n];
                }
            }
            intqat_transpose_f32(buf, rn, N, N, y + b * N * P + p0, P);
        }
        free(buf);
    }
}

void intqat_epilogue_nchw(const int32_t *acc, int64_t B, int64_t P, int64_t N, int32_t z_x, const int32_t *colsum,
                          float sx, const float *s_w, const float *bias, float *y) {
    rows_to_nchw(0, acc, 0, B, P, N, z_x, colsum, sx, s_w, bias, y);
}

void intqat_scale_nchw(const float *acc, int64_t B, int64_t P, int64_t N, const float *scale, const float *bias,
                       float *y) {
    rows_to_nchw(1, 0, acc, B, P, N, 0, 0, 0.0f, scale, bias, y);
}

/* y (B, N, P) in place: y = y * scale[n] (+ bias[n]), _scaled_'s mul_ then add_ in one pass; channels_last: y is
 * (B * P, N) rows instead (the same values, walked in memory order) */
void intqat_scale_channels(float *y, int64_t B, int64_t N, int64_t P, int channels_last, const float *scale,
                           const float *bias) {
    if (channels_last) {
        OMP_FOR_IF(B * P * N)
        for (int64_t m = 0; m < B * P; ++m) {
            float *r = y + m * N;
            if (bias)
                for (int64_t n = 0; n < N; ++n) r[n] = r[n] * scale[n] + bias[n];
            else
                for (int64_t n = 0; n < N; ++n) r[n] = r[n] * scale[n];
        }
        return;
    }
    OMP_FOR_IF(B * P * N)
    for (int64_t t = 0; t < B * N; ++t) {
        float *r = y + t * P;
        const float s = scale[t % N], c = bias ? bias[t % N] : 0.0f;
        if (bias)
            for (int64_t p = 0; p < P; ++p) r[p] = r[p] * s + c;
        else
            for (int64_t p = 0; p < P; ++p) r[p] = r[p] * s;
    }
}

/* intqat_quantize_rows of one row x (n,) with one scale (codes in x's memory order), the clip mask written as bits
 * (intqat_pack_bits' layout) instead of bool bytes: the same codes and bits as those two passes, in one, parallel
 * over chunks of 4096 elements (a per-tensor quantize of a whole activation is one row: intqat_quantize_rows would
 * run it on one thread). */
void intqat_quantize_bits(const float *x, int64_t n, const float *scale, float z, float qmin, float qmax, int8_t *out,
                          uint8_t *bits) {
    enum { CHUNK = 4096 };
    const float inv = 1.0f / scale[0];
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    OMP_FOR_IF(n)
    for (int64_t t = 0; t < chunks; ++t) {
        uint8_t mask[CHUNK];
        const int64_t k0 = t * CHUNK, len = n - k0 < CHUNK ? n - k0 : CHUNK;
        const float *xi = x + k0;
        int8_t *oi = out + k0;
        for (int64_t k = 0; k < len; ++k) {
            const float r = round_shift(xi[k], inv, z);
            const float q = clampf(r, qmin, qmax);
            oi[k] = (int8_t)(int32_t)q;
            mask[k] = (uint8_t)(q == r);
        }
        uint8_t *bi = bits + k0 / 8;
        const int64_t full = len / 8;
        for (int64_t j = 0; j < full; ++j)
            bi[j] = (uint8_t)(((load_u64(mask + 8 * j) & MASK_LOW_BITS) * MASK_GATHER) >> 56);
        if (len % 8) {  /* (the last chunk only: CHUNK is a multiple of 8) */
            uint8_t b = 0;
            for (int64_t k = 8 * full; k < len; ++k) b |= (uint8_t)((mask[k] != 0) << (k - 8 * full));
            bi[full] = b;
        }
    }
}
