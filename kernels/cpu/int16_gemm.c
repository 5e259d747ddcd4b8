/* Exact int8 GEMMs on CPUs without int8 dot-product instructions: AVX2's vpmaddwd.
 *
 * C (M, N) int32 = A (M, K) int8 @ B (K, N) int8, both with any strides. The codes are widened to
 * int16 while packing; vpmaddwd multiplies 16 int16 pairs and adds each adjacent pair into an int32
 * lane: 16 multiply-adds per instruction against an fp32 FMA's 8, and exact (|a b| <= 2^14, a pair
 * sum <= 2^15, no saturation for int8 values). Lanes accumulate in int32 with vpaddd: the same exact
 * sum as torch._int_mm while K * 2^14 <= 2^31 - 1 (the caller splits longer contractions).
 *
 * Packing (per call; weights change every step):
 *   A: panels of MR rows; per pair of contraction indices kp, MR int32 words (a[r][2kp], a[r][2kp+1])
 *   B: panels of 16 columns; per kp, 16 int32 words (b[2kp][n], b[2kp+1][n])
 * The MRx16 micro-kernel (MR = 6 with AVX-512VL's registers, 4 on plain AVX2: see MR) keeps two 8-lane
 * ymm accumulators per row in registers over the whole contraction; rows / columns / K past the
 * matrix are packed as zeros. Threads split the column
 * panels (each packs and owns its panels of B).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "epilogue.h" /* epilogue_row */

#if defined(__AVX2__)
#include <immintrin.h>

int intqat_int16_gemm_available(void) { return 1; }

/* Rows per register tile: each vpmaddwd needs a scratch register before its vpaddd, so a 6x16 tile takes
 * 12 accumulators + 2 B vectors + 1 broadcast + 1 product = all 16 of AVX2's ymm registers, and gcc
 * spills accumulators to the stack inside the loop (an AVX2-only build measured 1.2x fp32 instead of
 * 1.6x). With AVX-512VL's 32 registers 6 rows fit; plain AVX2 takes 4 (8 accumulators; madd_tile says
 * why they are named variables). With madd_row's asm 6 rows would take exactly all 16 registers without a
 * spill: measured within 2% of 4 rows on the Zen 4 (x86-64-v3 build), so 4, which leaves gcc room. The
 * caller sizes A's scratch for either (rows rounded up to 12). */
#if defined(__AVX512VL__)
#define MR_IS_6 1 /* for the preprocessor (madd_tile's named accumulators) */
enum { MR = 6, NR = 16 };
#else
#define MR_IS_6 0
enum { MR = 4, NR = 16 };
#endif

/* a's codes minus z (0 for plain GEMMs; the activation zero point for the grouped forward: |a - z| <= 255,
 * so a product with an int8 code is <= 2^15 and a vpmaddwd pair sum stays in int32) */
static void pack_a(const int8_t *a, int64_t M, int64_t K, int64_t rs, int64_t cs, int64_t kp2, int32_t z, int16_t *ap) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (M + MR - 1) / MR; ++p) {
        int16_t *dst = ap + p * kp2 * MR * 2;
        for (int64_t kp = 0; kp < kp2; ++kp)
            for (int r = 0; r < MR; ++r)
                for (int h = 0; h < 2; ++h) {
                    const int64_t m = p * MR + r, k = 2 * kp + h;
                    *dst++ = (m < M && k < K) ? (int16_t)(a[m * rs + k * cs] - z) : 0;
                }
    }
}

