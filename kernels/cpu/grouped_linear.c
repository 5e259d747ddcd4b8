/* The per-group integer linear forward on the CPU (intqat/ops/int_linear_grouped.py), one pass:
 *
 *   acc_g[m, n] = sum_{k in group g} (q_x[m, k] - z_x) * q_w[n, k]          int32, exact
 *   t[m, n]     = (...((p_0 + p_1) + p_2) + ... ) + p_{G-1},  p_g = float32(acc_g[m, n]) * s_w[n, g]
 *   y[m, n]     = t[m, n] * s_x[m] + b[n]
 *
 * Every product and sum is rounded to float32 once, in exactly this order (compiled with
 * -ffp-contract=off: no FMA), so y equals the torch reference of int_linear_grouped.py bit for bit.
 * The int32 sum of one group never reaches memory: it is scaled and added into t inside the K loop.
 *
 * With AVX512-VNNI, VPDPBUSD multiplies unsigned by signed bytes: the activation codes go in as
 * q_x + 128 (an xor with 0x80), and the kernel subtracts (128 + z_x) * colsum_g(q_w)[n] from each
 * group's sum, which gives the same exact integer. Without VNNI, intqat_grouped_linear_f32 multiplies
 * the codes as fp32 (exact: every product and partial sum is an integer below 2^24), same numbers.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512VNNI__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NB 16 /* output columns per zmm */

int intqat_grouped_has_vnni(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

/* q_w (N, K) int8 (row stride ldw) -> bp (Np/16, K/4, 16, 4): each 64-byte line holds four
 * consecutive k of 16 output channels, the operand layout of VPDPBUSD; padded columns are 0.
 * cs (G, Np) int32: colsum of each group's codes per column. Needs K % 4 == 0, Np % 32 == 0. */
void intqat_grouped_pack(const int8_t *q_w, int64_t N, int64_t K, int64_t ldw, int64_t gs, int64_t Np,
                         int8_t *bp, int32_t *cs) {
    const int64_t KQ = K / 4, G = K / gs;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < Np / NB; nb++) {
        int8_t *dst = bp + nb * KQ * 64;
        for (int64_t kq = 0; kq < KQ; kq++)
            for (int64_t j = 0; j < NB; j++) {
                int64_t n = nb * NB + j;
                for (int64_t i = 0; i < 4; i++)
                    dst[kq * 64 + j * 4 + i] = n < N ? q_w[n * ldw + kq * 4 + i] : 0;
            }
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < NB; j++) {
                int64_t n = nb * NB + j;
                int32_t s = 0;
                if (n < N)
                    for (int64_t k = g * gs; k < (g + 1) * gs; k++) s += q_w[n * ldw + k];
                cs[g * Np + n] = s;
            }
    }
}

/* The min-max weight pass of the training step (train_grouped.cpp), whole rows at a time, in place of
 * intqat_quantize_rows_dynamic over the (N * G, gs) view and then intqat_grouped_pack: for each (n, g)
 *     s = max|W[n, group g]| / qmax, then s < eps ? eps : s       (absmax on the bit patterns: NaN wins)
 *     q = clamp(nearbyint(W * float32(1 / s)), qmin, qmax)          as int8
 * the same float32 operations as fused.c's pass (so the same codes and scales, bit for bit; the clamp keeps a
 * NaN, which truncates to code 0 as the scalar cast does), written as
 *     q_w (N, K) int8 (what backward dequantizes), s_w (N, G), and the kernel's operands: bp and cs as
 *     intqat_grouped_pack writes them, swt (G, Np) = s_wᵀ padded with zeros.
 * Why: rows of 32 cost fused.c's pass a row setup each (absmax, reductions, prologue / epilogue of the
 * vector loop) and the pack a byte at a time: together about the VNNI GEMM's own time at 128x256x768; and per
 * row, the two horizontal reductions and two scalar divisions of each group cost as much as its 32 codes
 * (hence sixteen rows at a time, below).
 * cs NULL: no column sums (the AMX kernel reads them only with a zero point).
 * AVX-512 (F, BW): 16 lanes, gs a multiple of 16; the caller (train_grouped.cpp) checks
 * intqat_grouped_quantize_available() and otherwise runs the two passes. Np % 32 == 0. */
