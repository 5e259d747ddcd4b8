/* The straight-through backward of a depthwise convolution (groups == C == O: one kh x kw filter per channel) of
 * intqat's integer conv: grad_x, grad_w and grad_b in fp32, by blocks of channels.
 *
 * Why: aten's CPU depthwise convolution_backward (oneDNN's) measured 2.5-5 ms for ConvNeXt's 16x96x8x8 7x7 conv on one
 * thread of a 4th-gen Xeon, over a hundred times its 9.6 M multiply-adds: the largest item of the ConvNeXt block's
 * training step, in fp32 and integer alike. Here the work goes by blocks of L = 16 channels (one AVX-512 register of
 * fp32; the GCC / Clang vector type below is two AVX2 or four NEON registers elsewhere): an image's block of g and of
 * the input codes is gathered once into (rows, cols, L) buffers that stay in L1, and every filter tap is one vector
 * multiply and add per output pixel. Lanes are channels, so no sum ever crosses lanes.
 *
 * Geometry geom[14] = {B, C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo}; tensor strides in elements, 4 each in
 * (b, c, h, w) order, so NCHW, channels_last and any other layout are read and written where they are.
 *
 * With x_hat = (q_x - z) s_x and w_hat = q_w s_w[c] (a padded x_hat being 0):
 *   grad_x[b, c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] += g[b, c, oh, ow] * w_hat[c, i, j]
 *   grad_w[c, i, j] = s_x * sum over (b, oh, ow) of g[b, c, oh, ow] * (q_x - z)[b, c, oh*sh - ph + i*dh, ...]
 *   grad_b[c]       = sum over (b, oh, ow) of g[b, c, oh, ow]
 * The order of every sum is fixed: grad_x adds the taps in (i, j) order onto 0; grad_w sums each image's pixels
 * into four partial sums (output column mod 4, rows in order), adds them as (p0 + p1) + (p2 + p3) to the running sum
 * over images in order, and scales by s_x at the end; grad_b adds pixels and images in order. A channel block
 * belongs to one thread. So the bits depend on neither the thread count nor the vector width; they are aten's sums
 * in another order, so they differ from convolution_backward's in the last bits (tests/test_depthwise_backward.py
 * bounds the difference against a float64 sum). Built with -ffp-contract=off: no FMA, one rounding per operation. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nchw_layout.h"  // intqat_transpose_f32 / _i8: blocked SSE transposes (the NCHW block moves)

#define L 16  // channels per block (lanes)
typedef float v16 __attribute__((vector_size(L * sizeof(float))));

static inline v16 ld(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }

typedef struct {
    int64_t B, C, H, W, KH, KW, SH, SW, PH, PW, DH, DW, HO, WO, HP, WP, TAPS;
} geometry;

static geometry unpack(const int64_t *g) {
    geometry q = {g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], 0, 0, 0};
    q.HP = q.H + 2 * q.PH;
    q.WP = q.W + 2 * q.PW;
    q.TAPS = q.KH * q.KW;
    return q;
}

/* Moving one image's channel block between a tensor (element strides s[4], (b, c, h, w)) and a block buffer
 * (rows, cols, L): channel by channel where a channel's plane is contiguous along the width (NCHW: contiguous
 * reads, writes L floats apart in a buffer in L1), else pixel by pixel (channels_last: the block's n channels are
 * one run). Lanes n..L-1 are left as they are (0). */
static void fill_codes(float *restrict xp, uint8_t *restrict tmp, const int8_t *restrict q, const int64_t *xs,
                       const geometry *g, int64_t n, float z) {
    // xp (HP, WP, L) interior <- q_x[b, c0 + l] - z: exact small integers; q at [b, c0]; tmp: H * W * L bytes
    float *base = xp + (g->PH * g->WP + g->PW) * L;
    if (xs[3] == 1 && xs[2] == g->W) {  // contiguous planes: one byte transpose (H*W, L), then widen pixel by pixel
        intqat_transpose_i8(q, n, g->H * g->W, xs[1], tmp, L, 0);
        for (int64_t h = 0; h < g->H; h++)
            for (int64_t w = 0; w < g->W; w++) {
                const int8_t *src = (const int8_t *)tmp + (h * g->W + w) * L;
                float *dst = base + (h * g->WP + w) * L;
                for (int64_t l = 0; l < L; l++) dst[l] = l < n ? (float)src[l] - z : 0.0f;
            }
        return;
    }
    if (xs[3] == 1) {
        for (int64_t l = 0; l < n; l++)
            for (int64_t h = 0; h < g->H; h++) {
                const int8_t *src = q + l * xs[1] + h * xs[2];
                float *dst = base + h * g->WP * L + l;
                for (int64_t w = 0; w < g->W; w++) dst[w * L] = (float)src[w] - z;
            }
        return;
    }
    for (int64_t h = 0; h < g->H; h++)
        for (int64_t w = 0; w < g->W; w++) {
            float *dst = base + (h * g->WP + w) * L;
            const int8_t *src = q + h * xs[2] + w * xs[3];
            for (int64_t l = 0; l < n; l++) dst[l] = (float)src[l * xs[1]] - z;
        }
}