/* 8 x 8 transpose of 32-bit words: in r[i] the words of row i, out r[t] word t of every row. */
static inline void transpose8x8_epi32(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

static inline int16_t b_at(const int8_t *b, int64_t K, int64_t N, int64_t rs, int64_t cs, int64_t k, int64_t n) {
    return (n < N && k < K) ? b[k * rs + n * cs] : 0;
}

/* One 16-column panel of B as kp2 groups of 16 words (b[2kp][n], b[2kp+1][n]). Where each column
 * is contiguous along k (rs == 1: B is the transpose of a row-major weight), 8 columns x 16 k at a
 * time are widened and transposed in registers; the ragged edges element by element. */
static void pack_b_panel(const int8_t *b, int64_t K, int64_t N, int64_t rs, int64_t cs, int64_t kp2, int64_t p,
                         int16_t *dst) {
    int32_t *dst32 = (int32_t *)dst;
    const int64_t n0 = p * NR;
    int64_t done = 0; /* kp groups written by the vector path */
    if (rs == 1 && n0 + NR <= N) {
        done = (K / 16) * 8;
        for (int64_t blk = 0; blk < K / 16; ++blk)
            for (int h = 0; h < 2; ++h) {
                __m256i r[8];
                for (int i = 0; i < 8; ++i)
                    r[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + (n0 + 8 * h + i) * cs + 16 * blk)));
                transpose8x8_epi32(r);
                for (int t = 0; t < 8; ++t) _mm256_storeu_si256((__m256i *)(dst32 + (8 * blk + t) * NR + 8 * h), r[t]);
            }
    }
    for (int64_t kp = done; kp < kp2; ++kp)
        for (int j = 0; j < NR; ++j) {
            dst[(kp * NR + j) * 2] = b_at(b, K, N, rs, cs, 2 * kp, n0 + j);
            dst[(kp * NR + j) * 2 + 1] = b_at(b, K, N, rs, cs, 2 * kp + 1, n0 + j);
        }
}

/* What the micro-kernel does with its MR x 16 block of exact sums: store them (c, int32), or put them
 * through the integer epilogue (epilogue.h, the same row function as the fused epilogue) into y. */
typedef struct {
    int32_t *c;          /* int32 output (M, N), or NULL: epilogue */
    float *y;            /* fp32 output (M, N) */
    int32_t z_x;
    const int32_t *colsum; /* (N,) or NULL */
    const float *s_x;    /* s_x[m * sx_stride] */
    int64_t sx_stride;
    const float *s_w;    /* (N,) */
    const float *bias;   /* (N,) or NULL */
} int16_out;

/* Operand constraint for a ymm register: AVX-512VL's 32 ("v") or AVX2's 16 ("x"). */
#if defined(__AVX512VL__)
#define YMM_REG "v"
#else
#define YMM_REG "x"
#endif

/* One row's step of a tile (plain and grouped): c0 += madd(a pair of k broadcast, b0), c1 += madd(it, b1).
 * In asm, one row at a time, because gcc hoisted all MR broadcasts ahead of the 2 MR products: with
 * 4 broadcasts + 8 products + 8 accumulators live, an AVX2 build spilled one accumulator to the stack
 * inside the group loop (a store-to-load round trip on the critical path every k pair: the kernel
 * measured 1.05-1.3x fp32 at the Llama shapes against the plain int16 linear's 0.4x). Here the tile
 * needs 2 MR accumulators + 2 B vectors + 2 temporaries: 12 of AVX2's 16 registers at MR = 4. */
static inline __attribute__((always_inline)) void madd_row(__m256i *c0, __m256i *c1, const int32_t *a,
                                                           __m256i b0, __m256i b1) {
    __m256i t, p;
    __asm__("vpbroadcastd %[a], %[t]\n\t"
            "vpmaddwd %[b0], %[t], %[p]\n\t"
            "vpaddd %[p], %[c0], %[c0]\n\t"
            "vpmaddwd %[b1], %[t], %[t]\n\t"
            "vpaddd %[t], %[c1], %[c1]"
            : [c0] "+" YMM_REG(*c0), [c1] "+" YMM_REG(*c1), [t] "=&" YMM_REG(t), [p] "=&" YMM_REG(p)
            : [a] "m"(*a), [b0] YMM_REG(b0), [b1] YMM_REG(b1));
}

/* acc = the exact sums over `steps` pairs of k of the MR x 16 block: A's pairs from *a32, B's from *bp
 * (both advanced past them). 2 MR accumulators + 2 B vectors + 2 temporaries (madd_row): 12 of AVX2's
 * 16 registers at MR = 4. The accumulators are named variables, not an array: with acc[MR][2] (the
 * caller's, or a local one) gcc kept the array in memory across madd_row's "m" operand (__m256i may
 * alias the int32 A words) and stored one accumulator (intrinsics) or all 8 (asm) to the stack every
 * k pair. */
