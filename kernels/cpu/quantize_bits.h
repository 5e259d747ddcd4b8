/* Static per-tensor activation codes and their clip mask as bits in one pass (train_linear.cpp's forward).
 *
 * Why: fused.c's intqat_quantize_rows writes the mask as one bool byte per element and intqat_pack_bits then
 * reads it back into bits: at BERT-tiny sizes (256 x 128 elements) the two took about what the layer's AMX GEMM
 * does (perf, AMX Xeon, 2026-11-28). Here 16 elements at a time go from x to their codes and 16 mask bits.
 *
 * The same bits as the two passes: per element r = nearbyint(x * inv) + z, q = r < qmin ? qmin : (r > qmax ? qmax
 * : r), code (int8)(int32)q, mask bit (q == r), inv = 1.0f / s once (fused.c's round_shift / clampf in float32,
 * no FMA); bit i of byte j is element 8 j + i (intqat.ops.masks.pack_mask), bits past n zero. AVX-512 (F, BW)
 * where the CPU has it, asked at run time (the C++ ops are built without -march); else the two fused.c passes.
 * tests/test_fused_linear.py compares both on ties, the clip edges, NaN / inf and ragged tails. */
#ifndef INTQAT_QUANTIZE_BITS_H
#define INTQAT_QUANTIZE_BITS_H
#include <ATen/Parallel.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // (x86 only: elsewhere quantize_bits_available() is false and fused.c's passes run)
#endif

#include <cstdint>
#include <cstring>

namespace intqat {
namespace train {

#if defined(__x86_64__) && defined(__GNUC__)
#define INTQAT_QUANTIZE_BITS_AVX512 1

/* elements [b0 * 16, min(b1 * 16, n)) of x: codes into q, bits into bits (2 bytes per 16 elements) */
__attribute__((target("avx512f,avx512bw"))) inline void quantize_bits_blocks(const float *x, int64_t n, int64_t b0,
                                                                              int64_t b1, float inv, float z,
                                                                              float qmin, float qmax, int8_t *q,
                                                                              uint8_t *bits) {
    const __m512 vinv = _mm512_set1_ps(inv), vz = _mm512_set1_ps(z), lo = _mm512_set1_ps(qmin),
                 hi = _mm512_set1_ps(qmax);
    for (int64_t b = b0; b < b1; ++b) {
        const int64_t i = b * 16;
        const __mmask16 lanes = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(lanes, x + i);
        const __m512 r = _mm512_add_ps(
            _mm512_roundscale_ps(_mm512_mul_ps(v, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        const __mmask16 below = _mm512_cmp_ps_mask(r, lo, _CMP_LT_OQ), above = _mm512_cmp_ps_mask(r, hi, _CMP_GT_OQ);
        const __m512 c = _mm512_mask_mov_ps(_mm512_mask_mov_ps(r, above, hi), below, lo);
        _mm512_mask_cvtepi32_storeu_epi8(q + i, lanes, _mm512_cvttps_epi32(c));
        const uint16_t m = (uint16_t)(_mm512_cmp_ps_mask(c, r, _CMP_EQ_OQ) & lanes);
        if (lanes == 0xFFFF) {
            std::memcpy(bits + i / 8, &m, 2);
        } else {  // the ragged tail: only the bytes the packed mask has ((n + 7) / 8)
            bits[i / 8] = (uint8_t)m;
            if (n - i > 8) bits[i / 8 + 1] = (uint8_t)(m >> 8);
        }
    }
}
#endif

/* Does this CPU run quantize_bits' AVX-512 loop? (asked once) */
inline bool quantize_bits_available() {
#ifdef INTQAT_QUANTIZE_BITS_AVX512
    static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    return ok;
#else
    return false;
#endif
}

/* x (n,) fp32 contiguous -> q (n,) int8 codes, bits ((n + 7) / 8,) uint8. Call only where quantize_bits_available().
 * One thread below QUANTIZE_BITS_GRAIN elements (a BERT-tiny activation: 32K), else torch's threads over blocks
 * of 16 (each element computed alike: the split never changes a bit). */
constexpr int64_t QUANTIZE_BITS_GRAIN = 1 << 17;

inline void quantize_bits(const float *x, int64_t n, float scale, float z, float qmin, float qmax, int8_t *q,
                          uint8_t *bits) {
#ifdef INTQAT_QUANTIZE_BITS_AVX512
    const float inv = 1.0f / scale;
    const int64_t blocks = (n + 15) / 16;
    if (n < QUANTIZE_BITS_GRAIN) {
        quantize_bits_blocks(x, n, 0, blocks, inv, z, qmin, qmax, q, bits);
        return;
    }
    at::parallel_for(0, blocks, QUANTIZE_BITS_GRAIN / 16, [&](int64_t b0, int64_t b1) {
        quantize_bits_blocks(x, n, b0, b1, inv, z, qmin, qmax, q, bits);
    });
#else
    (void)x; (void)n; (void)scale; (void)z; (void)qmin; (void)qmax; (void)q; (void)bits;
#endif
}

}  // namespace train
}  // namespace intqat
#endif
