/* The digit GEMM on Intel AMX: three int8 digit planes times int8 codes, combined in registers.
 *
 * intqat/ops/digit_gemm.py explains the digits; fused.c splits them (intqat_split_digits) and has
 * the generic combine. Through torch._int_mm the three planes make a (3R, K) int32 product that
 * is written out and read back by the combine: at a short contraction (grad_w's is the batch,
 * ~256) that traffic costs more than the multiplications. Here each 32x32 output block is
 * accumulated plane by plane in AMX tiles, spilled to a 12 KB buffer that stays in L1, combined
 * and written once as fp32. Same integers, same combine expression: the same bits as
 * _int_mm + intqat_combine_digits (tests/test_digit_gemm.py checks it).
 *
 *   digits  int8 (3, R, C)   row-major planes from intqat_split_digits
 *   bpack   int8             q (C, K) repacked by intqat_amx_pack_b (AMX's 4-byte "VNNI" groups)
 *   out     fp32 (R, K)      out[r, k] = float32(2^-(t[r] + 14) * sum_j 2^(14 - 7j) *
 *                                                (acc_j[r, k] - z * rowsum_j[r])), masked
 * Padding: the tiles cover 32 x 32 output blocks and 64-deep contraction steps. The caller gives
 * digits with Rp = R rounded up to 32 rows (zero rows past R) and a row stride ld = C rounded up
 * to 64 (zero digits past C); intqat_amx_pack_b zero-pads q to (ld, K rounded up to 32). Zero
 * digits add nothing; rows and columns past R, K are computed and not written.
 *
 * Without AMX (another CPU, or a compiler that lacks it) intqat_amx_available() returns 0 and
 * nothing else here may be called: the Python side checks it once.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"    /* INTQAT_HAVE_AMX, configure_tiles, amx_block_32x32 */
#include "digits.h" /* combine_digit_row */

#ifdef INTQAT_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the 8 KB AMX register state only to processes that ask (once, for all threads). */
int intqat_amx_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* q (C, K) row-major, row stride qs -> bpack (ld / 4 groups, Kp / 16 blocks, 64 bytes): for each
 * 16-column block kb and each group of 4 contraction rows cg, 64 bytes [n][i] = q[4 cg + i][16 kb + n]
 * (0 past C or K). A B tile (64 contraction rows x 16 columns) is then 16 consecutive groups: one
 * load with stride 64. ld % 64 == 0, ld >= C; Kp % 32 == 0, Kp >= K. */
void intqat_amx_pack_b(const int8_t *q, int64_t C, int64_t K, int64_t qs, int64_t ld, int64_t Kp, int8_t *bpack) {
    const int64_t groups = ld / 4, blocks = Kp / 16;
    /* Four rows x 64 columns at a time: four full cache lines in, the 64-byte groups of four
     * column blocks out. Byte and word unpacks interleave the rows within each 128-bit lane
     * (lane L = block kb + L), two 128-bit shuffles gather each block's four lanes. */
#pragma omp parallel for schedule(static)
    for (int64_t cg = 0; cg < groups; ++cg) {
        __m512i r[4];
        for (int i = 0; i < 4; ++i) r[i] = _mm512_setzero_si512();
        for (int64_t kq = 0; kq < blocks; kq += 4) {
            const int64_t k0 = 16 * kq;
            const __mmask64 cols = k0 + 64 <= K ? ~(__mmask64)0 : (k0 < K ? ((__mmask64)1 << (K - k0)) - 1 : 0);
            for (int i = 0; i < 4; ++i)
                if (4 * cg + i < C) r[i] = _mm512_maskz_loadu_epi8(cols, q + (4 * cg + i) * qs + k0);
            const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
            const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
            const __m512i o0 = _mm512_unpacklo_epi16(t0, t2), o1 = _mm512_unpackhi_epi16(t0, t2); /* n 0-3, 4-7 */
            const __m512i o2 = _mm512_unpacklo_epi16(t1, t3), o3 = _mm512_unpackhi_epi16(t1, t3); /* n 8-11, 12-15 */
            const __m512i u0 = _mm512_shuffle_i64x2(o0, o1, 0x44), u1 = _mm512_shuffle_i64x2(o0, o1, 0xEE);
            const __m512i u2 = _mm512_shuffle_i64x2(o2, o3, 0x44), u3 = _mm512_shuffle_i64x2(o2, o3, 0xEE);
            const __m512i v[4] = {_mm512_shuffle_i64x2(u0, u2, 0x88), _mm512_shuffle_i64x2(u0, u2, 0xDD),
                                  _mm512_shuffle_i64x2(u1, u3, 0x88), _mm512_shuffle_i64x2(u1, u3, 0xDD)};
            for (int L = 0; L < 4 && kq + L < blocks; ++L)
                _mm512_storeu_si512(bpack + ((kq + L) * groups + cg) * 64, v[L]);
        }
    }
}

void intqat_amx_digit_gemm(const int8_t *digits, int64_t R, int64_t ld, const int8_t *bpack, int64_t K,
                           const int32_t *shift, const int32_t *rowsum, int32_t z, const uint8_t *mask,
                           float *out) {
    const int64_t row_blocks = (R + 31) / 32, col_blocks = (K + 31) / 32;
    const int64_t plane = row_blocks * 32 * ld, groups = ld / 4, C = ld;
#pragma omp parallel
    {
        configure_tiles();
        int32_t acc[3][32][32]; /* one 32x32 output block, per plane: 12 KB, L1-resident */
#pragma omp for schedule(static) collapse(2)
        for (int64_t rb = 0; rb < row_blocks; ++rb) {
            for (int64_t cb = 0; cb < col_blocks; ++cb) {
                const int8_t *b0 = bpack + (2 * cb) * groups * 64;
                for (int j = 0; j < 3; ++j)
                    amx_block_32x32(digits + j * plane + rb * 32 * C, C, b0, C, acc[j]);
                /* the combine of fused.c's intqat_combine_digits, on this block */
                const int rows = R - rb * 32 < 32 ? (int)(R - rb * 32) : 32;
                const int cols = K - cb * 32 < 32 ? (int)(K - cb * 32) : 32;
                for (int i = 0; i < rows; ++i) {
                    const int64_t r = rb * 32 + i;
                    combine_digit_row(acc[0][i], acc[1][i], acc[2][i], cols, shift[r],
                                      rowsum ? (double)z * rowsum[r] : 0.0, rowsum ? (double)z * rowsum[R + r] : 0.0,
                                      rowsum ? (double)z * rowsum[2 * R + r] : 0.0,
                                      mask ? mask + r * K + cb * 32 : 0, out + r * K + cb * 32);
                }
            }
        }
        _tile_release();
    }
}

#else /* no AMX here: the Python side asks first and takes the _int_mm path */

int intqat_amx_available(void) { return 0; }
void intqat_amx_pack_b(const int8_t *q, int64_t C, int64_t K, int64_t qs, int64_t ld, int64_t Kp, int8_t *bpack) {
    (void)q; (void)C; (void)K; (void)qs; (void)ld; (void)Kp; (void)bpack;
}
void intqat_amx_digit_gemm(const int8_t *digits, int64_t R, int64_t ld, const int8_t *bpack, int64_t K,
                           const int32_t *shift, const int32_t *rowsum, int32_t z, const uint8_t *mask,
                           float *out) {
    (void)digits; (void)R; (void)ld; (void)bpack; (void)K; (void)shift; (void)rowsum; (void)z; (void)mask; (void)out;
}

#endif