static inline __attribute__((always_inline)) void madd_tile(__m256i acc[MR][2], const int32_t **a32,
                                                            const int16_t **bp, int64_t steps) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero, c30 = zero, c31 = zero;
#if MR_IS_6
    __m256i c40 = zero, c41 = zero, c50 = zero, c51 = zero;
#endif
    const int32_t *a = *a32;
    const int16_t *b = *bp;
    for (int64_t kp = 0; kp < steps; ++kp) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 16));
        madd_row(&c00, &c01, a + 0, b0, b1);
        madd_row(&c10, &c11, a + 1, b0, b1);
        madd_row(&c20, &c21, a + 2, b0, b1);
        madd_row(&c30, &c31, a + 3, b0, b1);
#if MR_IS_6
        madd_row(&c40, &c41, a + 4, b0, b1);
        madd_row(&c50, &c51, a + 5, b0, b1);
#endif
        a += MR;
        b += 32;
    }
    acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11;
    acc[2][0] = c20, acc[2][1] = c21, acc[3][0] = c30, acc[3][1] = c31;
#if MR_IS_6
    acc[4][0] = c40, acc[4][1] = c41, acc[5][0] = c50, acc[5][1] = c51;
#endif
    *a32 = a;
    *bp = b;
}

/* epilogue_row (epilogue.h) on a whole MR x 16 tile, 8 lanes per instruction, the same bits: per element
 *   v = acc - z_x * colsum (int32, wrapping: vpmulld / vpsubd keep the low 32 bits as the uint32 arithmetic
 *   does), o = float32(v) * (s_x[m] * s_w[n]) (+ bias[n])
 * with one rounding per operation in that order (vcvtdq2ps rounds to nearest as the scalar cast does;
 * no FMA: mul, then add). Without it the tile went through memory and gcc's vectorized epilogue_row
 * with its alias checks per row: at K = 96 (ConvNeXt's MLP) the fused linear measured 1.32x fp32
 * against the int32 GEMM's 1.55x. */
static inline __attribute__((always_inline)) void epilogue_tile(const __m256i acc[MR][2], const int16_out *out,
                                                                int64_t N, int64_t m0, int64_t n0) {
    const __m256 w0 = _mm256_loadu_ps(out->s_w + n0), w1 = _mm256_loadu_ps(out->s_w + n0 + 8);
    __m256i k0 = _mm256_setzero_si256(), k1 = k0;
    if (out->colsum) {
        const __m256i z = _mm256_set1_epi32(out->z_x);
        k0 = _mm256_mullo_epi32(z, _mm256_loadu_si256((const __m256i *)(out->colsum + n0)));
        k1 = _mm256_mullo_epi32(z, _mm256_loadu_si256((const __m256i *)(out->colsum + n0 + 8)));
    }
    for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_set1_ps(out->s_x[(m0 + r) * out->sx_stride]);
        __m256 o0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], k0)), _mm256_mul_ps(sx, w0));
        __m256 o1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], k1)), _mm256_mul_ps(sx, w1));
        if (out->bias) {
            o0 = _mm256_add_ps(o0, _mm256_loadu_ps(out->bias + n0));
            o1 = _mm256_add_ps(o1, _mm256_loadu_ps(out->bias + n0 + 8));
        }
        float *y = out->y + (m0 + r) * N + n0;
        _mm256_storeu_ps(y, o0);
        _mm256_storeu_ps(y + 8, o1);
    }
}

static inline void kernel_tile(const int16_t *ap, const int16_t *bp, int64_t kp2, const int16_out *out,
                               int64_t N, int64_t m0, int64_t n0, int mr, int nr) {
    __m256i acc[MR][2];
    const int32_t *a32 = (const int32_t *)ap;
    madd_tile(acc, &a32, &bp, kp2);
    if (out->c && mr == MR && nr == NR) {
        int32_t *c = out->c + m0 * N + n0;
        for (int r = 0; r < MR; ++r) {
            _mm256_storeu_si256((__m256i *)(c + r * N), acc[r][0]);
            _mm256_storeu_si256((__m256i *)(c + r * N + 8), acc[r][1]);
        }
        return;
    }
    if (!out->c && mr == MR && nr == NR) { /* epilogue_row's steps 8 lanes at a time, from registers */
        epilogue_tile(acc, out, N, m0, n0);
        return;
    }
    int32_t tile[MR][NR]; /* ragged edges: through memory, element by element */
    for (int r = 0; r < MR; ++r) {
        _mm256_storeu_si256((__m256i *)tile[r], acc[r][0]);
        _mm256_storeu_si256((__m256i *)(tile[r] + 8), acc[r][1]);
    }
    for (int r = 0; r < mr; ++r) {
        if (out->c) {
            memcpy(out->c + (m0 + r) * N + n0, tile[r], (size_t)nr * sizeof(int32_t));
        } else {
            epilogue_row(tile[r], nr, out->z_x, out->colsum ? out->colsum + n0 : NULL, out->s_x[(m0 + r) * out->sx_stride],
                         out->s_w + n0, out->bias ? out->bias + n0 : NULL, out->y + (m0 + r) * N + n0);
        }
    }
}