static void gather_block(float *restrict dst, const float *restrict src, const int64_t *s, int64_t rows, int64_t cols,
                         int64_t n) {  // dst (rows, cols, L) <- src[b, c0 + l, r, c]; src at [b, c0]
    if (s[3] == 1 && s[2] == cols) {  // contiguous planes: one transpose (n, rows*cols) -> (rows*cols, L)
        intqat_transpose_f32(src, n, rows * cols, s[1], dst, L);
        return;
    }
    if (s[3] == 1) {
        for (int64_t l = 0; l < n; l++)
            for (int64_t r = 0; r < rows; r++) {
                const float *a = src + l * s[1] + r * s[2];
                float *d = dst + r * cols * L + l;
                for (int64_t c = 0; c < cols; c++) d[c * L] = a[c];
            }
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            const float *a = src + r * s[2] + c * s[3];
            float *d = dst + (r * cols + c) * L;
            for (int64_t l = 0; l < n; l++) d[l] = a[l * s[1]];
        }
}

static void scatter_block(float *restrict dst, const int64_t *s, const float *restrict src, int64_t rows,
                          int64_t cols, int64_t ld_cols, int64_t n) {  // dst[b, c0 + l, r, c] <- src (rows, ld_cols, L)
    if (s[3] == 1) {  // each row's (cols, L) block transposed into n channel rows
        for (int64_t r = 0; r < rows; r++) intqat_transpose_f32(src + r * ld_cols * L, cols, n, L, dst + r * s[2], s[1]);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float *d = dst + r * s[2] + c * s[3];
            const float *a = src + (r * ld_cols + c) * L;
            for (int64_t l = 0; l < n; l++) d[l * s[1]] = a[l];
        }
}

/* sum over this image's pixels of g * x at tap (i, j): four partial sums by output column mod 4, (p0 + p1) + (p2 + p3) */
static v16 tap_sum(const float *gp, const float *xp, const geometry *g, int64_t i, int64_t j) {
    const v16 zero = {0};
    v16 p0 = zero, p1 = zero, p2 = zero, p3 = zero;
    const int64_t step = g->SW * L;
    for (int64_t oh = 0; oh < g->HO; oh++) {
        const float *gr = gp + oh * g->WO * L;
        const float *xr = xp + ((oh * g->SH + i * g->DH) * g->WP + j * g->DW) * L;
        int64_t ow = 0;
        for (; ow + 4 <= g->WO; ow += 4) {
            p0 += ld(gr + ow * L) * ld(xr + ow * step);
            p1 += ld(gr + (ow + 1) * L) * ld(xr + (ow + 1) * step);
            p2 += ld(gr + (ow + 2) * L) * ld(xr + (ow + 2) * step);
            p3 += ld(gr + (ow + 3) * L) * ld(xr + (ow + 3) * step);
        }
        if (ow < g->WO) p0 += ld(gr + ow * L) * ld(xr + ow * step);
        if (ow + 1 < g->WO) p1 += ld(gr + (ow + 1) * L) * ld(xr + (ow + 1) * step);
        if (ow + 2 < g->WO) p2 += ld(gr + (ow + 2) * L) * ld(xr + (ow + 2) * step);
    }
    return (p0 + p1) + (p2 + p3);
}

