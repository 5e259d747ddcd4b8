/* What amx_digits.c and amx_linear.c share: the tile set-up and the 32x32 block product.
 *
 * B operands are packed by intqat_amx_pack_b / intqat_amx_pack_bt into AMX's "VNNI" layout: for
 * each 16-column block and each group of 4 contraction rows, 64 bytes [n][i] (column n, row i of
 * the group). A B tile (64 contraction rows x 16 columns) is then 16 consecutive groups, one load
 * with stride 64, and a column block of a C-deep contraction is C / 4 groups, 16 * C bytes. */
#ifndef INTQAT_AMX_H
#define INTQAT_AMX_H
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__linux__)
#define INTQAT_HAVE_AMX 1
#include <immintrin.h>

int intqat_amx_available(void); /* amx_digits.c: asks Linux for the tile state, once */

/* Palette 1, every tile 16 rows x 64 bytes: 0-3 accumulators (16x16 int32), 4-5 A rows, 6-7 B columns. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} intqat_tile_config;

static inline void configure_tiles(void) {
    intqat_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
    _tile_loadconfig(&cfg);
}

/* acc (32, 32) int32 = a (32 rows of C bytes, row stride lda) @ b (two packed 16-column blocks of a
 * C-deep contraction, 32 * C bytes). C % 64 == 0; all 32 rows of a must be readable. The 2x2 tile
 * blocking loads each A and B tile once per two products, which is what the 8 tiles allow. */
static inline void amx_block_32x32(const int8_t *a, int64_t lda, const int8_t *b, int64_t C, int32_t acc[32][32]) {
    const int8_t *a1 = a + 16 * lda, *b1 = b + 16 * C;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < C; c += 64) {
        _tile_loadd(4, a + c, lda);
        _tile_loadd(5, a1 + c, lda);
        _tile_loadd(6, b + c * 16, 64); /* c / 4 groups of 64 bytes */
        _tile_loadd(7, b1 + c * 16, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, &acc[0][0], 128);
    _tile_stored(1, &acc[0][16], 128);
    _tile_stored(2, &acc[16][0], 128);
    _tile_stored(3, &acc[16][16], 128);
}

#endif
#endif