static void int16_gemm(const int8_t *a, int64_t M, int64_t K, int64_t a_rs, int64_t a_cs, const int8_t *b,
                       int64_t N, int64_t b_rs, int64_t b_cs, int16_t *ap, int16_t *bp, const int16_out *out) {
    const int64_t kp2 = (K + 1) / 2, panels_n = (N + NR - 1) / NR, panels_m = (M + MR - 1) / MR;
    pack_a(a, M, K, a_rs, a_cs, kp2, 0, ap);
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels_n; ++q) {
        int16_t *bq = bp + q * kp2 * NR * 2;
        pack_b_panel(b, K, N, b_rs, b_cs, kp2, q, bq);
        const int nr = (int)(N - q * NR < NR ? N - q * NR : NR);
        for (int64_t p = 0; p < panels_m; ++p) {
            const int mr = (int)(M - p * MR < MR ? M - p * MR : MR);
            kernel_tile(ap + p * kp2 * MR * 2, bq, kp2, out, N, p * MR, q * NR, mr, nr);
        }
    }
}

/* a (M, K): element (m, k) at a[m * a_rs + k * a_cs]; b (K, N): (k, n) at b[k * b_rs + n * b_cs];
 * c (M, N) int32 row-major. ap: scratch of (M rounded up to 6) * (K rounded up to 2) int16;
 * bp: scratch of (N rounded up to 16) * (K rounded up to 2) int16. */
void intqat_int16_gemm(const int8_t *a, int64_t M, int64_t K, int64_t a_rs, int64_t a_cs, const int8_t *b,
                       int64_t N, int64_t b_rs, int64_t b_cs, int16_t *ap, int16_t *bp, int32_t *c) {
    const int16_out out = {c, NULL, 0, NULL, NULL, 0, NULL, NULL};
    int16_gemm(a, M, K, a_rs, a_cs, b, N, b_rs, b_cs, ap, bp, &out);
}

/* The integer linear forward in one pass: y = epilogue(q_x @ q_wᵀ) with q_x (M, K) and q_w (N, K)
 * row-major int8; each MRx16 block of exact sums goes through epilogue_row before it leaves registers
 * and L1, as amx_linear.c does: no int32 accumulator in memory, the same bits. */
void intqat_int16_linear(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N, int32_t z_x,
                         const int32_t *colsum, const float *s_x, int64_t sx_stride, const float *s_w,
                         const float *bias, int16_t *ap, int16_t *bp, float *y) {
    const int16_out out = {NULL, y, z_x, colsum, s_x, sx_stride, s_w, bias};
    int16_gemm(q_x, M, K, K, 1, q_w, N, 1, K, ap, bp, &out);
}
/* The per-group forward (intqat/ops/int_linear_grouped.py; grouped_linear.c has the formulas):
 *   acc_g[m, n] = sum_{k in group g} (q_x[m, k] - z) q_w[n, k]      exact int32, vpmaddwd as above
 *   t[m, n]     = (((0 + p_0) + p_1) + ...) + p_{G-1},  p_g = float32(acc_g) * s_w[n, g]
 *   y[m, n]     = t * s_x[m] (+ b[n])
 * One float32 rounding per operation in this order (mul then add, no FMA): the reference's bits. The
 * MRx16 tile keeps its int32 accumulators in registers over a group, then scales and adds them into
 * t, which stays in L1 (t in registers too would need 24 of AVX2's 16). gs must be even: a group is
 * whole pairs of k. swt (G, Np): s_wT padded to Np = N rounded up to 16. */

