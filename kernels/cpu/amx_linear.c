/* int_linear's forward on Intel AMX: y = epilogue(q_x @ q_wᵀ), the int32 accumulator never written.
 *
 * torch._int_mm (oneDNN) runs this product at ~1 TMAC/s here, about a third of what the tiles do,
 * and writes an (M, N) int32 accumulator that the epilogue (fused.c) then reads back. Here each
 * 32x32 output block is accumulated in tiles (amx.h), spilled to a 4 KB buffer in L1, and put
 * through the same epilogue_row as fused.c's intqat_epilogue: the same int32 sums (exact, the
 * contraction is bounded by MAX_K_INT32 on the Python side), the same float32 operations, the same bits.
 *
 *   q_x    int8 (M, K)   activation codes, rows of lda >= Kp bytes (Kp = K rounded up to 64; bytes
 *                         past K may hold anything: they meet zero rows of B)
 *   bpack  int8          q_w (N, K) packed by intqat_amx_pack_bt, zero past N and K
 *   y      fp32 (M, N)   epilogue.h's expression
 * The last, partial block of rows (M % 32 of them) is read from qx_tail, a 32-row copy, so that no
 * tile load runs past the caller's buffer; qx_tail NULL: q_x itself has M rounded up to 32 rows.
 */
#include <stdint.h>

#include "amx.h"      /* INTQAT_HAVE_AMX, configure_tiles, amx_block_32x32 */
#include "epilogue.h" /* epilogue_row */

#ifdef INTQAT_HAVE_AMX

#define AMX_PARALLEL_MIN 32768 /* bytes of packed weight: fused.c's INTQAT_GRAIN, the passes' threshold */

/* r[n] (16 int32 each) -> its transpose, in four rounds that swap the off-diagonal 1-, 2-, 4-, 8-wide
 * blocks of every 2x2 block arrangement (the composition of the four is the transpose). Round b
 * makes row i (bit b clear) from [r[i] where column bit b is clear, r[i + b] shifted left by b where
 * set], and row i + b from the rest: TRANSPOSE_LO / _HI are those permutex2var indices. */
#define TRANSPOSE_LO(b) _mm512_set_epi32(15 & b ? 31 - b : 15, 14 & b ? 30 - b : 14, 13 & b ? 29 - b : 13,  \
    12 & b ? 28 - b : 12, 11 & b ? 27 - b : 11, 10 & b ? 26 - b : 10, 9 & b ? 25 - b : 9, 8 & b ? 24 - b : 8, \
    7 & b ? 23 - b : 7, 6 & b ? 22 - b : 6, 5 & b ? 21 - b : 5, 4 & b ? 20 - b : 4, 3 & b ? 19 - b : 3,         \
    2 & b ? 18 - b : 2, 1 & b ? 17 - b : 1, 0)
#define TRANSPOSE_HI(b) _mm512_set_epi32(15 & b ? 31 : 15 + b, 14 & b ? 30 : 14 + b, 13 & b ? 29 : 13 + b,   \
    12 & b ? 28 : 12 + b, 11 & b ? 27 : 11 + b, 10 & b ? 26 : 10 + b, 9 & b ? 25 : 9 + b, 8 & b ? 24 : 8 + b, \
    7 & b ? 23 : 7 + b, 6 & b ? 22 : 6 + b, 5 & b ? 21 : 5 + b, 4 & b ? 20 : 4 + b, 3 & b ? 19 : 3 + b,       \
    2 & b ? 18 : 2 + b, 1 & b ? 17 : 1 + b, b)

static inline void transpose_round(__m512i r[16], int b, __m512i ilo, __m512i ihi) {
    for (int i = 0; i < 16; ++i) {
        if (i & b) continue;
        const __m512i x = r[i], y = r[i + b];
        r[i] = _mm512_permutex2var_epi32(x, ilo, y);
        r[i + b] = _mm512_permutex2var_epi32(x, ihi, y);
    }
}

static inline void transpose_16x16_epi32(__m512i r[16]) {
    transpose_round(r, 1, TRANSPOSE_LO(1), TRANSPOSE_HI(1));
    transpose_round(r, 2, TRANSPOSE_LO(2), TRANSPOSE_HI(2));
    transpose_round(r, 4, TRANSPOSE_LO(4), TRANSPOSE_HI(4));
    transpose_round(r, 8, TRANSPOSE_LO(8), TRANSPOSE_HI(8));
}

