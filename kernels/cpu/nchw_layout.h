/* NCHW <-> NHWC for the C++ conv step (train_conv.cpp): cache-blocked transposes, optionally applying an
 * elementwise function on the way (the epilogue, the u8 shift of the codes).
 *
 * Why: aten's copy of a permuted 4-D tensor walks a strided iterator; at ResNet's sizes (16 x 64 x 16 x 16 fp32)
 * it took ~210 us against ~35 us for a plain copy of the same bytes (Intel Xeon with AMX-INT8, 1 thread,
 * 2026-11-28), and the conv step made 3-4 such copies per layer and step. A transpose moves values without
 * arithmetic, so it cannot change a bit (the int8 -> u8 variant flips each code's sign bit, as bitwise_xor(128)). */
#ifndef INTQAT_NCHW_LAYOUT_H
#define INTQAT_NCHW_LAYOUT_H
#include <stdint.h>
#ifdef __SSE2__
#include <immintrin.h>
#endif

/* dst[c * dld + r] = src[r * sld + c] for r < rows, c < cols (fp32): 4x4 SSE transposes inside 16x16 tiles, scalar
 * edges. ~3x faster than aten's permuted copy, ~1.8x a plain copy of the bytes (16 x 64 x 256 fp32: 72 us). */
static inline void intqat_transpose_f32(const float *src, int64_t rows, int64_t cols, int64_t sld, float *dst,
                                        int64_t dld) {
    int64_t r4 = 0, c4 = 0;
#ifdef __SSE2__
    r4 = rows / 4 * 4, c4 = cols / 4 * 4;
    for (int64_t r0 = 0; r0 < r4; r0 += 16)
        for (int64_t c0 = 0; c0 < c4; c0 += 16) {
            const int64_t re = r0 + 16 < r4 ? r0 + 16 : r4, ce = c0 + 16 < c4 ? c0 + 16 : c4;
            for (int64_t c = c0; c < ce; c += 4)
                for (int64_t r = r0; r < re; r += 4) {
                    const float *s = src + r * sld + c;
                    float *d = dst + c * dld + r;
                    __m128 x0 = _mm_loadu_ps(s), x1 = _mm_loadu_ps(s + sld), x2 = _mm_loadu_ps(s + 2 * sld),
                           x3 = _mm_loadu_ps(s + 3 * sld);
                    _MM_TRANSPOSE4_PS(x0, x1, x2, x3);
                    _mm_storeu_ps(d, x0);
                    _mm_storeu_ps(d + dld, x1);
                    _mm_storeu_ps(d + 2 * dld, x2);
                    _mm_storeu_ps(d + 3 * dld, x3);
                }
        }
#endif
    for (int64_t r = 0; r < rows; ++r)  /* the edges: rows past r4 whole, the others past c4 */
        for (int64_t c = r < r4 ? c4 : 0; c < cols; ++c) dst[c * dld + r] = src[r * sld + c];
}

/* dst[c * dld + r] = src[r * sld + c] ^ flip for r < rows, c < cols (bytes; flip 0x80 turns int8 codes into u8 codes
 * q + 128, as bitwise_xor(128)): 16x16 SSE2 transposes (four rounds of byte interleaves), scalar edges
 * (16 x 64 x 256: 39 us against aten's 121 us). */
static inline void intqat_transpose_i8(const int8_t *src, int64_t rows, int64_t cols, int64_t sld, uint8_t *dst,
                                       int64_t dld, uint8_t flip) {
    int64_t r16 = 0, c16 = 0;
#ifdef __SSE2__
    r16 = rows / 16 * 16, c16 = cols / 16 * 16;
    const __m128i f = _mm_set1_epi8((char)flip);
    for (int64_t r = 0; r < r16; r += 16)
        for (int64_t c = 0; c < c16; c += 16) {
            __m128i x[16], y[16];
            for (int i = 0; i < 16; ++i) x[i] = _mm_loadu_si128((const __m128i *)(src + (r + i) * sld + c));
            for (int round = 0; round < 4; ++round) {
                for (int i = 0; i < 8; ++i) {
                    y[2 * i] = _mm_unpacklo_epi8(x[i], x[i + 8]);
                    y[2 * i + 1] = _mm_unpackhi_epi8(x[i], x[i + 8]);
                }
                for (int i = 0; i < 16; ++i) x[i] = y[i];
            }
            for (int i = 0; i < 16; ++i) _mm_storeu_si128((__m128i *)(dst + (c + i) * dld + r), _mm_xor_si128(x[i], f));
        }
#endif
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = r < r16 ? c16 : 0; c < cols; ++c) dst[c * dld + r] = (uint8_t)((uint8_t)src[r * sld + c] ^ flip);
}

#endif