/* The per-group tiles' last step: y[r, j] = t[r][j] * s_x[r] (+ b[j]), mul then add, each rounded once, for the
 * tile's mr x nr live part (both per-group kernels below). */
static inline void store_grouped_tile(float t[MR][NR], int mr, int nr, const float *sx, int64_t sx_stride,
                                      const float *bias, float *y, int64_t N) {
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nr; ++j) {
            const float v = t[r][j] * sx[r * sx_stride];
            y[r * N + j] = bias ? v + bias[j] : v;
        }
}

/* gp: pairs of k per group. always_inline so that the caller's constant gp (16: group size 32) unrolls
 * the group loop. */
static inline __attribute__((always_inline)) void kernel_tile_grouped(
    const int16_t *ap, const int16_t *bp, int64_t kp2, const int64_t gp, const float *swt, int64_t Np,
    const float *sx, int64_t sx_stride, const float *bias, float *y, int64_t N, int mr, int nr) {
    float t[MR][NR] __attribute__((aligned(32)));
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) t[r][j] = 0.0f;
    const int32_t *a = (const int32_t *)ap;
    const int16_t *b = bp;
    for (int64_t g = 0; g < kp2 / gp; ++g) {
        __m256i acc[MR][2];
        for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int64_t kp = 0; kp < gp; ++kp) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 16));
            for (int r = 0; r < MR; ++r) madd_row(&acc[r][0], &acc[r][1], a + r, b0, b1);
            a += MR;
            b += 32;
        }
        /* t = t + float32(acc_g) * s_w[n, g]: mul, then add, each rounded once */
        const __m256 s0 = _mm256_loadu_ps(swt + g * Np), s1 = _mm256_loadu_ps(swt + g * Np + 8);
        for (int r = 0; r < MR; ++r) {
            const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), s0);
            const __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), s1);
            _mm256_store_ps(t[r], _mm256_add_ps(_mm256_load_ps(t[r]), p0));
            _mm256_store_ps(t[r] + 8, _mm256_add_ps(_mm256_load_ps(t[r] + 8), p1));
        }
    }
    store_grouped_tile(t, mr, nr, sx, sx_stride, bias, y, N);
}

/* ---- 4-bit weights (8da4w): vpmaddubsw, int16 sums over 32 k ----
 * When every weight code is in [-8, 8] and gs % 4 == 0, each group's exact sum is made with half the
 * multiply instructions: vpmaddubsw multiplies 32 unsigned by signed byte pairs and adds adjacent pairs
 * into 16 int16 lanes. The activations go in as a = q_x + 128 in [0, 255] (an xor with 0x80), so
 *   acc_g[m, n] = sum_{k in g} a[m, k] q_w[n, k] - (128 + z) colsum_g(q_w)[n]          (the same integer)
 * A pair sum is <= 2 * 255 * 8 = 4080 in magnitude (no saturation), and 8 of them (32 k) <= 32640 < 2^15:
 * the int16 lanes add 8 steps of 4 k with vpaddw, then one vpmaddwd by 1 widens them to int32 per column.
 * Per 4 k x 16 columns x row: 2 vpmaddubsw against the vpmaddwd path's 4 (both issue on the same ports).
 * Layouts (bytes): A panels of MR rows, per quad of k kq, MR words (a[r][4kq .. 4kq+3]); B panels of 16
 * columns, per kq 16 words (q_w[n][4kq .. 4kq+3]), then the panel's correction (G, 16) int32. */

/* Every code in [-8, 8]: (w + 8) as an unsigned byte <= 16. */
static int codes_fit_4bit(const int8_t *w, int64_t n) {
    const __m256i eight = _mm256_set1_epi8(8);
    __m256i hi = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        hi = _mm256_max_epu8(hi, _mm256_add_epi8(_mm256_loadu_si256((const __m256i *)(w + i)), eight));
    uint8_t lanes[32];
    _mm256_storeu_si256((__m256i *)lanes, hi);
    int ok = 1;
    for (int j = 0; j < 32; ++j) ok &= lanes[j] <= 16;
    for (; i < n; ++i) ok &= w[i] >= -8 && w[i] <= 8;
    return ok;
}