int intqat_grouped_quantize_available(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Index vectors of _mm512_permutex2var_epi32 (lanes 16-31 are the second operand's 0-15).
 * REDUCE_*[r]: round r of reduce16 turns vectors of R = 2^r rows x P = 16 / R partial results into vectors of 2R
 * rows x P / 2, keeping the rows in order: row r' of the pair (r' < R: the first vector's row r', else the second's
 * row r' - R), partial p' at lane r' P / 2 + p' takes partials p' (LO) and p' + P / 2 (HI) of that row.
 * TRANSPOSE_*[r]: round b = 2^r of a 16 x 16 int32 transpose, rows i and i + b (i & b == 0): the off-diagonal
 * b-wide blocks swap (the four rounds compose to the transpose; amx_linear.c's pack uses the same rounds). */
static const int32_t REDUCE_LO[4][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
static const int32_t REDUCE_HI[4][16] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
    {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
static const int32_t TRANSPOSE_LO[4][16] = {
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}};
static const int32_t TRANSPOSE_HI[4][16] = {
    {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
    {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}};

/* v[j] (16 lanes each, j < 16) -> one vector whose lane j is the unsigned max (is_max) or the sum of v[j]'s lanes:
 * 15 pairings of two permutes and one max / add, where a reduction per vector costs ~8 operations each. */
static inline __attribute__((always_inline)) __m512i reduce16(__m512i v[16], int is_max) {
    for (int r = 0, n = 16; n > 1; ++r, n /= 2) {
        const __m512i lo = _mm512_loadu_si512((const void *)REDUCE_LO[r]);
        const __m512i hi = _mm512_loadu_si512((const void *)REDUCE_HI[r]);
        for (int i = 0; i < n / 2; ++i) {
            const __m512i a = _mm512_permutex2var_epi32(v[2 * i], lo, v[2 * i + 1]);
            const __m512i b = _mm512_permutex2var_epi32(v[2 * i], hi, v[2 * i + 1]);
            v[i] = is_max ? _mm512_max_epu32(a, b) : _mm512_add_epi32(a, b);
        }
    }
    return v[0];
}

static inline __attribute__((always_inline)) void transpose16(__m512i v[16]) {
    for (int r = 0, b = 1; r < 4; ++r, b *= 2) {
        const __m512i lo = _mm512_loadu_si512((const void *)TRANSPOSE_LO[r]);
        const __m512i hi = _mm512_loadu_si512((const void *)TRANSPOSE_HI[r]);
        for (int i = 0; i < 16; ++i) {
            if (i & b) continue;
            const __m512i x = v[i], y = v[i + b];
            v[i] = _mm512_permutex2var_epi32(x, lo, y);
            v[i + b] = _mm512_permutex2var_epi32(x, hi, y);
        }
    }
}
#endif

/* Sixteen rows (one column block of bp) at a time: each group's 16 absolute maxima and 16 code sums are reduced
 * together (reduce16), the 16 scales and their reciprocals are one vector division each (IEEE: the bits of the
 * scalar divisions), swt's and cs's 16 columns are one store each, and the block's codes are packed by 16 x 16
 * int32 transposes of 64-byte row chunks (a chunk of 16 rows is 16 lines of bp). The per-element operations are
 * the same float32 operations as before; the clamp is max(lo, r) then min(hi, .) (MAXPS / MINPS return their
 * second operand when one is NaN: a NaN stays NaN, as the compare-and-blend kept it), and the "+ 0.0f" that made
 * -0 into +0 is gone: both convert to code 0. */
void intqat_grouped_quantize_pack(const float *w, int64_t N, int64_t K, int64_t gs, float qmin, float qmax,
                                  float eps, int8_t *q_w, float *s_w, int8_t *bp, int32_t *cs, float *swt,
                                  int64_t Np) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const int64_t G = K / gs, KQ = K / 4;
    const __m512i keep = _mm512_set1_epi32(0x7fffffff);
    const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax), vqmax = _mm512_set1_ps(qmax);
    const __m512 veps = _mm512_set1_ps(eps), one = _mm512_set1_ps(1.0f);
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t nb = 0; nb < Np / NB; nb++) {
        const int64_t n0 = nb * NB;
        const int rows = N - n0 >= NB ? NB : N - n0 > 0 ? (int)(N - n0) : 0;
        const __mmask16 valid = (__mmask16)((1u << rows) - 1);
        for (int64_t g = 0; g < G; g++) {
            __m512i v[16];
            for (int j = 0; j < 16; j++) {
                __m512i m = _mm512_setzero_si512();
                const float *wg = w + (n0 + j) * K + g * gs;
                if (j < rows)
                    for (int64_t c = 0; c < gs; c += 16)
                        m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_loadu_si512((const void *)(wg + c)), keep));
                v[j] = m;
            }
            const __m512 amax = _mm512_castsi512_ps(reduce16(v, 1));
            __m512 s = _mm512_div_ps(amax, vqmax);
            s = _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(s, veps, _CMP_LT_OQ), veps);
            _mm512_storeu_ps(swt + g * Np + n0, _mm512_maskz_mov_ps(valid, s)); /* padded columns: 0 */
            __attribute__((aligned(64))) float sv[16], iv[16];
            _mm512_store_ps(sv, s);
            _mm512_store_ps(iv, _mm512_div_ps(one, s));
            for (int j = 0; j < 16; j++) {
                __m512i sum = _mm512_setzero_si512();
                if (j < rows) {
                    s_w[(n0 + j) * G + g] = sv[j];
                    const __m512 inv = _mm512_set1_ps(iv[j]);
                    const float *wg = w + (n0 + j) * K + g * gs;
                    int8_t *qg = q_w + (n0 + j) * K + g * gs;
                    for (int64_t c = 0; c < gs; c += 16) {
                        /* nearbyint (VRNDSCALEPS 0x0C: current mode, no exception, as gcc's nearbyintf) */
                        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(wg + c), inv), 0x0C);
                        const __m512i code = _mm512_cvttps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, r)));
                        _mm_storeu_si128((__m128i *)(qg + c), _mm512_cvtepi32_epi8(code)); /* NaN: low byte 0 */
                        if (cs) sum = _mm512_add_epi32(sum, _mm512_srai_epi32(_mm512_slli_epi32(code, 24), 24));
                    }
                }
                v[j] = sum;
            }
            if (cs) _mm512_storeu_si512((void *)(cs + g * Np + n0), reduce16(v, 0));
        }
        /* the block's 16 rows of codes -> bp: 64-byte chunks of K, transposed as 16 x 16 int32 (zero past N, K) */
        int8_t *dst = bp + nb * KQ * 64;
        for (int64_t k0 = 0; k0 < K; k0 += 64) {
            const __mmask64 cols = k0 + 64 <= K ? ~(__mmask64)0 : ((__mmask64)1 << (K - k0)) - 1;
            __m512i v[16];
            for (int j = 0; j < 16; j++)
                v[j] = j < rows ? _mm512_maskz_loadu_epi8(cols, q_w + (n0 + j) * K + k0) : _mm512_setzero_si512();
            transpose16(v);
            const int64_t lines = (K - k0) / 4 < 16 ? (K - k0) / 4 : 16;
            for (int64_t i = 0; i < lines; i++) _mm512_storeu_si512((void *)(dst + (k0 / 4 + i) * 64), v[i]);
        }
    }
