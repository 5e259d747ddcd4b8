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

#include "digits.h" /* combine_digit_row */

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <immintrin.h>
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

/* Palette 1, every tile 16 rows x 64 bytes: 0-3 accumulators (16x16 int32), 4-5 digits, 6-7 codes. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}

/* q (C, K) row-major, row stride qs -> bpack (ld / 4 groups, Kp / 16 blocks, 64 bytes): for each
 * 16-column block kb and each group of 4 contraction rows cg, 64 bytes [n][i] = q[4 cg + i][16 kb + n]
 * (0 past C or K). A B tile (64 contraction rows x 16 columns) is then 16 consecutive groups: one
 * load with stride 64. ld % 64 == 0, ld >= C; Kp % 32 == 0, Kp >= K. */
void intqat_amx_pack_b(const int8_t *q, int64_t C, int64_t K, int64_t qs, int64_t ld, int64_t Kp, int8_t *bpack) {
    const int64_t groups = ld / 4;
#pragma omp parallel for schedule(static)
    for (int64_t kb = 0; kb < Kp / 16; ++kb) {
        int8_t *dst = bpack + kb * groups * 64;
        for (int64_t cg = 0; cg < groups; ++cg) {
            int8_t *g = dst + cg * 64;
            for (int i = 0; i < 4; ++i) {
                const int64_t c = 4 * cg + i;
                for (int n = 0; n < 16; ++n) {
                    const int64_t k = 16 * kb + n;
                    g[n * 4 + i] = (c < C && k < K) ? q[c * qs + k] : 0;
                }
            }
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
                const int8_t *b0 = bpack + (2 * cb) * groups * 64, *b1 = b0 + groups * 64;
                for (int j = 0; j < 3; ++j) {
                    const int8_t *a0 = digits + j * plane + rb * 32 * C, *a1 = a0 + 16 * C;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t c = 0; c < C; c += 64) {
                        _tile_loadd(4, a0 + c, C);
                        _tile_loadd(5, a1 + c, C);
                        _tile_loadd(6, b0 + c * 16, 64);  /* c / 4 groups of 64 bytes */
                        _tile_loadd(7, b1 + c * 16, 64);
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(1, 4, 7);
                        _tile_dpbssd(2, 5, 6);
                        _tile_dpbssd(3, 5, 7);
                    }
                    _tile_stored(0, &acc[j][0][0], 128);
                    _tile_stored(1, &acc[j][0][16], 128);
                    _tile_stored(2, &acc[j][16][0], 128);
                    _tile_stored(3, &acc[j][16][16], 128);
                }
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