/* a = q_x + 128 in MR-row panels of 4-byte words; rows past M are 0 (never stored). K % 4 == 0. */
static void pack_a_u8(const int8_t *q_x, int64_t M, int64_t K, uint8_t *ap) {
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < (M + MR - 1) / MR; ++p) {
        uint32_t *dst = (uint32_t *)(ap + p * K * MR);
        for (int64_t kq = 0; kq < K / 4; ++kq)
            for (int r = 0; r < MR; ++r) {
                const int64_t m = p * MR + r;
                uint32_t v = 0;
                if (m < M) {
                    memcpy(&v, q_x + m * K + 4 * kq, 4);
                    v ^= 0x80808080u;
                }
                *dst++ = v;
            }
    }
}

/* Panel p of q_w (N, K row-major) as K/4 lines of 16 words, columns past N 0; then corr (G, 16):
 * (128 + z) * colsum_g per column, colsum made on the packed lines (vpmaddubsw by 1, vpmaddwd by 1). */
static void pack_b_u8(const int8_t *q_w, int64_t N, int64_t K, int64_t gs, int32_t z, int64_t p, uint8_t *dst,
                      int32_t *corr) {
    const int64_t n0 = p * NR;
    uint32_t *d32 = (uint32_t *)dst;
    int64_t done = 0; /* quads written by the vector path: 8 columns x 8 words (32 k) transposed in registers */
    if (n0 + NR <= N) {
        done = (K / 32) * 8;
        for (int64_t blk = 0; blk < K / 32; ++blk)
            for (int h = 0; h < 2; ++h) {
                __m256i r[8];
                for (int i = 0; i < 8; ++i)
                    r[i] = _mm256_loadu_si256((const __m256i *)(q_w + (n0 + 8 * h + i) * K + 32 * blk));
                transpose8x8_epi32(r);
                for (int t = 0; t < 8; ++t) _mm256_storeu_si256((__m256i *)(d32 + (8 * blk + t) * NR + 8 * h), r[t]);
            }
    }
    for (int64_t kq = done; kq < K / 4; ++kq)
        for (int j = 0; j < NR; ++j) {
            uint32_t v = 0;
            if (n0 + j < N) memcpy(&v, q_w + (n0 + j) * K + 4 * kq, 4);
            d32[kq * NR + j] = v;
        }
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1), zc = _mm256_set1_epi32(128 + z);
    const int64_t gq = gs / 4;
    for (int64_t g = 0; g < K / gs; ++g) {
        __m256i c0 = _mm256_setzero_si256(), c1 = _mm256_setzero_si256();
        for (int64_t kq = g * gq; kq < (g + 1) * gq; ++kq) {
            const __m256i b0 = _mm256_loadu_si256((const __m256i *)(dst + kq * 64));
            const __m256i b1 = _mm256_loadu_si256((const __m256i *)(dst + kq * 64 + 32));
            c0 = _mm256_add_epi32(c0, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b0), ones16));
            c1 = _mm256_add_epi32(c1, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, b1), ones16));
        }
        _mm256_storeu_si256((__m256i *)(corr + g * NR), _mm256_mullo_epi32(c0, zc));
        _mm256_storeu_si256((__m256i *)(corr + g * NR + 8), _mm256_mullo_epi32(c1, zc));
    }
}

/* One row's step: h0 += maddubs(a quad of k broadcast, b0), h1 += maddubs(it, b1), int16 lanes. In asm for
 * the reason madd_row is. AT&T order: vpmaddubsw signed, unsigned, dst (the broadcast a is the unsigned). */
static inline __attribute__((always_inline)) void maddubs_row(__m256i *h0, __m256i *h1, const int32_t *a,
                                                              __m256i b0, __m256i b1) {
    __m256i t, p;
    __asm__("vpbroadcastd %[a], %[t]\n\t"
            "vpmaddubsw %[b0], %[t], %[p]\n\t"
            "vpaddw %[p], %[h0], %[h0]\n\t"
            "vpmaddubsw %[b1], %[t], %[t]\n\t"
            "vpaddw %[t], %[h1], %[h1]"
            : [h0] "+" YMM_REG(*h0), [h1] "+" YMM_REG(*h1), [t] "=&" YMM_REG(t), [p] "=&" YMM_REG(p)
            : [a] "m"(*a), [b0] YMM_REG(b0), [b1] YMM_REG(b1));
}