#else
    (void)w; (void)N; (void)K; (void)gs; (void)qmin; (void)qmax; (void)eps; (void)q_w; (void)s_w; (void)bp;
    (void)cs; (void)swt; (void)Np;
#endif
}

/* w_hat (N, K) fp32 = (float32(q_w) - 0) * s_w[n, g(k)]: fused.c's intqat_dequantize_rows over the (N * G, gs)
 * view (z = 0), whole rows at a time; the same two float32 operations per element. */
void intqat_grouped_dequantize(const int8_t *q_w, int64_t N, int64_t K, int64_t gs, const float *s_w, float *w_hat) {
    const int64_t G = K / gs;
#pragma omp parallel for schedule(static) if (N * K >= 32768)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) {
            const float s = s_w[n * G + g];
            const int8_t *q = q_w + n * K + g * gs;
            float *o = w_hat + n * K + g * gs;
            int64_t k = 0;
#if defined(__AVX512F__)
            const __m512 vs = _mm512_set1_ps(s), zero = _mm512_setzero_ps();
            for (; k + 16 <= gs; k += 16) {
                const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k))));
                _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_sub_ps(f, zero), vs));
            }
#endif
            for (; k < gs; k++) o[k] = ((float)q[k] - 0.0f) * s;
        }
}

#ifdef __AVX512VNNI__
/* mr (<= 4) rows x 32 columns (two zmm) of y. bp: this column block's packed codes; the second
 * 16 columns start bstride bytes later. swt, cs: (G, Np) at column n0. */
