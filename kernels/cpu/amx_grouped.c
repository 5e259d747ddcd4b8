/* The per-group integer linear forward (8da4w) on Intel AMX tiles: grouped_linear.c's formulas, bits and operands.
 *
 *   acc_g[m, n] = sum_{k in group g} q_x[m, k] * q_w[n, k]  -  z_x * colsum_g(q_w)[n]     int32, exact
 *   t[m, n]     = (...((0 + p_0) + p_1) + ...) + p_{G-1},  p_g = float32(acc_g[m, n]) * s_w[n, g]
 *   y[m, n]     = t[m, n] * s_x[m] (+ b[n])
 * the same float32 operations in the same order as intqat_grouped_linear_vnni (compiled with -ffp-contract=off),
 * so the same bits as it and as the reference (intqat/ops/int_linear_grouped.py).
 *
 * Why: the VNNI kernel spends ~8 VPDPBUSD (and the activation broadcasts) per 16 outputs and group of 32; one
 * TDPBSSD makes a 16x16 block of a group's sums, so what is left per 16 outputs and group is the float32 step
 * (convert, multiply, add) the formula needs anyway. Each 16x16 output block keeps t in 16 zmm registers over
 * all groups; a group's int32 tile goes through a 1 KB buffer in L1 (tiles cannot be read into zmm directly).
 * Four accumulator tiles take four groups at a time: they are stored, the next four queued on the tile unit,
 * and the stored four scaled meanwhile. Measured (2-core 4th-gen Xeon, 1 thread, 128 x 256 x 768, group 32):
 * 0.58x of the VNNI kernel; ~55 cycles per 16x16 block and group, of which the tile stores alone take ~20 and
 * the tile loads and products ~10 (they do not overlap the vector work much: a 32x32 blocking would halve the
 * tile loads but put t in memory, whose loads and stores cost more).
 *
 * Operands (as intqat_grouped_linear_vnni takes them, from intqat_grouped_pack / intqat_grouped_quantize_pack):
 *   q_x  int8 (M, K), row stride ldx    activation codes (signed: TDPBSSD multiplies signed by signed bytes)
 *   bp   int8 (Np / 16, K / 4, 16, 4)   q_w packed: each 64-byte line four consecutive k of 16 columns, which is
 *                                       AMX's B layout (amx.h): a group's B tile is gs / 4 lines, stride 64
 *   cs   int32 (G, Np), swt fp32 (G, Np)  group column sums (read only when z_x != 0), s_wᵀ padded with zeros
 * One tile step contracts `depth` bytes: gs itself when gs <= 64, else the largest multiple of 4 <= 64 dividing gs
 * (so K = 32, 64, 96 ... all run; gs % 4 == 0). Rows past M: the last partial block of rows is read from a
 * zero-padded 16-row copy; columns past N are computed (zero codes) and not written.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h" /* INTQAT_HAVE_AMX, intqat_tile_config, intqat_amx_available */

#ifdef INTQAT_HAVE_AMX

int intqat_amx_grouped_available(void) { return intqat_amx_available(); }

/* the contraction bytes of one tile step (see above) */
static int64_t tile_depth(int64_t gs) {
    if (gs <= 64) return gs;
    for (int64_t d = 64; d > 4; d -= 4)
        if (gs % d == 0) return d;
    return 4;
}

/* Tiles 0-3: int32 accumulators (16 x 16); 4-5: A, 16 rows x depth bytes; 6-7: B, depth / 4 rows x 64 bytes. */
static void configure_grouped_tiles(int64_t depth) {
    intqat_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 4; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    for (int i = 4; i < 6; ++i) { cfg.colsb[i] = (uint16_t)depth; cfg.rows[i] = 16; }
    for (int i = 6; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = (uint8_t)(depth / 4); }
    _tile_loadconfig(&cfg);
}

/* Group g's int32 sums (16 x 16) into tile T, through A tile TA and B tile TB (tile numbers: literals). */
#define GROUP_PRODUCT(T, TA, TB, g)                                            \
    do {                                                                       \
        _tile_zero(T);                                                         \
        for (int64_t s_ = 0; s_ < gs; s_ += depth) {                           \
            const int64_t k_ = (g) * gs + s_;                                  \
            _tile_loadd(TA, a + k_, lda);                                      \
            _tile_loadd(TB, b + k_ * 16, 64); /* k / 4 lines of 64 bytes */    \
            _tile_dpbssd(T, TA, TB);                                           \
        }                                                                      \
    } while (0)

/* t[r] = t[r] + float32(acc[r] - z cs) * s, r < 16: p_g added in group order (the formula's float32 steps) */
static inline __attribute__((always_inline)) void scale_add(__m512 t[16], const int32_t acc[16][16], int32_t z,
                                                            const int32_t *cs, const float *sw) {
    const __m512 s = _mm512_loadu_ps(sw);
    if (z) {
        const __m512i zc = _mm512_mullo_epi32(_mm512_set1_epi32(z), _mm512_loadu_si512((const void *)cs));
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
            t[r] = _mm512_add_ps(t[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(
                                                         _mm512_load_si512((const void *)acc[r]), zc)), s));
    } else {
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r)
            t[r] = _mm512_add_ps(t[r], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)acc[r])), s));
    }
}