/* gq: quads of k per group (a constant 8 for group size 32: one int16 chunk per group, unrolled). */
static inline __attribute__((always_inline)) void kernel_tile_grouped_u8(
    const uint8_t *ap, const uint8_t *bp, const int32_t *corr, int64_t kq4, const int64_t gq, const float *swt,
    int64_t Np, const float *sx, int64_t sx_stride, const float *bias, float *y, int64_t N, int mr, int nr) {
    float t[MR][NR] __attribute__((aligned(32)));
    for (int r = 0; r < MR; ++r)
        for (int j = 0; j < NR; ++j) t[r][j] = 0.0f;
    const __m256i ones16 = _mm256_set1_epi16(1);
    const int32_t *a = (const int32_t *)ap;
    const uint8_t *b = bp;
    for (int64_t g = 0; g < kq4 / gq; ++g) {
        __m256i acc[MR][2];
        for (int64_t c = 0; c < gq; c += 8) { /* chunks of <= 8 quads: the int16 sums stay below 2^15 */
            __m256i h[MR][2];
            for (int r = 0; r < MR; ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
            const int64_t steps = gq - c < 8 ? gq - c : 8;
            for (int64_t s = 0; s < steps; ++s) {
                const __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
                const __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 32));
                for (int r = 0; r < MR; ++r) maddubs_row(&h[r][0], &h[r][1], a + r, b0, b1);
                a += MR;
                b += 64;
            }
            for (int r = 0; r < MR; ++r)
                for (int i = 0; i < 2; ++i) {
                    const __m256i w = _mm256_madd_epi16(h[r][i], ones16);
                    acc[r][i] = c == 0 ? w : _mm256_add_epi32(acc[r][i], w);
                }
        }
        /* acc_g = sum a q_w - (128 + z) colsum_g; t = t + float32(acc_g) * s_w[n, g], each rounded once */
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)(corr + g * NR));
        const __m256i k1 = _mm256_loadu_si256((const __m256i *)(corr + g * NR + 8));
        const __m256 s0 = _mm256_loadu_ps(swt + g * Np), s1 = _mm256_loadu_ps(swt + g * Np + 8);
        for (int r = 0; r < MR; ++r) {
            const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], k0)), s0);
            const __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], k1)), s1);
            _mm256_store_ps(t[r], _mm256_add_ps(_mm256_load_ps(t[r]), p0));
            _mm256_store_ps(t[r] + 8, _mm256_add_ps(_mm256_load_ps(t[r] + 8), p1));
        }
    }
    store_grouped_tile(t, mr, nr, sx, sx_stride, bias, y, N);
}

static void int16_linear_grouped_u8(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N,
                                    int64_t gs, int32_t z, const float *swt, int64_t Np, const float *s_x,
                                    int64_t sx_stride, const float *bias, uint8_t *ap, uint8_t *bp, float *y) {
    const int64_t kq4 = K / 4, gq = gs / 4, G = K / gs, panels_n = (N + NR - 1) / NR, panels_m = (M + MR - 1) / MR;
    int32_t *corr = (int32_t *)(bp + Np * K); /* after the byte panels: G * Np words fit in the other Np * K bytes */
    pack_a_u8(q_x, M, K, ap);
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels_n; ++q) {
        uint8_t *bq = bp + q * K * NR;
        int32_t *cq = corr + q * G * NR;
        pack_b_u8(q_w, N, K, gs, z, q, bq, cq);
        const int nr = (int)(N - q * NR < NR ? N - q * NR : NR);
        for (int64_t p = 0; p < panels_m; ++p) {
            const int mr = (int)(M - p * MR < MR ? M - p * MR : MR);
            const uint8_t *ar = ap + p * K * MR;
            const float *sxr = s_x + p * MR * sx_stride, *br = bias ? bias + q * NR : NULL;
            float *yr = y + p * MR * N + q * NR;
            if (gq == 8) /* group size 32 (8da4w's) */
                kernel_tile_grouped_u8(ar, bq, cq, kq4, 8, swt + q * NR, Np, sxr, sx_stride, br, yr, N, mr, nr);
            else
                kernel_tile_grouped_u8(ar, bq, cq, kq4, gq, swt + q * NR, Np, sxr, sx_stride, br, yr, N, mr, nr);
        }
    }
}