/* q (N, K) row-major, row stride qs -> bpack, B = qᵀ in amx.h's layout: column block nb, contraction
 * group kg (Kp / 4 of them) at (nb * Kp / 4 + kg) * 64, bytes [n][i] = q[16 nb + n][4 kg + i], 0 past
 * N or K. A group's 16 x 4 bytes are one int32 of each of 16 rows: 16 rows x 64 bytes are read,
 * transposed as a 16x16 int32 matrix and written as 16 groups. Kp % 64 == 0, Np % 32 == 0. */
void intqat_amx_pack_bt(const int8_t *q, int64_t N, int64_t K, int64_t qs, int64_t Kp, int64_t Np, int8_t *bpack) {
    const int64_t groups = Kp / 4;
    /* one thread below AMX_PARALLEL_MIN bytes (a small layer's weight: the fork / join costs more than the pack) */
#pragma omp parallel for schedule(static) if (Np * Kp >= AMX_PARALLEL_MIN)
    for (int64_t nb = 0; nb < Np / 16; ++nb) {
        for (int64_t k0 = 0; k0 < Kp; k0 += 64) {
            const __mmask64 cols = k0 + 64 <= K ? ~(__mmask64)0 : (k0 < K ? ((__mmask64)1 << (K - k0)) - 1 : 0);
            __m512i r[16];
            for (int n = 0; n < 16; ++n)
                r[n] = 16 * nb + n < N ? _mm512_maskz_loadu_epi8(cols, q + (16 * nb + n) * qs + k0)
                                       : _mm512_setzero_si512();
            transpose_16x16_epi32(r);
            for (int g = 0; g < 16; ++g) _mm512_storeu_si512(bpack + (nb * groups + k0 / 4 + g) * 64, r[g]);
        }
    }
}

void intqat_amx_linear(const int8_t *qx, const int8_t *qx_tail, int64_t M, int64_t lda, const int8_t *bpack,
                       int64_t Kp, int64_t N, int32_t z_x, const int32_t *colsum, const float *s_x,
                       int64_t sx_stride, const float *s_w, const float *bias, float *y) {
    const int64_t row_blocks = (M + 31) / 32, col_blocks = (N + 31) / 32, full_blocks = M / 32;
    /* one output block (a classifier head on a few tokens): one thread, no fork / join */
#pragma omp parallel if (row_blocks * col_blocks > 1)
    {
        configure_tiles();
        int32_t acc[32][32]; /* one output block: 4 KB, L1-resident */
        /* column blocks outermost: each thread takes the blocks of bpack it packed (same static split
         * in intqat_amx_pack_bt), still in its own L2; q_x (the smaller operand at training batch
         * sizes) is read by both */
#pragma omp for schedule(static) collapse(2)
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
            for (int64_t rb = 0; rb < row_blocks; ++rb) {
                const int8_t *a = (rb < full_blocks || !qx_tail) ? qx + rb * 32 * lda : qx_tail;
                amx_block_32x32(a, lda, bpack + 2 * cb * 16 * Kp, Kp, acc);
                const int rows = M - rb * 32 < 32 ? (int)(M - rb * 32) : 32;
                const int cols = N - cb * 32 < 32 ? (int)(N - cb * 32) : 32;
                const int64_t n0 = cb * 32;
                for (int i = 0; i < rows; ++i) {
                    const int64_t m = rb * 32 + i;
                    epilogue_row(acc[i], cols, z_x, colsum ? colsum + n0 : 0, s_x[m * sx_stride], s_w + n0,
                                 bias ? bias + n0 : 0, y + m * N + n0);
                }
            }
        }
        _tile_release();
    }
}

#else /* no AMX here: amx_digits.c's intqat_amx_available() says 0 and the Python side uses _int_mm */

void intqat_amx_pack_bt(const int8_t *q, int64_t N, int64_t K, int64_t qs, int64_t Kp, int64_t Np, int8_t *bpack) {
    (void)q; (void)N; (void)K; (void)qs; (void)Kp; (void)Np; (void)bpack;
}
void intqat_amx_linear(const int8_t *qx, const int8_t *qx_tail, int64_t M, int64_t lda, const int8_t *bpack,
                       int64_t Kp, int64_t N, int32_t z_x, const int32_t *colsum, const float *s_x,
                       int64_t sx_stride, const float *s_w, const float *bias, float *y) {
    (void)qx; (void)qx_tail; (void)M; (void)lda; (void)bpack; (void)Kp; (void)N; (void)z_x; (void)colsum;
    (void)s_x; (void)sx_stride; (void)s_w; (void)bias; (void)y;
}

#endif