/* Returns 0, or 1 when a thread could not allocate its buffers (then no gradient was written: the caller raises). */
int intqat_dw_backward(const float *g_in, const int64_t *gs, const int8_t *q_x, const int64_t *xs, int32_t z,
                        float s_x, const int8_t *q_w, const float *s_w, const int64_t *geom, float *gx,
                        const int64_t *gxs, float *gw, float *gb) {
    const geometry g = unpack(geom);
    const int64_t blocks = (g.C + L - 1) / L;
    const size_t plane = (size_t)(g.HP * g.WP * L);
    int failed = 0;
#pragma omp parallel
    {
        float *xp = gw ? (float *)calloc(plane, sizeof(float)) : NULL;  // (q_x - z), zero border
        float *gxp = gx ? (float *)malloc(plane * sizeof(float)) : NULL;  // the padded block's gradient
        float *gp = (float *)calloc((size_t)(g.HO * g.WO * L), sizeof(float));  // g's block, (HO, WO, L)
        float *wacc = gw ? (float *)malloc((size_t)(g.TAPS * L) * sizeof(float)) : NULL;  // (taps, L)
        float *what = (float *)malloc((size_t)(g.TAPS * L) * sizeof(float));  // w_hat (taps, L)
        uint8_t *tmp = gw ? (uint8_t *)malloc((size_t)(g.H * g.W * L)) : NULL;  // a block's codes, (H*W, L)
        if (!gp || !what || (gw && (!xp || !wacc || !tmp)) || (gx && !gxp)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t cb = 0; cb < (failed ? 0 : blocks); cb++) {
            const int64_t c0 = cb * L, n = g.C - c0 < L ? g.C - c0 : L;
            for (int64_t t = 0; t < g.TAPS; t++)
                for (int64_t l = 0; l < L; l++)  // dequantize's (float(q) - 0) * s
                    what[t * L + l] = l < n ? ((float)q_w[(c0 + l) * g.TAPS + t] - 0.0f) * s_w[c0 + l] : 0.0f;
            if (wacc) memset(wacc, 0, (size_t)(g.TAPS * L) * sizeof(float));
            v16 bacc = {0};
            if (n < L) {  // lanes past C stay 0 in every buffer
                memset(gp, 0, (size_t)(g.HO * g.WO * L) * sizeof(float));
                if (xp) memset(xp, 0, plane * sizeof(float));
            }
            for (int64_t b = 0; b < g.B; b++) {
                gather_block(gp, g_in + b * gs[0] + c0 * gs[1], gs, g.HO, g.WO, n);
                if (gb)
                    for (int64_t p = 0; p < g.HO * g.WO; p++) bacc += ld(gp + p * L);
                if (wacc) {
                    fill_codes(xp, tmp, q_x + b * xs[0] + c0 * xs[1], xs, &g, n, (float)z);
                    for (int64_t i = 0; i < g.KH; i++)
                        for (int64_t j = 0; j < g.KW; j++) {
                            float *wa = wacc + (i * g.KW + j) * L;
                            st(wa, ld(wa) + tap_sum(gp, xp, &g, i, j));
                        }
                }
                if (gxp) {
                    memset(gxp, 0, plane * sizeof(float));
                    for (int64_t i = 0; i < g.KH; i++)
                        for (int64_t j = 0; j < g.KW; j++) {
                            const v16 wv = ld(what + (i * g.KW + j) * L);
                            for (int64_t oh = 0; oh < g.HO; oh++) {
                                float *dr = gxp + ((oh * g.SH + i * g.DH) * g.WP + j * g.DW) * L;
                                const float *gr = gp + oh * g.WO * L;
                                for (int64_t ow = 0; ow < g.WO; ow++) {
                                    float *dv = dr + ow * g.SW * L;
                                    st(dv, ld(dv) + ld(gr + ow * L) * wv);
                                }
                            }
                        }
                    scatter_block(gx + b * gxs[0] + c0 * gxs[1], gxs, gxp + (g.PH * g.WP + g.PW) * L, g.H, g.W, g.WP,
                                  n);
                }
            }
            for (int64_t l = 0; l < n; l++) {
                if (wacc)
                    for (int64_t t = 0; t < g.TAPS; t++) gw[(c0 + l) * g.TAPS + t] = wacc[t * L + l] * s_x;
                if (gb) gb[c0 + l] = bacc[l];
            }
        }
        free(xp);
        free(gxp);
        free(gp);
        free(wacc);
        free(what);
        free(tmp);
    }
    return failed;
}