static inline __attribute__((always_inline)) void tile_vnni(const int mr, const int8_t *qx, int64_t ldx, const int8_t *bp, int64_t bstride,
                             int64_t K, int64_t gs, const int32_t *cs, const float *swt, int64_t Np, int32_t z,
                             const float *sx, int64_t sx_stride, const float *bias, float *y, int64_t ldy,
                             int64_t ncols) {
    __m512 t[4][2];
    for (int r = 0; r < 4; r++) t[r][0] = t[r][1] = _mm512_setzero_ps();
    const __m512i flip = _mm512_set1_epi32((int32_t)0x80808080);
    const __m512i zc = _mm512_set1_epi32(128 + z);
    const int64_t G = K / gs, QG = gs / 4;
    for (int64_t g = 0; g < G; g++) {
        __m512i a[4][2];
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm512_setzero_si512();
        const int8_t *b = bp + g * QG * 64;
        for (int64_t q = 0; q < QG; q++) {
            __m512i b0 = _mm512_loadu_si512((const void *)(b + q * 64));
            __m512i b1 = _mm512_loadu_si512((const void *)(b + bstride + q * 64));
            int64_t k = (g * QG + q) * 4;
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                int32_t xv;
                memcpy(&xv, qx + r * ldx + k, 4);
                __m512i xb = _mm512_xor_si512(_mm512_set1_epi32(xv), flip); /* q_x + 128 as u8 */
                a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, b0);
                a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, b1);
            }
        }
        /* acc_g = a - (128 + z) * colsum_g: the exact group sum of (q_x - z) * q_w */
        __m512i c0 = _mm512_mullo_epi32(zc, _mm512_loadu_si512((const void *)(cs + g * Np)));
        __m512i c1 = _mm512_mullo_epi32(zc, _mm512_loadu_si512((const void *)(cs + g * Np + NB)));
        __m512 s0 = _mm512_loadu_ps(swt + g * Np), s1 = _mm512_loadu_ps(swt + g * Np + NB);
        for (int r = 0; r < mr; r++) {
            t[r][0] = _mm512_add_ps(t[r][0], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][0], c0)), s0));
            t[r][1] = _mm512_add_ps(t[r][1], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][1], c1)), s1));
        }
    }
    __mmask16 m0 = ncols >= NB ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
    __mmask16 m1 = ncols >= 2 * NB ? (__mmask16)0xFFFF : ncols > NB ? (__mmask16)((1u << (ncols - NB)) - 1) : 0;
    for (int r = 0; r < mr; r++) {
        __m512 s = _mm512_set1_ps(sx[r * sx_stride]);
        __m512 y0 = _mm512_mul_ps(t[r][0], s), y1 = _mm512_mul_ps(t[r][1], s);
        if (bias) {
            y0 = _mm512_add_ps(y0, _mm512_maskz_loadu_ps(m0, bias));
            y1 = _mm512_add_ps(y1, _mm512_maskz_loadu_ps(m1, bias + NB));
        }
        _mm512_mask_storeu_ps(y + r * ldy, m0, y0);
        _mm512_mask_storeu_ps(y + r * ldy + NB, m1, y1);
    }
}
#endif

/* y (M, N) fp32 (row stride ldy). q_x (M, K) row stride ldx. bp, cs from intqat_grouped_pack;
 * swt (G, Np) fp32: s_w transposed, padded with zeros. s_x (M,) with stride sx_stride (0: one scale).
 * bias (N,) or NULL. */