/* Groups g0 .. g0 + 3 (those below G) into tiles 0-3, alternating the operand tiles. */
#define GROUPS_OF_FOUR(g0)                                     \
    do {                                                       \
        GROUP_PRODUCT(0, 4, 6, g0);                            \
        if ((g0) + 1 < G) GROUP_PRODUCT(1, 5, 7, (g0) + 1);    \
        if ((g0) + 2 < G) GROUP_PRODUCT(2, 4, 6, (g0) + 2);    \
        if ((g0) + 3 < G) GROUP_PRODUCT(3, 5, 7, (g0) + 3);    \
    } while (0)

/* One 16 x 16 block of y: rows of a (16 readable rows, stride lda), b the column block's packed codes; cs, swt at
 * the block's first column (row stride Np); y at the block's corner; `rows` x `cols` of it are written.
 * Groups go four at a time: their tiles are stored to acc, the next four are queued on the tile unit, and the
 * stored four are scaled into t meanwhile (in group order). */
static void block_16x16(const int8_t *a, int64_t lda, const int8_t *b, int64_t G, int64_t gs, int64_t depth,
                        const int32_t *cs, const float *swt, int64_t Np, int32_t z, const float *sx,
                        int64_t sx_stride, const float *bias, float *y, int64_t ldy, int rows, int cols) {
    __attribute__((aligned(64))) int32_t acc[4][16][16];
    __m512 t[16];
    for (int r = 0; r < 16; ++r) t[r] = _mm512_setzero_ps();
    if (G > 0) GROUPS_OF_FOUR(0); /* (K = 0: no groups, t stays 0, y = 0 * s_x + b as the VNNI kernel's) */
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t n = G - g0 < 4 ? G - g0 : 4;
        _tile_stored(0, acc[0], 64);
        if (n > 1) _tile_stored(1, acc[1], 64);
        if (n > 2) _tile_stored(2, acc[2], 64);
        if (n > 3) _tile_stored(3, acc[3], 64);
        if (g0 + 4 < G) GROUPS_OF_FOUR(g0 + 4);
        for (int64_t j = 0; j < n; ++j)
            scale_add(t, acc[j], z, z ? cs + (g0 + j) * Np : NULL, swt + (g0 + j) * Np); /* (cs: NULL without z) */
    }
    const __mmask16 m = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; ++r) {
        __m512 v = _mm512_mul_ps(t[r], _mm512_set1_ps(sx[r * sx_stride]));
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
        _mm512_mask_storeu_ps(y + r * ldy, m, v);
    }
}

/* y (M, N) fp32 (row stride ldy); the operands as intqat_grouped_linear_vnni's (same signature). gs % 4 == 0,
 * Np % 16 == 0; call only where intqat_amx_grouped_available(). */
void intqat_amx_grouped_linear(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const int8_t *bp,
                               const int32_t *cs, const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z,
                               const float *s_x, int64_t sx_stride, const float *bias, float *y, int64_t ldy) {
    if (M <= 0 || N <= 0) return;
    const int64_t G = K / gs, depth = tile_depth(gs), full = M / 16, row_blocks = (M + 15) / 16;
    const int64_t col_blocks = (N + 15) / 16, bstride = (K / 4) * 64;
    int8_t *tail = NULL; /* the last M % 16 rows, zero-padded to 16: no tile load reads past q_x */
    if (M % 16 && K > 0) {
        tail = (int8_t *)calloc((size_t)(16 * K), 1);
        if (!tail) abort();
        for (int64_t r = 0; r < M % 16; ++r) memcpy(tail + r * K, q_x + (full * 16 + r) * ldx, (size_t)K);
    }
#pragma omp parallel if (M * N * K >= 65536)
    {
        configure_grouped_tiles(depth);
        /* column blocks outermost: a thread's share of bp stays in its cache (the pack splits the same way) */
#pragma omp for collapse(2) schedule(static)
        for (int64_t cb = 0; cb < col_blocks; ++cb)
            for (int64_t rb = 0; rb < row_blocks; ++rb) {
                const int64_t m0 = rb * 16, n0 = cb * 16;
                const int in_tail = rb >= full;
                const int rows = M - m0 < 16 ? (int)(M - m0) : 16, cols = N - n0 < 16 ? (int)(N - n0) : 16;
                block_16x16(in_tail ? tail : q_x + m0 * ldx, in_tail ? K : ldx, bp + cb * bstride, G, gs, depth,
                            z ? cs + n0 : NULL, swt + n0, Np, z, s_x + m0 * sx_stride, sx_stride,
                            bias ? bias + n0 : NULL, y + m0 * ldy + n0, ldy, rows, cols);
            }
        _tile_release();
    }
    free(tail);
}

#else /* no AMX in this build: intqat_amx_grouped_available() says 0 and nothing calls the kernel */

int intqat_amx_grouped_available(void) { return 0; }

void intqat_amx_grouped_linear(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const int8_t *bp,
                               const int32_t *cs, const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z,
                               const float *s_x, int64_t sx_stride, const float *bias, float *y, int64_t ldy) {
    (void)q_x; (void)M; (void)K; (void)ldx; (void)bp; (void)cs; (void)swt; (void)N; (void)Np; (void)gs; (void)z;
    (void)s_x; (void)sx_stride; (void)bias; (void)y; (void)ldy;
}

#endif