/* q_x (M, K), q_w (N, K) row-major int8; group size gs (even, dividing K); z the activation zero point;
 * s_x[m * sx_stride]; swt (G, Np) as above; bias (N,) or NULL; y (M, N). ap / bp: int16 scratch of
 * (M rounded up to 6) * K and (N rounded up to 16) * K. */
void intqat_int16_linear_grouped(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N,
                                 int64_t gs, int32_t z, const float *swt, int64_t Np, const float *s_x,
                                 int64_t sx_stride, const float *bias, int16_t *ap, int16_t *bp, float *y) {
    if (gs % 4 == 0 && codes_fit_4bit(q_w, N * K)) { /* 4-bit weight codes: the vpmaddubsw kernel above */
        int16_linear_grouped_u8(q_x, M, K, q_w, N, gs, z, swt, Np, s_x, sx_stride, bias, (uint8_t *)ap,
                                (uint8_t *)bp, y);
        return;
    }
    const int64_t kp2 = K / 2, gp = gs / 2, panels_n = (N + NR - 1) / NR, panels_m = (M + MR - 1) / MR;
    pack_a(q_x, M, K, K, 1, kp2, z, ap);
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < panels_n; ++q) {
        int16_t *bq = bp + q * kp2 * NR * 2;
        pack_b_panel(q_w, K, N, 1, K, kp2, q, bq);
        const int nr = (int)(N - q * NR < NR ? N - q * NR : NR);
        for (int64_t p = 0; p < panels_m; ++p) {
            const int mr = (int)(M - p * MR < MR ? M - p * MR : MR);
            const int16_t *ar = ap + p * kp2 * MR * 2;
            const float *sxr = s_x + p * MR * sx_stride, *br = bias ? bias + q * NR : NULL;
            float *yr = y + p * MR * N + q * NR;
            if (gp == 16) /* group size 32 (8da4w's): the group loop unrolled */
                kernel_tile_grouped(ar, bq, kp2, 16, swt + q * NR, Np, sxr, sx_stride, br, yr, N, mr, nr);
            else
                kernel_tile_grouped(ar, bq, kp2, gp, swt + q * NR, Np, sxr, sx_stride, br, yr, N, mr, nr);
        }
    }
}
#else
int intqat_int16_gemm_available(void) { return 0; }
void intqat_int16_linear_grouped(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N,
                                 int64_t gs, int32_t z, const float *swt, int64_t Np, const float *s_x,
                                 int64_t sx_stride, const float *bias, int16_t *ap, int16_t *bp, float *y) {
    (void)q_x; (void)M; (void)K; (void)q_w; (void)N; (void)gs; (void)z; (void)swt; (void)Np; (void)s_x;
    (void)sx_stride; (void)bias; (void)ap; (void)bp; (void)y;
    abort(); /* never called: intqat_int16_gemm_available() says 0 */
}
void intqat_int16_linear(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N, int32_t z_x,
                         const int32_t *colsum, const float *s_x, int64_t sx_stride, const float *s_w,
                         const float *bias, int16_t *ap, int16_t *bp, float *y) {
    (void)q_x; (void)M; (void)K; (void)q_w; (void)N; (void)z_x; (void)colsum; (void)s_x; (void)sx_stride;
    (void)s_w; (void)bias; (void)ap; (void)bp; (void)y;
    abort(); /* never called: intqat_int16_gemm_available() says 0 */
}
void intqat_int16_gemm(const int8_t *a, int64_t M, int64_t K, int64_t a_rs, int64_t a_cs, const int8_t *b,
                       int64_t N, int64_t b_rs, int64_t b_cs, int16_t *ap, int16_t *bp, int32_t *c) {
    (void)a; (void)M; (void)K; (void)a_rs; (void)a_cs; (void)b; (void)N; (void)b_rs; (void)b_cs;
    (void)ap; (void)bp; (void)c;
    abort(); /* never called: intqat_int16_gemm_available() says 0 */
}
#endif