void intqat_grouped_linear_vnni(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const int8_t *bp,
                                const int32_t *cs, const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z,
                                const float *s_x, int64_t sx_stride, const float *bias, float *y, int64_t ldy) {
#ifdef __AVX512VNNI__
    const int64_t MB = (M + 3) / 4, NBLK = Np / (2 * NB), bstride = (K / 4) * 64;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t j = 0; j < NBLK; j++)
        for (int64_t i = 0; i < MB; i++) {
            int64_t m0 = i * 4, n0 = j * 2 * NB;
            int mr = (int)(M - m0 < 4 ? M - m0 : 4);
            int64_t ncols = N - n0 < 2 * NB ? N - n0 : 2 * NB;
            /* mr as a literal: the accumulator arrays then live in registers */
#define TILE(MR) tile_vnni(MR, q_x + m0 * ldx, ldx, bp + (n0 / NB) * bstride, bstride, K, gs, cs + n0, swt + n0, Np, \
                           z, s_x + m0 * sx_stride, sx_stride, bias ? bias + n0 : NULL, y + m0 * ldy + n0, ldy, ncols)
            switch (mr) {
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
            }
#undef TILE
        }
#else
    (void)q_x; (void)M; (void)K; (void)ldx; (void)bp; (void)cs; (void)swt; (void)N; (void)Np; (void)gs; (void)z;
    (void)s_x; (void)sx_stride; (void)bias; (void)y; (void)ldy;
#endif
}

/* Without int8 dot products: the codes as fp32 and fp32 multiply-adds. Each product is an integer of
 * magnitude <= 2^14 and each group's partial sum one of magnitude <= gs * 2^14 <= 2^24, so every fp32
 * operation is exact and acc equals the int32 group sum (docs/numerics.md, "Exact int8 products on fp32 units").
 * wt (K, Np) fp32: q_w transposed, padded with zero columns; swt (G, Np) as above. Tiles of 4 rows x 64
 * columns with literal bounds, so the compiler keeps them in vector registers. */
#define NF 64
static inline __attribute__((always_inline)) void tile_f32(const int mr, const int8_t *qx, int64_t ldx,
                                                           const float *wt, int64_t Np, int64_t K, int64_t gs,
                                                           const float *swt, int32_t z, const float *sx,
                                                           int64_t sx_stride, const float *bias, float *y,
                                                           int64_t ldy, int64_t ncols) {
    float t[4][NF], acc[4][NF];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < NF; j++) t[r][j] = 0.0f;
    const int64_t G = K / gs;
    for (int64_t g = 0; g < G; g++) {
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < NF; j++) acc[r][j] = 0.0f;
        for (int64_t k = g * gs; k < (g + 1) * gs; k++) {
            const float *w = wt + k * Np;
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const float xv = (float)((int32_t)qx[r * ldx + k] - z);
                /* an FMA rounds nothing here: product and sum are integers below 2^24 */
                for (int j = 0; j < NF; j++) acc[r][j] = __builtin_fmaf(xv, w[j], acc[r][j]);
            }
        }
        const float *s = swt + g * Np;
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < NF; j++) t[r][j] = t[r][j] + acc[r][j] * s[j];
    }
    for (int r = 0; r < mr; r++)
        for (int64_t j = 0; j < ncols; j++) {
            float v = t[r][j] * sx[r * sx_stride];
            y[r * ldy + j] = bias ? v + bias[j] : v;
        }
}

void intqat_grouped_linear_f32(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const float *wt,
                               const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z, const float *s_x,
                               int64_t sx_stride, const float *bias, float *y, int64_t ldy) {
    const int64_t MB = (M + 3) / 4, NBLK = Np / NF;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t j = 0; j < NBLK; j++)
        for (int64_t i = 0; i < MB; i++) {
            int64_t m0 = i * 4, n0 = j * NF;
            int mr = (int)(M - m0 < 4 ? M - m0 : 4);
            int64_t ncols = N - n0 < NF ? N - n0 : NF;
#define TILE(MR) tile_f32(MR, q_x + m0 * ldx, ldx, wt + n0, Np, K, gs, swt + n0, z, s_x + m0 * sx_stride, sx_stride, \
                          bias ? bias + n0 : NULL, y + m0 * ldy + n0, ldy, ncols)
            switch (mr) {
            case 4: TILE(4); break;
            case 3: TILE(3); break;
            case 2: TILE(2); break;
            default: TILE(1); break;
            }
#undef TILE
        }
}
