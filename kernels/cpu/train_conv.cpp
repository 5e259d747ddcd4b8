/* intqat_train::int_conv2d: the eager CPU training step of intqat::int_conv2d (static activations) as one
 * C++ autograd op.
 *
 * Why: in Python, an integer conv ran ~20 small steps per call (quantize x and W, im2col's views, the GEMM,
 * the epilogue, the layout of the output; in the backward two dequantizations, the fp32
 * convolution_backward, two masks): ~0.3 ms per conv and step more than nn.Conv2d, which a MobileNet's 52
 * small convs feel. Here the same steps run in one call each way.
 *
 * Same bits as the Python path (intqat/ops/int_conv2d.py with backend cpu_fused), step for step: the
 * elementwise passes are the fused C library's functions (fused.c, linked by path), everything else the
 * same aten calls on the same layouts (constant_pad_nd, unfold, _int_mm, conv2d, convolution_backward,
 * where). tests/test_cpp_step.py compares outputs and gradients bit for bit.
 *
 * Forward, x (B, C, H, W) fp32 (NCHW or channels_last), W (O, C/g, kh, kw):
 *     q_x, mask_x = quantize(x, s_x, z)                 per tensor, in x's layout
 *     q_w, mask_w, colsum = quantize(W, s_w[o], 0)      per output channel (w_scale None: s_w the min-max scale per
 *                                                       channel, intqat_quantize_rows_dynamic's one pass, 2026-12-07)
 *     groups == 1: y = epilogue(int_mm(im2col(pad(q_x, z)), q_wᵀ))      rows = NHWC pixels; int_mm on
 *                  torch._int_mm (int8-dot CPUs) or AVX2 vpmaddwd (gemm 1: CPUs without int8 dot products)
 *                  or (gemm 2) y = onednn_conv(q_x, z, q_w) * (s_x s_w[o]) + b[o]: oneDNN's int8 conv, the exact
 *                  accumulator as fp32 (intqat/ops/conv_onednn.py: conv_acc, channel_chunks; the same calls)
 *     groups  > 1: y = conv2d_fp32(q_x - z, q_w, groups) * (s_x s_w[o]) + b[o]   (exact: <= 512 terms)
 * Backward (straight-through), then the clip masks; digits_x / digits_w: that GEMM on the int8 units (groups == 1
 * only; int_conv2d._digit_grads, the same calls), on AMX tiles (digits_amx) or through torch._int_mm:
 *     fp32:   convolution_backward on x_hat = (q_x - z) s_x, w_hat = q_w s_w[o]; a depthwise conv (groups == C ==
 *             O): depthwise_backward.c's channel blocks (int_conv2d._backward's depthwise_grad on cpu_fused); a
 *             pointwise conv on NCHW tensors (int_conv2d.pointwise_nchw): two batched GEMMs (_pointwise_grads)
 *     digits: g_mat (M, O) = g as NHWC rows; grad_w = (g_mat s_x)ᵀ @ (im2col(q_x) - z)   (O, kh*kw*C)
 *             grad_x = fold((g_mat s_w[o]) @ q_w_cols)   (M, kh*kw*C) -> each pixel's window sum, (i, j) order
 *             grad_b = sum of g over (B, Ho, Wo) (when either GEMM is digits)
 * The clip masks are kept as bits (1/8 of the bool masks' bytes; packed in the codes' memory order) and applied in
 * place on the fresh gradients: where(mask, grad, 0) of the Python path, the same values.
 * Layouts (2026-11-28): an NCHW conv moves between NCHW and the GEMMs' NHWC rows with blocked SSE transposes
 * (nchw_layout.h) instead of aten's permuted copies: the epilogue (or oneDNN's accumulator's scaling) writes the
 * NCHW output directly (fused.c intqat_epilogue_nchw / intqat_scale_nchw), oneDNN gets u8 NHWC codes, g becomes
 * NHWC rows and grad_x's padded NHWC sums NCHW by transposes. Values are moved, never recomputed: the same bits.
 * Values that die inside the call (bool masks, u8 codes, the int32 accumulator, x_hat / w_hat) live in per-thread
 * scratch (scratch.h), so a step faults in no fresh pages for them. */
#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>  // at::sum_to: autograd's broadcast reduction
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <tuple>
#include <vector>

#include "digit_matmul.h"  // intqat::digit_matmul, intqat::digit_matmul_amx (the backward's digit GEMMs)
#include "nchw_layout.h"  // intqat_transpose_f32 (one block; the batches and the fused passes are fused.c's)
#include "int_mm_layout.h"  // intqat::int_mm_operand
#include "observe.h"  // intqat::train::observe_then_qparams, one_float (observed_int_conv2d's observer)
#include "scratch.h"  // intqat::scratch

extern "C" {  // fused.c
void intqat_minmax(const float *x, int64_t n, float *out);
void intqat_quantize_rows(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                          float z, float qmin, float qmax, int8_t *out, uint8_t *mask, int32_t *rowsum);
void intqat_quantize_rows_dynamic(const float *x, int64_t rows, int64_t cols, float qmin, float qmax, float eps,
                                  int8_t *out, float *scale, int32_t *rowsum);
void intqat_epilogue(const int32_t *acc, int64_t M, int64_t N, int32_t z_x, const int32_t *colsum, const float *s_x,
                     int64_t sx_stride, const float *s_w, const float *bias, float *y);
void intqat_dequantize_rows(const int8_t *q, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                            float z, float *out);
// NCHW <-> NHWC (nchw_layout.h): batched transposes, and the epilogue / the float accumulator's scaling written
// straight into an NCHW output
void intqat_transpose_f32_batch(const float *src, int64_t n, int64_t rows, int64_t cols, int64_t sld, int64_t sbs,
                                float *dst, int64_t dld, int64_t dbs);
void intqat_transpose_i8_batch(const int8_t *src, int64_t n, int64_t rows, int64_t cols, int64_t sld, int64_t sbs,
                               uint8_t *dst, int64_t dld, int64_t dbs, uint8_t flip);
void intqat_epilogue_nchw(const int32_t *acc, int64_t B, int64_t P, int64_t N, int32_t z_x, const int32_t *colsum,
                          float sx, const float *s_w, const float *bias, float *y);
void intqat_scale_nchw(const float *acc, int64_t B, int64_t P, int64_t N, const float *scale, const float *bias,
                       float *y);
void intqat_scale_channels(float *y, int64_t B, int64_t N, int64_t P, int channels_last, const float *scale,
                           const float *bias);
void intqat_quantize_bits(const float *x, int64_t n, const float *scale, float z, float qmin, float qmax, int8_t *out,
                          uint8_t *bits);
void intqat_pack_bits(const uint8_t *mask, int64_t n, uint8_t *packed);
void intqat_mask_zero_bits(float *g, const uint8_t *packed, int64_t n);
// depthwise_backward.c: a depthwise conv's STE backward by channel blocks (strides in elements, (b, c, h, w))
int intqat_dw_backward(const float *g, const int64_t *gs, const int8_t *q_x, const int64_t *xs, int32_t z, float s_x,
                       const int8_t *q_w, const float *s_w, const int64_t *geom, float *gx, const int64_t *gxs, float *gw,
                       float *gb);  // 0, or 1: its buffers could not be allocated
// int16_gemm.c: exact int8 GEMM on AVX2's vpmaddwd (the avx2_int16 backend's int_mm; in every build, an
// aborting stub without AVX2, which the Python side never asks for)
void intqat_int16_gemm(const int8_t *a, int64_t M, int64_t K, int64_t a_rs, int64_t a_cs, const int8_t *b, int64_t N,
                       int64_t b_rs, int64_t b_cs, int16_t *ap, int16_t *bp, int32_t *c);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool dense(const at::Tensor &t) {  // one block an elementwise pass walks in memory order
    return t.is_contiguous() || (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast));
}

bool channels_last(const at::Tensor &t) {  // int_conv2d.is_channels_last
    return t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous();
}

/* A tensor shaped and laid out as `like` (contiguous or channels_last), over this thread's scratch `role`: for values
 * that die inside this op call (a fresh multi-MB tensor per call costs its page faults every step). */
at::Tensor scratch_like(const char *role, const at::Tensor &like, at::ScalarType dtype) {
    if (channels_last(like))
        return intqat::scratch(role, {like.size(0), like.size(2), like.size(3), like.size(1)}, dtype).permute({0, 3, 1, 2});
    TORCH_CHECK(like.is_contiguous(), "intqat_train::int_conv2d: scratch_like takes a dense tensor");
    return intqat::scratch(role, like.sizes(), dtype);
}

/* (q - z) * s, one scale (per_row false: q walked in memory order, in its layout) or one per row of a
 * contiguous q: cpu_kernels.dequantize_rows. role: into this thread's scratch (the values die in this call). */
at::Tensor dequantized(const at::Tensor &q_in, const at::Tensor &scale, float z, bool per_row, const char *role) {
    const at::Tensor q = (per_row || !dense(q_in)) ? q_in.contiguous() : q_in;
    at::Tensor out = scratch_like(role, q, at::kFloat);
    // one scale: any cut into rows gives the same elements; the outermost dim's (contiguous blocks in memory order, for
    // both layouts) lets the pass run on every thread (one row would be one thread's)
    const int64_t rows = q.dim() && q.size(0) ? q.size(0) : 1;
    if (q.numel())
        intqat_dequantize_rows(q.data_ptr<int8_t>(), rows, q.numel() / rows, scale.data_ptr<float>(), per_row ? 1 : 0,
                               z, out.data_ptr<float>());
    return out;
}

/* bool mask -> bits ((n + 7) / 8,) in the mask's memory order (intqat.ops.masks.pack_mask of a dense mask) */
at::Tensor packed_bits(const at::Tensor &mask) {
    at::Tensor bits = at::empty({(mask.numel() + 7) / 8}, at::TensorOptions().dtype(at::kByte));
    if (mask.numel()) intqat_pack_bits((const uint8_t *)mask.data_ptr(), mask.numel(), bits.data_ptr<uint8_t>());
    return bits;
}

/* where(mask, grad, 0) with the mask as bits packed in the memory order of `like` (the codes): in place on grad (a
 * fresh result of convolution_backward) when it has like's layout, else on a copy laid out as like. */
at::Tensor masked_like(at::Tensor grad, const at::Tensor &bits, const at::Tensor &like) {
    if (!bits.numel() || !grad.numel()) return grad;
    if (!(grad.sizes() == like.sizes() && grad.strides() == like.strides() && dense(grad))) {
        at::Tensor laid = at::empty_like(like, at::kFloat);
        grad = laid.copy_(grad);
    }
    intqat_mask_zero_bits(grad.data_ptr<float>(), bits.data_ptr<uint8_t>(), grad.numel());
    return grad;
}

/* A tensor over t's memory that is not a view (int_conv2d._not_a_view): in-place ops after the conv
 * (ReLU6(inplace=True)) must not see a view of the op's temporary. */
at::Tensor not_a_view(const at::Tensor &t) {
    if (!t.is_view()) return t;
    return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

/* a (M, K) @ b (K, N) int8 -> int32, exact: torch._int_mm (gemm 0: cpu_fused.int_mm) or the AVX2 int16 kernel
 * (gemm 1: avx2_int16.int_mm, packs as cpu_kernels.int16_gemm's) */
at::Tensor int_mm(const at::Tensor &a, const at::Tensor &b, int64_t gemm) {
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    const auto i32 = at::TensorOptions().dtype(at::kInt);
    if (M == 0) return at::empty({0, N}, i32);  // no rows: the reference's empty product
    if (gemm == 0) {  // (the accumulator dies in the epilogue: scratch)
        at::Tensor c = intqat::scratch("acc", {M, N}, at::kInt);
        return at::_int_mm_out(c, intqat::int_mm_operand(a), intqat::int_mm_operand(b));
    }
    const int64_t kp = K + (K & 1);
    at::Tensor ap = intqat::scratch("int16_a", {(M + 11) / 12 * 12 * kp}, at::kShort);  // (the packs die here)
    at::Tensor bp = intqat::scratch("int16_b", {(N + 15) / 16 * 16 * kp}, at::kShort);
    at::Tensor c = at::empty({M, N}, i32);
    if (N)
        intqat_int16_gemm(a.data_ptr<int8_t>(), M, K, a.stride(0), a.stride(1), b.data_ptr<int8_t>(), N, b.stride(0),
                          b.stride(1), ap.data_ptr<int16_t>(), bp.data_ptr<int16_t>(), c.data_ptr<int32_t>());
    return c;
}

/* oneDNN's int8 conv of u8 codes (q + 128, zero point z + 128) with unit scales: fp32 (B, O, Ho, Wo) channels_last
 * = float32(the int32 accumulator) (conv_onednn._one_conv: the same two torch ops, called through the dispatcher) */
at::Tensor onednn_one(const at::Tensor &u8, int64_t zp, const at::Tensor &q_w, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation) {
    static const c10::OperatorHandle prepack =
        c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qconv_prepack", "");
    static const c10::OperatorHandle qconv = c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qconv_pointwise", "");
    const int64_t O = q_w.size(0);
    const at::Tensor ones = at::ones({O}, at::TensorOptions().dtype(at::kFloat));
    const at::Tensor zeros = at::zeros({O}, at::TensorOptions().dtype(at::kLong));
    /* The prepack takes the unit weight scale as one number (a 0-dim tensor): its per-channel form is read back one
     * channel at a time (weight_scales[o].item(), O tensor ops: ~35 us of its ~255 us at 64 channels, Zen 4). The
     * scales only feed the reorder, whose s8 -> s8 copy at scale 1 is the identity either way: the packed weight,
     * its zero-point compensation and the conv's result are the same (tests/test_conv_paths.py). The conv itself
     * still gets the per-channel ones. Measured (2026-12-07, ONEDNN_VERBOSE): the rest of the prepack is the reorder
     * into oneDNN's blocked layout with the src-zero-point compensation (~220 us of exec at 64x64x3x3 on Zen 4,
     * value-dependent: no cache by shape can skip it), not the primitive creation (a cache hit, ~1 us). */
    const at::Tensor unit = at::ones({}, at::TensorOptions().dtype(at::kFloat));
    torch::jit::Stack st{q_w, unit, 1.0, zp, stride.vec(), padding.vec(), dilation.vec(), (int64_t)1, u8.sizes().vec()};
    prepack.callBoxed(&st);
    const at::Tensor packed = st[0].toTensor();
    torch::jit::Stack st2{u8, 1.0, zp, packed, ones, zeros, c10::IValue(), stride.vec(), padding.vec(), dilation.vec(),
                          (int64_t)1, 1.0, (int64_t)0, at::kFloat, std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
    qconv.callBoxed(&st2);
    return st2[0].toTensor();
}

/* conv_onednn.conv_acc: the exact accumulator, the input channels cut where 255 * sum |q_w[o]| could pass 2^24
 * (channel_chunks: greedy contiguous ranges; nearly every layer is one) */
at::Tensor onednn_acc(const at::Tensor &q_x, int32_t z, const at::Tensor &q_w, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation) {
    constexpr int64_t limit = (int64_t(1) << 24) / 255;  // conv_onednn.WEIGHT_ABS_LIMIT
    // u8 codes (q + 128: the sign bit flipped) as NHWC, the layout oneDNN's int8 conv runs in (an NCHW input it would
    // reorder itself, ~2x the transpose here)
    at::Tensor u8;
    if (q_x.is_contiguous() && !channels_last(q_x) && q_x.numel()) {
        const int64_t B = q_x.size(0), C = q_x.size(1), P = q_x.size(2) * q_x.size(3);
        u8 = intqat::scratch("u8", {B, q_x.size(2), q_x.size(3), C}, at::kByte).permute({0, 3, 1, 2});  // (dies here)
        intqat_transpose_i8_batch(q_x.data_ptr<int8_t>(), B, C, P, P, C * P, u8.data_ptr<uint8_t>(), C, P * C, 0x80);
    } else {
        u8 = q_x.view(at::kByte).bitwise_xor(128);
    }
    const int64_t zp = (int64_t)z + 128;
    {  // the common case in one loop: every output channel's sum |q_w| within the limit -> one conv
        const at::Tensor qw = q_w.contiguous();
        const int8_t *w = qw.data_ptr<int8_t>();
        const int64_t O = qw.size(0), per_o = qw.numel() / std::max<int64_t>(O, 1);
        int64_t most = 0;
        for (int64_t o = 0; o < O; ++o) {
            int64_t sum = 0;
            for (int64_t k = 0; k < per_o; ++k) sum += std::abs((int32_t)w[o * per_o + k]);
            most = std::max(most, sum);
        }
        if (qw.size(1) == 0 || most <= limit) return onednn_one(u8, zp, q_w, stride, padding, dilation);
    }
    const at::Tensor per = q_w.to(at::kInt).abs().sum({2, 3}).to(at::kLong).contiguous();  // (O, C)
    const int64_t O = per.size(0), C = per.size(1);
    const auto a = per.accessor<int64_t, 2>();
    std::vector<int64_t> run(O, 0);
    at::Tensor acc;
    int64_t c0 = 0;
    for (int64_t c = 0; c <= C; ++c) {
        bool cut = c == C;
        if (!cut && c > c0)
            for (int64_t o = 0; o < O && !cut; ++o) cut = run[o] + a[o][c] > limit;
        if (cut) {
            at::Tensor part = onednn_one(u8.slice(1, c0, c), zp, q_w.slice(1, c0, c).contiguous(), stride, padding,
                                         dilation).to(at::kInt);
            acc = acc.defined() ? acc.add_(part) : part;
            std::fill(run.begin(), run.end(), 0);
            c0 = c;
        }
        if (c < C)
            for (int64_t o = 0; o < O; ++o) run[o] += a[o][c];
    }
    return acc.to(at::kFloat);
}

/* (B, C, H, W) int8 codes as NHWC rows (B, H, W, C): q itself when channels_last, else a blocked transpose into this
 * thread's scratch `role` (it dies in the caller); the codes moved, not changed. */
at::Tensor nhwc_codes(const at::Tensor &q, const char *role) {
    const int64_t B = q.size(0), C = q.size(1), H = q.size(2), W = q.size(3), P = H * W;
    if (!q.is_contiguous() || q.is_contiguous(at::MemoryFormat::ChannelsLast)) return q.permute({0, 2, 3, 1}).contiguous();
    at::Tensor out = intqat::scratch(role, {B, H, W, C}, at::kChar);
    intqat_transpose_i8_batch(q.data_ptr<int8_t>(), B, C, P, P, C * P, (uint8_t *)out.data_ptr<int8_t>(), C, P * C, 0);
    return out;
}

/* padded NHWC sums (B, H + 2 ph, W + 2 pw, C) -> grad_x (B, C, H, W) in like's layout (the interior, moved) */
at::Tensor interior_like(const at::Tensor &out, const at::Tensor &like, int64_t ph, int64_t pw) {
    const int64_t B = like.size(0), C = like.size(1), H = like.size(2), W = like.size(3);
    const int64_t Hp = out.size(1), Wp = out.size(2);
    if (channels_last(like) || !like.is_contiguous() || !out.is_contiguous())
        return at::empty_like(like, at::kFloat).copy_(out.slice(1, ph, ph + H).slice(2, pw, pw + W).permute({0, 3, 1, 2}));
    at::Tensor gx = at::empty({B, C, H, W}, at::TensorOptions().dtype(at::kFloat));
    const float *src = out.data_ptr<float>();
    float *dst = gx.data_ptr<float>();
    at::parallel_for(0, B * H, std::max<int64_t>(1, 32768 / std::max<int64_t>(W * C, 1)), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {  // one input row (b, h): (W, C) -> (C, W) at stride H*W
            const int64_t b = r / H, h = r % H;
            intqat_transpose_f32(src + ((b * Hp + ph + h) * Wp + pw) * C, W, C, C, dst + b * C * H * W + h * W, H * W);
        }
    });
    return gx;
}

/* int_conv2d._im2col for groups == 1: (B, C, H, W) codes -> (B*Ho*Wo, kh*kw*C), columns (i, j, c), c fastest, in one
 * C pass (an exact copy: the Python path's codes, so the same bits downstream): a
 * memcpy of a pixel's C codes per (output pixel, i, j), the zero point's code where the window leaves the input.
 * aten's copy of the unfold view walks a 7-D iterator over 64-byte runs: ~3x slower at ResNet's 64 channels. */
at::Tensor im2col_rows(const at::Tensor &q_x, int32_t z, int64_t kh, int64_t kw, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t &Ho, int64_t &Wo) {
    const int64_t B = q_x.size(0), C = q_x.size(1), H = q_x.size(2), W = q_x.size(3);
    const int64_t sh = stride[0], sw = stride[1], ph = padding[0], pw = padding[1], dh = dilation[0],
                  dw = dilation[1];
    Ho = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
    Wo = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
    const at::Tensor q = nhwc_codes(q_x, "q_nhwc");  // NHWC (q_x itself for channels_last codes)
    if (kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0)
        return q.view({B * H * W, C});  // a 1x1 window at stride 1: each pixel's codes are its column
    const int64_t Kc = kh * kw * C, ho = Ho, wo = Wo;
    // (cols die in the GEMM that reads them: this thread's scratch, no fresh pages to fault in)
    at::Tensor cols = intqat::scratch("cols", {B * Ho * Wo, Kc}, at::kChar);
    const int8_t *src = q.data_ptr<int8_t>();
    int8_t *dst = cols.data_ptr<int8_t>();
    at::parallel_for(0, B * Ho, 1, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {  // one output row (b, oh)
            const int64_t b = r / ho, oh = r % ho;
            for (int64_t ow = 0; ow < wo; ++ow) {
                int8_t *d = dst + (r * wo + ow) * Kc;
                for (int64_t i = 0; i < kh; ++i) {
                    const int64_t ih = oh * sh - ph + i * dh, iw0 = ow * sw - pw;
                    if (dw == 1 && ih >= 0 && ih < H && iw0 >= 0 && iw0 + kw <= W) {  // the row's kw pixels: adjacent
                        std::memcpy(d, src + ((b * H + ih) * W + iw0) * C, kw * C);
                        d += kw * C;
                        continue;
                    }
                    for (int64_t j = 0; j < kw; ++j, d += C) {
                        const int64_t iw = ow * sw - pw + j * dw;
                        if (ih < 0 || ih >= H || iw < 0 || iw >= W)
                            std::memset(d, (int8_t)z, C);
                        else
                            std::memcpy(d, src + ((b * H + ih) * W + iw) * C, C);
                    }
                }
            }
        }
    });
    return cols;
}

/* int_conv2d._fold_nhwc: grad_cols (B*Ho*Wo, kh*kw*C) fp32 -> (B, H + 2 ph, W + 2 pw, C), padded NHWC; each input
 * pixel the fp32 sum of its window entries, added onto 0 in (i, j) order: per image, the kernel offsets (i, j) outermost, then the output pixels, C contiguous floats at a time (the order
 * of the Python twin's strided adds, so the same bits). */
/* o[r * os + k] += c[r * cs + k] for r < rows, k < len: the fold's inner loops (vectorized: -O2 alone leaves a loop
 * of unknown trip count scalar) */
__attribute__((optimize("O3"))) void add_rows(const float *__restrict c, int64_t cs, float *__restrict o, int64_t os,
                                               int64_t rows, int64_t len) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < len; ++k) o[r * os + k] += c[r * cs + k];
}

void fold_into(const at::Tensor &cols_in, at::Tensor &out, int64_t Ho, int64_t Wo, int64_t C, int64_t kh, int64_t kw,
               at::IntArrayRef stride, at::IntArrayRef dilation) {
    // cols (n*Ho*Wo, kh*kw*C) fp32 -> added into out (n, Hp, Wp, C) contiguous, zeroed by the caller
    const int64_t sh = stride[0], sw = stride[1], dh = dilation[0], dw = dilation[1];
    const at::Tensor cols = cols_in.contiguous();
    const int64_t n = out.size(0), Hp = out.size(1), Wp = out.size(2), Kc = kh * kw * C;
    const float *src = cols.data_ptr<float>();
    float *dst = out.data_ptr<float>();
    // tasks: (image, range of channels): disjoint outputs, each element's additions in (i, j) order. Channel
    // ranges only to give every thread work when there are fewer images than threads.
    const int64_t threads = at::get_num_threads();
    const int64_t parts = n >= threads ? 1 : std::min<int64_t>((threads + n - 1) / n, std::max<int64_t>(C / 16, 1));
    const int64_t width = (C + parts - 1) / parts;
    at::parallel_for(0, n * parts, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t b = t / parts, k0 = t % parts * width, len = std::min(C, k0 + width) - k0;
            const float *cb = src + b * Ho * Wo * Kc + k0;
            float *ob = dst + b * Hp * Wp * C + k0;
            for (int64_t i = 0; i < kh; ++i)
                for (int64_t j = 0; j < kw; ++j)
                    for (int64_t oh = 0; oh < Ho; ++oh)
                        add_rows(cb + oh * Wo * Kc + (i * kw + j) * C, Kc, ob + ((i * dh + oh * sh) * Wp + j * dw) * C,
                                 sw * C, Wo, len);
        }
    });
}

at::Tensor fold_padded(const at::Tensor &cols, int64_t B, int64_t Ho, int64_t Wo, int64_t C, int64_t H, int64_t W,
                       int64_t kh, int64_t kw, at::IntArrayRef stride, at::IntArrayRef padding,
                       at::IntArrayRef dilation) {
    at::Tensor out = at::zeros({B, H + 2 * padding[0], W + 2 * padding[1], C}, at::TensorOptions().dtype(at::kFloat));
    fold_into(cols, out, Ho, Wo, C, kh, kw, stride, dilation);
    return out;
}

/* -> grad_x (B, C, H, W) with channels_last strides: the GEMM's rows themselves for a 1x1 kernel at stride 1 without
 * padding (nothing to sum), else a view of fold_padded's interior */
at::Tensor fold_nhwc(const at::Tensor &cols, int64_t B, int64_t Ho, int64_t Wo, int64_t C, int64_t H, int64_t W,
                     int64_t kh, int64_t kw, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
    const int64_t ph = padding[0], pw = padding[1];
    if (kh == 1 && kw == 1 && stride[0] == 1 && stride[1] == 1 && ph == 0 && pw == 0)
        return cols.view({B, Ho, Wo, C}).permute({0, 3, 1, 2});
    return fold_padded(cols, B, Ho, Wo, C, H, W, kh, kw, stride, padding, dilation)
        .slice(1, ph, ph + H).slice(2, pw, pw + W).permute({0, 3, 1, 2});
}

/* (a * col_scale) @ (q - z) as a digit GEMM on the kernel the table runs digit_matmul on */
at::Tensor digits_mm(const at::Tensor &a, const at::Tensor &col_scale, const at::Tensor &q, int32_t z, bool amx,
                     at::Tensor out = at::Tensor()) {
    return amx ? intqat::digit_matmul_amx(a, col_scale, q, z, out) : intqat::digit_matmul(a, col_scale, q, z, out);
}

/* grad_x = fold((g_mat * s_w[o]) @ q_w_cols) (int_conv2d._digit_grads' grad_x), a few images at a time: each chunk's
 * grad_cols (<= FOLD_CHUNK floats, or one image) is folded while it is in cache. The digit GEMM's rows are
 * independent (one shift per row), so chunks give the same bits as one call. */
constexpr int64_t FOLD_CHUNK = int64_t(1) << 18;  // 1 MiB of fp32 grad_cols: an L2's share
at::Tensor grad_x_digits(const at::Tensor &g_mat, const at::Tensor &s_w, const at::Tensor &wcols, bool amx,
                         const at::Tensor &q_x, int64_t Ho, int64_t Wo, int64_t kh, int64_t kw, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation) {
    const int64_t B = q_x.size(0), C = q_x.size(1), H = q_x.size(2), W = q_x.size(3);
    if (kh == 1 && kw == 1 && stride[0] == 1 && stride[1] == 1 && padding[0] == 0 && padding[1] == 0)
        return fold_nhwc(digits_mm(g_mat, s_w, wcols, 0, amx), B, Ho, Wo, C, H, W, kh, kw, stride, padding, dilation);
    const int64_t ph = padding[0], pw = padding[1], per_image = Ho * Wo * wcols.size(1);
    const int64_t step = std::max<int64_t>(1, FOLD_CHUNK / std::max<int64_t>(per_image, 1));
    // the padded sums die in the copy below: scratch; the gradient itself is a fresh tensor in q_x's layout
    at::Tensor out = intqat::scratch("fold_out", {B, H + 2 * ph, W + 2 * pw, C}, at::kFloat).zero_();
    if (amx) {
        /* AMX: q_w_cols packed once; then one parallel region over images, each thread a contiguous range of
         * images, chunk by chunk: the split, tile GEMM and fold of its own rows (disjoint outputs; each element the
         * same operations in the same order as one call: the same bits). Per chunk, the three kernels' own
         * parallel regions would each wake both threads for ~1 ms of work and leave the thread that folds
         * fewer images idle (3 images per chunk at 128 channels on 8x8: 2 + 1). */
        int64_t ld = 0, Kp = 0;
        const int64_t K = wcols.size(1);
        const at::Tensor bpack = intqat::amx_packed_b("amx_b_gx", wcols, ld, Kp);
        at::parallel_for(0, B, 1, [&](int64_t i0, int64_t i1) {
            for (int64_t b0 = i0; b0 < i1; b0 += step) {
                const int64_t n = std::min(step, i1 - b0);
                at::Tensor part = out.narrow(0, b0, n);
                at::Tensor chunk = intqat::scratch("grad_cols", {n * Ho * Wo, K}, at::kFloat);  // this thread's
                fold_into(intqat::digit_matmul_amx_packed(g_mat.narrow(0, b0 * Ho * Wo, n * Ho * Wo), s_w, bpack, ld,
                                                          K, 0, chunk),
                          part, Ho, Wo, C, kh, kw, stride, dilation);
            }
        });
        return interior_like(out, q_x, ph, pw);
    }
    for (int64_t b0 = 0; b0 < B; b0 += step) {
        const int64_t n = std::min(step, B - b0);
        at::Tensor part = out.narrow(0, b0, n);
        // (the chunk's grad_cols die in the fold: this thread's scratch, no fresh pages to fault in)
        at::Tensor chunk = intqat::scratch("grad_cols", {n * Ho * Wo, wcols.size(1)}, at::kFloat);
        fold_into(digits_mm(g_mat.narrow(0, b0 * Ho * Wo, n * Ho * Wo), s_w, wcols, 0, amx, chunk), part, Ho, Wo, C,
                  kh, kw, stride, dilation);
    }
    return interior_like(out, q_x, ph, pw);
}

/* int_conv2d._scaled_: y = acc * (s_x s_w[o]) + b[o] in place on acc (B, O, Ho, Wo) fp32, NCHW or channels_last
 * (one pass: the same mul, then add, per element); other layouts: aten's mul_ and add_ */
at::Tensor scaled_(at::Tensor acc, const at::Tensor &s_x, const at::Tensor &s_w, const at::Tensor &bias) {
    const int64_t O = acc.size(1);
    const at::Tensor scale = (s_x.reshape({1, 1}) * s_w.reshape({1, -1})).reshape({1, O, 1, 1}).contiguous();
    const bool cl = channels_last(acc);
    if (!(cl || acc.is_contiguous())) {
        acc.mul_(scale);
        return bias.defined() ? acc.add_(bias.reshape({1, O, 1, 1})) : acc;
    }
    if (acc.numel())
        intqat_scale_channels(acc.data_ptr<float>(), acc.size(0), O, acc.size(2) * acc.size(3), cl,
                              scale.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr);
    return acc;
}

at::Tensor forward_codes(const at::Tensor &q_x, int32_t z, const at::Tensor &s_x, const at::Tensor &q_w,
                         const at::Tensor &colsum, const at::Tensor &s_w, const at::Tensor &bias,
                         at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                         int64_t gemm) {
    const int64_t B = q_x.size(0), O = q_w.size(0), kh = q_w.size(2), kw = q_w.size(3);
    if (groups > 1) {  // int_conv2d._grouped_forward (the caller checked C/g * kh * kw <= 512: one conv)
        const at::Tensor one = at::ones({}, at::TensorOptions().dtype(at::kFloat));
        at::Tensor xz = dequantized(q_x, one, (float)z, false, "xz");  // (dies in the conv)
        return scaled_(at::conv2d(xz, q_w.to(at::kFloat), {}, stride, padding, dilation, groups), s_x, s_w, bias);
    }
    if (gemm == 2) {  // int_conv2d.conv_codes_forward's conv_int8 branch (backend onednn_conv)
        at::Tensor acc = onednn_acc(q_x, z, q_w, stride, padding, dilation);
        at::Tensor scale = (s_x.reshape({1, 1}) * s_w.reshape({1, -1})).reshape({1, O, 1, 1});
        if (!channels_last(q_x) && channels_last(acc)) {
            // NCHW output: acc's NHWC rows scaled (mul, then add: _scaled_'s two float steps) into the transposed y
            const int64_t P = acc.size(2) * acc.size(3);
            at::Tensor y = at::empty({B, O, acc.size(2), acc.size(3)}, at::TensorOptions().dtype(at::kFloat));
            if (y.numel())
                intqat_scale_nchw(acc.data_ptr<float>(), B, P, O, scale.data_ptr<float>(),
                                  bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>());
            return y;
        }
        at::Tensor y = scaled_(acc, s_x, s_w, bias);
        return channels_last(q_x) ? y : y.contiguous();
    }
    int64_t Ho = 0, Wo = 0;
    at::Tensor cols = im2col_rows(q_x, z, kh, kw, stride, padding, dilation, Ho, Wo);  // (groups == 1 here)
    at::Tensor wcols = q_w.permute({0, 2, 3, 1}).reshape({O, -1});  // int_conv2d._weight_columns
    at::Tensor acc = int_mm(cols, wcols.t(), gemm);
    const float *bias_p = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (!channels_last(q_x)) {  // NCHW: the epilogue's rows written straight into the transposed output
        at::Tensor y = at::empty({B, O, Ho, Wo}, at::TensorOptions().dtype(at::kFloat));
        if (y.numel())
            intqat_epilogue_nchw(acc.data_ptr<int32_t>(), B, Ho * Wo, O, z, colsum.data_ptr<int32_t>(),
                                 s_x.data_ptr<float>()[0], s_w.data_ptr<float>(), bias_p, y.data_ptr<float>());
        return y;
    }
    at::Tensor y = at::empty({B * Ho * Wo, O}, at::TensorOptions().dtype(at::kFloat));
    if (y.numel())
        intqat_epilogue(acc.data_ptr<int32_t>(), B * Ho * Wo, O, z, colsum.data_ptr<int32_t>(), s_x.data_ptr<float>(),
                        0, s_w.data_ptr<float>(), bias_p, y.data_ptr<float>());
    return y.reshape({B, Ho, Wo, O}).permute({0, 3, 1, 2});  // the output takes the input's memory format
}

/* an empty uint8 bits tensor: no clip mask (the backward's masked_like skips it) */
at::Tensor no_bits() { return at::empty({0}, at::TensorOptions().dtype(at::kByte)); }

/* IntConv2dTrain's backward options, as its forward saved them ("conf") */
struct Conf {
    int32_t z;
    std::vector<int64_t> stride, padding, dilation;
    int64_t groups;
    bool has_bias, digits_x, digits_w, digits_amx;
    explicit Conf(const std::vector<int64_t> &c)
        : z((int32_t)c[0]), stride{c[1], c[2]}, padding{c[3], c[4]}, dilation{c[5], c[6]}, groups(c[7]),
          has_bias(c[8] != 0), digits_x(c[9] != 0), digits_w(c[10] != 0), digits_amx(c[11] != 0) {}
};

struct IntConv2dTrain : public torch::autograd::Function<IntConv2dTrain> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const c10::optional<at::Tensor> &bias_in, const c10::optional<at::Tensor> &w_scale,
                              double x_scale,
                              int64_t x_zero_point, std::vector<int64_t> stride, std::vector<int64_t> padding,
                              std::vector<int64_t> dilation, int64_t groups, int64_t x_qmin, int64_t x_qmax,
                              int64_t w_qmin, int64_t w_qmax, bool w_clip_mask, int64_t gemm, bool digits_x,
                              bool digits_w, bool digits_amx, double w_eps) {
        return forward_impl(ctx, x, weight, bias_in, w_scale, x_scale, x_zero_point, stride, padding, dilation, groups,
                            x_qmin, x_qmax, w_qmin, w_qmax, w_clip_mask, gemm, digits_x, digits_w, digits_amx, w_eps,
                            {});
    }

    /* the forward, saving its six tensors and then `more` (FoldedConvTrain's fold state) */
    static at::Tensor forward_impl(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                                   const c10::optional<at::Tensor> &bias_in, const c10::optional<at::Tensor> &w_scale,
                                   double x_scale, int64_t x_zero_point, const std::vector<int64_t> &stride,
                                   const std::vector<int64_t> &padding, const std::vector<int64_t> &dilation,
                                   int64_t groups, int64_t x_qmin, int64_t x_qmax, int64_t w_qmin, int64_t w_qmax,
                                   bool w_clip_mask, int64_t gemm, bool digits_x, bool digits_w, bool digits_amx,
                                   double w_eps, std::vector<at::Tensor> more) {
        TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && weight.dim() == 4,
                    "intqat_train::int_conv2d: x (B, C, H, W) float32 and a 4-D weight");
        TORCH_CHECK(stride.size() == 2 && padding.size() == 2 && dilation.size() == 2,
                    "intqat_train::int_conv2d: stride, padding and dilation are pairs");
        const auto f32 = at::TensorOptions().dtype(at::kFloat);
        const int32_t z = (int32_t)x_zero_point;
        const int64_t O = weight.size(0);
        // x: codes and clip mask in x's layout (int_conv2d._quantize_input: quantize_with_mask, one scale)
        // s_x (1, 1): at::full's (float)x_scale without its dispatched fill_
        const at::Tensor s_x = at::empty({1, 1}, f32);
        *s_x.data_ptr<float>() = (float)x_scale;
        const at::Tensor xd = dense(x) ? x : x.contiguous();
        // (one pass: the codes, and the clip mask as bits in the codes' memory order, as packed_bits of the bool mask)
        at::Tensor q_x = at::empty_like(xd, at::kChar);
        at::Tensor bits_x = at::empty({(xd.numel() + 7) / 8}, at::TensorOptions().dtype(at::kByte));
        if (xd.numel())
            intqat_quantize_bits(xd.data_ptr<float>(), xd.numel(), s_x.data_ptr<float>(), (float)z, (float)x_qmin,
                                 (float)x_qmax, q_x.data_ptr<int8_t>(), bits_x.data_ptr<uint8_t>());
        // W: per output channel, codes + mask + colsum in one pass (quantize_weight of the (O, C/g*kh*kw) rows; the bool
        // mask dies in its packing: scratch)
        // (a float32 contiguous weight, every step's case, is read in place: detach / reshape / to / contiguous are four
        // dispatched ops that would return its memory anyway)
        const at::Tensor w2 = weight.scalar_type() == at::kFloat && weight.is_contiguous() && O
                                  ? weight : weight.detach().reshape({O, -1}).to(at::kFloat).contiguous();
        const int64_t w_cols = O ? w2.numel() / O : 0;
        // w_scale None: the min-max scale per output channel (intqat.nn.conv_step: what WeightQuantizer.channel_scale
        // returns for such a layer, minmax_weight_scale), made with the codes and colsum in one pass by
        // intqat_quantize_rows_dynamic (the linear step's weight pass: max |w| / qmax floored at eps, 1 / s, the same
        // rounding as intqat_quantize_rows with that scale). A min-max scale never clips: no mask.
        const bool given = w_scale.has_value() && w_scale->defined();
        TORCH_CHECK(given || w_eps > 0, "intqat_train::int_conv2d: without w_scale, w_eps (the min-max scale's floor) "
                    "must be > 0");
        const bool clip_mask = given && w_clip_mask;
        const at::Tensor s_w = given ? w_scale->detach().reshape({-1}).to(at::kFloat).contiguous() : at::empty({O}, f32);
        at::Tensor q_w = at::empty(weight.sizes(), at::TensorOptions().dtype(at::kChar));
        at::Tensor mask_w = clip_mask ? intqat::scratch("mask_w", {O, w_cols}, at::kBool) : at::Tensor();
        at::Tensor colsum = at::empty({O}, at::TensorOptions().dtype(at::kInt));
        if (w2.numel() && given)
            intqat_quantize_rows(w2.data_ptr<float>(), O, w_cols, s_w.data_ptr<float>(), 1, 0.0f, (float)w_qmin,
                                 (float)w_qmax, q_w.data_ptr<int8_t>(),
                                 clip_mask ? (uint8_t *)mask_w.data_ptr() : nullptr, colsum.data_ptr<int32_t>());
        else if (w2.numel())
            intqat_quantize_rows_dynamic(w2.data_ptr<float>(), O, w_cols, (float)w_qmin, (float)w_qmax,
                                         (float)w_eps, q_w.data_ptr<int8_t>(), s_w.data_ptr<float>(),
                                         colsum.data_ptr<int32_t>());
        else {
            colsum.zero_();
            if (!given) s_w.fill_(w_eps);  // (no weights: max |w| is 0, the scale its floor)
        }
        if (clip_mask) mask_w = mask_w.reshape(weight.sizes());
        at::Tensor bias;  // (read through its data: a float32 contiguous bias in place)
        if (bias_in.has_value() && bias_in->defined())
            bias = bias_in->scalar_type() == at::kFloat && bias_in->is_contiguous()
                       ? *bias_in : bias_in->detach().to(at::kFloat).contiguous();
        at::Tensor y = forward_codes(q_x, z, s_x, q_w, colsum, s_w, bias, stride, padding, dilation, groups, gemm);
        more.insert(more.begin(), {q_x, bits_x, q_w, clip_mask ? packed_bits(mask_w) : no_bits(), s_x, s_w});
        ctx->save_for_backward(more);
        // the backward's options as one int list (one map entry instead of nine: each a string-keyed insert and the
        // lists an IValue allocation), read back by Conf
        ctx->saved_data["conf"] = std::vector<int64_t>{
            (int64_t)z, stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], groups,
            bias.defined(), digits_x && groups == 1, digits_w && groups == 1, digits_amx};
        return not_a_view(y);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list out(20);  // one per forward input; x, weight, bias get gradients
        const at::Tensor &g = grads[0];
        if (!g.defined()) return out;
        const auto saved = ctx->get_saved_variables();
        const Conf conf(ctx->saved_data["conf"].toIntVector());
        // (edges: x, weight, then bias only when given)
        const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1),
                   need_b = conf.has_bias && ctx->needs_input_grad(2);
        backward_impl(g, saved, conf, need_x, need_w, need_b, out[0], out[1], out[2]);
        return out;
    }

    /* grad_x, grad_w, grad_b (those asked; the clip masks applied) from g and the saved state */
    static void backward_impl(at::Tensor g, const variable_list &saved, const Conf &conf, bool need_x, bool need_w,
                              bool need_b, at::Tensor &out_x, at::Tensor &out_w, at::Tensor &out_b) {
        g = g.to(at::kFloat);  // any layout: convolution_backward takes channels_last as it comes
        const at::Tensor &q_x = saved[0], &bits_x = saved[1], &q_w = saved[2], &bits_w = saved[3], &s_x = saved[4],
                         &s_w = saved[5];
        const bool has_bias = conf.has_bias;
        const int32_t z = conf.z;
        const std::vector<int64_t> &stride = conf.stride, &padding = conf.padding, &dilation = conf.dilation;
        const bool amx = conf.digits_amx;
        const bool dx = need_x && conf.digits_x, dw = need_w && conf.digits_w;
        at::Tensor gx, gw, gb;
        bool want_b = need_b;
        if (dx || dw) {  // int_conv2d._digit_grads
            const int64_t B = g.size(0), O = g.size(1), Ho = g.size(2), Wo = g.size(3), C = q_w.size(1),
                          kh = q_w.size(2), kw = q_w.size(3);
            // g_mat (M, O): g's NHWC rows (a view of channels_last g; else a copy into scratch: it dies here)
            const at::Tensor g_nhwc = g.permute({0, 2, 3, 1});
            at::Tensor g_mat;
            if (g_nhwc.is_contiguous()) {
                g_mat = g_nhwc.reshape({B * Ho * Wo, O});
            } else if (g.is_contiguous()) {  // NCHW: each image's (O, Ho*Wo) transposed
                const int64_t P = Ho * Wo;
                g_mat = intqat::scratch("g_mat", {B * P, O}, at::kFloat);
                intqat_transpose_f32_batch(g.data_ptr<float>(), B, O, P, P, O * P, g_mat.data_ptr<float>(), O, P * O);
            } else {
                g_mat = intqat::scratch("g_mat", {B, Ho, Wo, O}, at::kFloat).copy_(g_nhwc).view({B * Ho * Wo, O});
            }
            if (dw) {
                int64_t ho = 0, wo = 0;
                const at::Tensor cols = im2col_rows(q_x, z, kh, kw, stride, padding, dilation, ho, wo);
                gw = digits_mm(g_mat.t(), s_x.reshape({-1}), cols, z, amx)
                         .view({O, kh, kw, C}).permute({0, 3, 1, 2}).contiguous();
            }
            if (dx) {
                const at::Tensor wcols = q_w.permute({0, 2, 3, 1}).reshape({O, -1}).contiguous();
                gx = grad_x_digits(g_mat, s_w, wcols, amx, q_x, Ho, Wo, kh, kw, stride, padding, dilation);
            }
            if (want_b) {
                gb = g.sum({0, 2, 3});
                want_b = false;
            }
        }
        const bool fx = need_x && !gx.defined(), fw = need_w && !gw.defined();
        const int64_t groups = conf.groups;
        if ((fx || fw || want_b) && q_w.size(1) == 1 && q_w.size(0) == groups) {
            // depthwise: int_conv2d._backward's depthwise_grad on cpu_fused (the plan checked it runs there)
            const int64_t B = q_x.size(0), C = q_x.size(1), H = q_x.size(2), W = q_x.size(3), Ho = g.size(2),
                          Wo = g.size(3);
            const int64_t geom[14] = {B, C, H, W, q_w.size(2), q_w.size(3), stride[0], stride[1], padding[0],
                                      padding[1], dilation[0], dilation[1], Ho, Wo};
            const at::Tensor q_wc = q_w.contiguous();
            if (fx) gx = at::empty_like(dense(q_x) ? q_x : q_x.contiguous(), at::kFloat);
            if (fw) gw = at::empty(q_w.sizes(), at::TensorOptions().dtype(at::kFloat));
            if (want_b) gb = at::empty({C}, at::TensorOptions().dtype(at::kFloat));
            if (B * C && g.numel()) {
                const int64_t gs[4] = {g.stride(0), g.stride(1), g.stride(2), g.stride(3)},
                              xs[4] = {q_x.stride(0), q_x.stride(1), q_x.stride(2), q_x.stride(3)};
                int64_t gxs[4] = {0, 0, 0, 0};
                if (fx) for (int d = 0; d < 4; d++) gxs[d] = gx.stride(d);
                const int failed = intqat_dw_backward(
                    g.data_ptr<float>(), gs, q_x.data_ptr<int8_t>(), xs, z, s_x.data_ptr<float>()[0],
                    q_wc.data_ptr<int8_t>(), s_w.data_ptr<float>(), geom, fx ? gx.data_ptr<float>() : nullptr, gxs,
                    fw ? gw.data_ptr<float>() : nullptr, want_b ? gb.data_ptr<float>() : nullptr);
                TORCH_CHECK(!failed, "intqat_train::int_conv2d: the depthwise backward could not allocate its "
                            "per-thread buffers (input ", q_x.sizes(), ")");
            } else {  // nothing to sum (depthwise_backward's zeros)
                if (fx) gx.zero_();
                if (fw) gw.zero_();
                if (want_b) gb.zero_();
            }
        } else if ((fx || fw || want_b) && q_w.size(2) == 1 && q_w.size(3) == 1 && groups == 1 && padding[0] == 0 &&
                   padding[1] == 0 && g.is_contiguous() && q_x.is_contiguous()) {
            // pointwise (int_conv2d.pointwise_nchw): two batched GEMMs, int_conv2d._pointwise_grads' calls
            const int64_t B = g.size(0), O = g.size(1), Ho = g.size(2), Wo = g.size(3), C = q_w.size(1);
            const bool strided = stride[0] != 1 || stride[1] != 1;
            const at::Tensor w_hat = dequantized(q_w, s_w, 0.0f, /*per_row=*/s_w.numel() > 1, "w_hat");
            const at::Tensor g3 = g.reshape({B, O, Ho * Wo});
            if (fx) {
                gx = at::matmul(w_hat.reshape({O, C}).t(), g3).view({B, C, Ho, Wo});
                if (strided) {
                    at::Tensor full = at::zeros(q_x.sizes(), at::TensorOptions().dtype(at::kFloat));
                    full.slice(2, 0, q_x.size(2), stride[0]).slice(3, 0, q_x.size(3), stride[1]).copy_(gx);
                    gx = full;
                }
            }
            if (fw) {
                const at::Tensor x_hat = dequantized(q_x, s_x, (float)z, false, "x_hat");
                const at::Tensor x_sub =
                    strided ? x_hat.slice(2, 0, q_x.size(2), stride[0]).slice(3, 0, q_x.size(3), stride[1]) : x_hat;
                gw = at::bmm(g3, x_sub.reshape({B, C, Ho * Wo}).transpose(1, 2)).sum(0).view({O, C, 1, 1});
            }
            if (want_b) gb = g.sum({0, 2, 3});
        } else if (fx || fw || want_b) {
            // grad_input reads x_hat's sizes and layout only (mkldnn_convolution_backward_input(input.sizes(), ...)):
            // its values are needed for grad_w alone
            const at::Tensor x_hat = fw ? dequantized(q_x, s_x, (float)z, false, "x_hat")
                                        : at::empty_like(dense(q_x) ? q_x : q_x.contiguous(), at::kFloat);
            const at::Tensor w_hat = dequantized(q_w, s_w, 0.0f, /*per_row=*/s_w.numel() > 1, "w_hat");
            const std::vector<int64_t> bias_sizes = {w_hat.size(0)};
            auto r = at::convolution_backward(g, x_hat, w_hat, has_bias ? c10::optional<at::IntArrayRef>(bias_sizes)
                                                                       : c10::nullopt,
                                              stride, padding, dilation, false, {0, 0}, groups,
                                              {fx, fw, want_b});
            if (fx) gx = std::get<0>(r);
            if (fw) gw = std::get<1>(r);
            if (want_b) gb = std::get<2>(r);
        }
        if (need_x) out_x = masked_like(gx, bits_x, q_x);
        if (need_w) out_w = masked_like(gw, bits_w, q_w);
        if (need_b) out_b = gb;
    }
};

/* intqat_train::bn_fold: IntConv2d.folded() (intqat/nn/conv.py) as one autograd op, for the eager CPU step.
 * Why: the fold is 8 tensor ops with autograd in Python (~26-29 us a conv and step on Zen 4, 1 thread) and 5-7
 * autograd nodes in backward. Here the same aten calls run in the same order on the same tensors, forward and
 * backward (what autograd's MulBackward0 / AddBackward0 / SubBackward0 and its broadcast reduction, at::sum_to,
 * compute), so the same bits (tests/test_conv_nchw_step.py compares values and gradients bit for bit):
 *     r = rsqrt(running_var + eps);  sf = gamma * r  (gamma: ones when BN is not affine)
 *     w_fold = W * sf[o]            b_fold = beta + (b - running_mean) * sf     (b, beta: zeros when absent)
 * backward (g_w, g_b): W: g_w * sf[o];  b: g_b * sf;  beta: g_b;
 *     gamma: (sum_to(g_w * W, (O, 1, 1, 1)) + g_b * (b - running_mean)) * r   (a sum of two terms: either order) */
/* BnFold's forward values for float32 contiguous tensors in one loop: (r, sf, w_fold, u, b_fold), each element what
 * the aten expression below computes (r = rsqrt(running_var + eps), sf = gamma * r, w = W * sf[o], u = b -
 * running_mean, b_fold = beta + u * sf), because every step is one float32 operation in both: aten's float kernels
 * round each +, -, * once (its add / sub with alpha 1 is a fused multiply-add by 1, exact before its one rounding), the
 * scalar eps enters as a float32, rsqrt is 1 / sqrt with both correctly rounded (Vectorized<float>::rsqrt and the
 * scalar loop alike); absent gamma / b / beta are ones / zeros, so 1 * r and 0 - running_mean literally; this file is
 * compiled with -ffp-contract=off (no FMA). Why: the aten expression is 10 dispatched ops and 10 allocations, ~15-18 us
 * a conv and step on Zen 4 (1 thread) for O <= a few hundred values; this loop, under 1 us.
 * tests/test_conv_nchw_step.py compares it with the aten expression bit for bit (also against folded()). */
/* dst[k] = src[k] * s, k < n (vectorized: -O2 alone leaves it scalar, ~10 us at a 64x64x3x3 weight; each product is
 * one rounding either way) */
__attribute__((optimize("O3"))) void scale_row(const float *__restrict src, float s, float *__restrict dst,
                                                int64_t n) {
    for (int64_t k = 0; k < n; ++k) dst[k] = src[k] * s;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fold_values(
    const at::Tensor &weight, const float *bias, const float *gamma, const float *beta, const at::Tensor &running_mean,
    const at::Tensor &running_var, double eps) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t O = weight.size(0), per = O ? weight.numel() / O : 0;
    at::Tensor r = at::empty({O}, f32), sf = at::empty({O}, f32), u = at::empty({O}, f32), b = at::empty({O}, f32);
    at::Tensor w = at::empty(weight.sizes(), f32);
    const float *rm = running_mean.data_ptr<float>(), *rv = running_var.data_ptr<float>(),
                *wt = weight.data_ptr<float>();
    float *rp = r.data_ptr<float>(), *sp = sf.data_ptr<float>(), *up = u.data_ptr<float>(), *bp = b.data_ptr<float>(),
          *wp = w.data_ptr<float>();
    const float e = (float)eps;
    for (int64_t o = 0; o < O; ++o) {
        const float v = rv[o] + e;
        const float ro = 1.0f / std::sqrt(v);
        const float s = (gamma ? gamma[o] : 1.0f) * ro;
        rp[o] = ro;
        sp[o] = s;
        const float uo = (bias ? bias[o] : 0.0f) - rm[o];
        up[o] = uo;
        const float t = uo * s;
        bp[o] = (beta ? beta[o] : 0.0f) + t;
        scale_row(wt + o * per, s, wp + o * per, per);
    }
    return {r, sf, w, u, b};
}

/* The fold's forward: {w_fold, b_fold, then what its backward reads: sf4, sf, u, r} (BnFold's aten expression; for
 * float32 contiguous tensors its one-loop twin fold_values) */
std::vector<at::Tensor> fold_forward(const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                                     const c10::optional<at::Tensor> &gamma, const c10::optional<at::Tensor> &beta,
                                     const at::Tensor &running_mean, const at::Tensor &running_var, double eps) {
    const bool has_b = bias.has_value() && bias->defined(), has_gamma = gamma.has_value() && gamma->defined(),
               has_beta = beta.has_value() && beta->defined();
    const auto plain = [&](const at::Tensor &t) {  // float32, contiguous, one value per output channel
        return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 1 && t.size(0) == weight.size(0);
    };
    at::Tensor r, sf, sf4, w, u, b;
    if (weight.scalar_type() == at::kFloat && weight.is_contiguous() && plain(running_var) && plain(running_mean) &&
        (!has_b || plain(*bias)) && (!has_gamma || plain(*gamma)) && (!has_beta || plain(*beta))) {
        std::tie(r, sf, w, u, b) = fold_values(weight, has_b ? bias->data_ptr<float>() : nullptr,
                                               has_gamma ? gamma->data_ptr<float>() : nullptr,
                                               has_beta ? beta->data_ptr<float>() : nullptr, running_mean, running_var,
                                               eps);
        sf4 = sf.view({-1, 1, 1, 1});
    } else {  // (other dtypes or layouts, e.g. a channels_last weight: the aten expression itself)
        r = at::rsqrt(running_var + eps);
        sf = (has_gamma ? *gamma : at::ones_like(running_var)) * r;
        sf4 = sf.reshape({-1, 1, 1, 1});
        w = weight * sf4;
        u = (has_b ? *bias : at::zeros_like(sf)) - running_mean;
        b = (has_beta ? *beta : at::zeros_like(sf)) + u * sf;
    }
    return {w, b, sf4, sf, u, r};
}

/* The fold's backward from (g_w, g_b) (either may be undefined): the gradients of W, b, gamma, beta asked for (need_*),
 * from the saved weight, sf4, sf, u, r (MulBackward0 / AddBackward0 / SubBackward0 and at::sum_to's calls) */
void fold_backward(const at::Tensor &g_w, const at::Tensor &g_b, const at::Tensor &weight, const at::Tensor &sf4,
                   const at::Tensor &sf, const at::Tensor &u, const at::Tensor &r, bool need_w, bool need_b,
                   bool need_gamma, bool need_beta, at::Tensor &out_w, at::Tensor &out_b, at::Tensor &out_gamma,
                   at::Tensor &out_beta) {
    if (need_w && g_w.defined()) out_w = g_w * sf4;
    if (need_b && g_b.defined()) out_b = g_b * sf;
    if (need_gamma) {
        at::Tensor g_sf;
        if (g_w.defined()) g_sf = at::sum_to(g_w * weight, sf4.sizes()).reshape(sf.sizes());
        if (g_b.defined()) g_sf = g_sf.defined() ? g_sf + g_b * u : g_b * u;
        if (g_sf.defined()) out_gamma = g_sf * r;
    }
    if (need_beta && g_b.defined()) out_beta = g_b;
}

struct BnFold : public torch::autograd::Function<BnFold> {
    static variable_list forward(AutogradContext *ctx, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                                 const c10::optional<at::Tensor> &gamma, const c10::optional<at::Tensor> &beta,
                                 const at::Tensor &running_mean, const at::Tensor &running_var, double eps) {
        const std::vector<at::Tensor> f = fold_forward(weight, bias, gamma, beta, running_mean, running_var, eps);
        ctx->save_for_backward({weight, f[2], f[3], f[4], f[5]});
        ctx->saved_data["has_b"] = bias.has_value() && bias->defined();
        ctx->saved_data["has_gamma"] = gamma.has_value() && gamma->defined();
        ctx->saved_data["has_beta"] = beta.has_value() && beta->defined();
        return {f[0], f[1]};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list out(7);
        auto saved = ctx->get_saved_variables();
        // (needs_input_grad counts edges: the optional inputs that were given only, in order)
        const bool has_b = ctx->saved_data["has_b"].toBool(), has_gamma = ctx->saved_data["has_gamma"].toBool(),
                   has_beta = ctx->saved_data["has_beta"].toBool();
        const size_t e_gamma = 1 + has_b, e_beta = 1 + has_b + has_gamma;
        fold_backward(grads[0], grads[1], saved[0], saved[1], saved[2], saved[3], saved[4], ctx->needs_input_grad(0),
                      has_b && ctx->needs_input_grad(1), has_gamma && ctx->needs_input_grad(e_gamma),
                      has_beta && ctx->needs_input_grad(e_beta), out[0], out[1], out[2], out[3]);
        return out;
    }
};

/* The BN fold and the conv step as one autograd node (observed_int_conv2d's, with BN): BnFold's forward, then
 * IntConv2dTrain's on (w_fold, b_fold); backward: IntConv2dTrain's for (x, w_fold, b_fold), then BnFold's on those.
 * The same calls on the same tensors as the two nodes (one node's gradient reaches the other unchanged: the engine
 * hands a lone gradient on as it is), so the same bits; what it saves is a node: its Function::apply (edges, saved
 * variables, output wrapping) and its turn in the engine, ~10 us a conv and step on Zen 4 (1 thread).
 * Which gradients the conv computes follows the two nodes' rule: grad w_fold and grad b_fold whenever any input of
 * the fold needs one (the fold's outputs need a gradient when any of its inputs does). */
struct FoldedConvTrain : public torch::autograd::Function<FoldedConvTrain> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const c10::optional<at::Tensor> &bias, const c10::optional<at::Tensor> &gamma,
                              const c10::optional<at::Tensor> &beta, const at::Tensor &running_mean,
                              const at::Tensor &running_var, double bn_eps, double x_scale, int64_t x_zero_point,
                              std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                              int64_t groups, int64_t x_qmin, int64_t x_qmax, int64_t w_qmin, int64_t w_qmax,
                              int64_t gemm, bool digits_x, bool digits_w, bool digits_amx, double w_eps) {
        TORCH_CHECK(weight.dim() == 4 && running_var.dim() == 1 && running_var.size(0) == weight.size(0),
                    "intqat_train::observed_int_conv2d: weight (O, C/g, kh, kw) and (O,) statistics, got ",
                    weight.sizes(), " and ", running_var.sizes());
        const std::vector<at::Tensor> f = fold_forward(weight, bias, gamma, beta, running_mean, running_var, bn_eps);
        ctx->saved_data["fold"] = std::vector<int64_t>{bias.has_value() && bias->defined(),
                                                       gamma.has_value() && gamma->defined(),
                                                       beta.has_value() && beta->defined()};
        // (saved after the conv's six: weight, sf4, sf, u, r)
        return IntConv2dTrain::forward_impl(ctx, x, f[0], f[1], c10::nullopt, x_scale, x_zero_point, stride, padding,
                                            dilation, groups, x_qmin, x_qmax, w_qmin, w_qmax, /*w_clip_mask=*/false,
                                            gemm, digits_x, digits_w, digits_amx, w_eps,
                                            {weight, f[2], f[3], f[4], f[5]});
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list out(24);  // one per forward input; x, weight, bias, gamma, beta get gradients
        const at::Tensor &g = grads[0];
        if (!g.defined()) return out;
        const auto saved = ctx->get_saved_variables();
        const Conf conf(ctx->saved_data["conf"].toIntVector());
        const auto fold = ctx->saved_data["fold"].toIntVector();
        const bool has_b = fold[0] != 0, has_gamma = fold[1] != 0, has_beta = fold[2] != 0;
        // edges: x, weight, then bias / gamma / beta when given, running_mean, running_var
        const size_t e_b = 2, e_gamma = 2 + has_b, e_beta = e_gamma + has_gamma, e_mean = e_beta + has_beta;
        const bool need_w = ctx->needs_input_grad(1), need_b = has_b && ctx->needs_input_grad(e_b),
                   need_gamma = has_gamma && ctx->needs_input_grad(e_gamma),
                   need_beta = has_beta && ctx->needs_input_grad(e_beta);
        const bool need_fold = need_w || need_b || need_gamma || need_beta || ctx->needs_input_grad(e_mean) ||
                               ctx->needs_input_grad(e_mean + 1);
        at::Tensor g_w, g_b;
        IntConv2dTrain::backward_impl(g, saved, conf, ctx->needs_input_grad(0), need_fold, need_fold && conf.has_bias,
                                      out[0], g_w, g_b);
        fold_backward(g_w, g_b, saved[6], saved[7], saved[8], saved[9], saved[10], need_w, need_b, need_gamma,
                      need_beta, out[1], out[2], out[3], out[4]);
        return out;
    }
};

/* IntConv2d's eager training call in one op (intqat/nn/conv_step.py's fused_conv decides when): its static activation
 * observer (observe.h: what ActivationQuantizer.integer_input runs, min-max or moving average; observer off: the
 * NaN / inf check; eval mode: nothing), the BN fold (BnFold: _folded_eager's op; no running_var: no BN) and the conv
 * step (IntConv2dTrain with w_scale None: the min-max scale per output channel) on the scale and zero point the
 * observer leaves. x (B, C, H, W) fp32 -> y (B, O, Ho, Wo).
 *
 * Why: on Zen 4 (1 thread, 2026-12-07) the three calls and the Python around them cost ~60 us of a small conv's
 * ~100 us training forward (SE's 128 -> 8 at 1x1): observer 11-12, fold 23, conv_step's key and call ~15 beyond the
 * op, about what fp32's whole conv + BN forward takes.
 *
 * The same bits as the three calls: min / max of x in the memory order observe_minmax_ reads (x.contiguous()), the
 * same update, s_x = float(scale) and z = round(clamp(float(zero_point), qmin, qmax)) as conv_step's
 * rounded_zero_point_int, then the same two autograd ops on the same tensors (a fold node and a conv node, as
 * before). Returns an empty (0,) tensor, having changed nothing, where the general path must run: a batch holding
 * NaN / inf (it raises), a kept range or scale / zero point that is not finite, buffers that are not one float32
 * element each, a BN or conv tensor that is not float32 on the CPU (the general path folds in Python then). */
at::Tensor observed_int_conv2d(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                               const c10::optional<at::Tensor> &gamma, const c10::optional<at::Tensor> &beta,
                               const c10::optional<at::Tensor> &running_mean,
                               const c10::optional<at::Tensor> &running_var, double bn_eps, at::Tensor &min_val,
                               at::Tensor &max_val, at::Tensor &scale, at::Tensor &zero_point, at::Tensor &initialized,
                               int64_t observe, bool first, bool moving_average, double averaging_constant,
                               bool symmetric, at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups, int64_t x_qmin, int64_t x_qmax, int64_t w_qmin,
                               int64_t w_qmax, int64_t gemm, bool digits_x, bool digits_w, bool digits_amx,
                               double eps) {
    using intqat::train::one_float;
    const auto none = [] { return at::empty({0}, at::TensorOptions().dtype(at::kFloat)); };
    const auto f32_cpu = [](const c10::optional<at::Tensor> &t) {  // absent, or float32 on the CPU
        return !(t.has_value() && t->defined()) || (t->scalar_type() == at::kFloat && t->device().is_cpu());
    };
    if (!(x.dim() == 4 && x.numel() > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu() &&
          weight.scalar_type() == at::kFloat && weight.device().is_cpu() && f32_cpu(bias) && f32_cpu(gamma) &&
          f32_cpu(beta) && f32_cpu(running_mean) && f32_cpu(running_var)))
        return none();
    if (!(one_float(min_val) && one_float(max_val) && one_float(scale) && one_float(zero_point)) ||
        scale.requires_grad() || zero_point.requires_grad())
        return none();  // (a scale with a gradient is the Python path's, as conv_step's check)
    const bool bn = running_var.has_value() && running_var->defined();
    TORCH_CHECK(!bn || (running_mean.has_value() && running_mean->defined()),
                "intqat_train::observed_int_conv2d: running_var without running_mean");
    // observe_minmax_'s read: x.contiguous() (the same elements in the same order, so the same min / max bits); not
    // read in eval mode
    const at::Tensor xc = observe == intqat::train::OBSERVE_NOTHING || x.is_contiguous() ? x : x.contiguous();
    float s_x;
    int64_t z;
    if (!intqat::train::observe_then_qparams(xc, observe, min_val, max_val, scale, zero_point, initialized, first,
                                             moving_average, averaging_constant, symmetric, x_qmin, x_qmax, eps, &s_x,
                                             &z))
        return none();
    if (bn)
        return FoldedConvTrain::apply(x, weight, bias, gamma, beta, *running_mean, *running_var, bn_eps, (double)s_x, z,
                                      stride.vec(), padding.vec(), dilation.vec(), groups, x_qmin, x_qmax, w_qmin,
                                      w_qmax, gemm, digits_x, digits_w, digits_amx, eps);
    return IntConv2dTrain::apply(x, weight, bias, c10::nullopt, (double)s_x, z, stride.vec(), padding.vec(),
                                 dilation.vec(), groups, x_qmin, x_qmax, w_qmin, w_qmax, /*w_clip_mask=*/false, gemm,
                                 digits_x, digits_w, digits_amx, eps);
}

at::Tensor int_conv2d(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                      const c10::optional<at::Tensor> &w_scale, double x_scale, int64_t x_zero_point, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, int64_t x_qmin, int64_t x_qmax,
                      int64_t w_qmin, int64_t w_qmax, bool w_clip_mask, int64_t gemm, bool digits_x, bool digits_w,
                      bool digits_amx, double w_eps) {
    return IntConv2dTrain::apply(x, weight, bias, w_scale, x_scale, x_zero_point, stride.vec(), padding.vec(),
                                 dilation.vec(), groups, x_qmin, x_qmax, w_qmin, w_qmax, w_clip_mask, gemm, digits_x,
                                 digits_w, digits_amx, w_eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intqat_train, m) {
    // w_scale None: the op computes the min-max scale per output channel (floor w_eps), intqat.nn.conv_step
    m.def("int_conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor? w_scale, float x_scale, int x_zero_point, "
          "int[] stride, int[] padding, int[] dilation, int groups, int x_qmin, int x_qmax, int w_qmin, int w_qmax, "
          "bool w_clip_mask, int gemm, bool digits_x, bool digits_w, bool digits_amx, float w_eps=0.0) -> Tensor",
          int_conv2d);
    // IntConv2d's observer, BN fold and conv step in one call (intqat.nn.conv_step.fused_conv); an empty (0,) result:
    // nothing changed, the general path runs
    m.def("observed_int_conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, "
          "Tensor? running_mean, Tensor? running_var, float bn_eps, Tensor(a!) min_val, Tensor(b!) max_val, "
          "Tensor(c!) scale, Tensor(d!) zero_point, Tensor(e!) initialized, int observe, bool first, "
          "bool moving_average, float averaging_constant, bool symmetric, int[] stride, int[] padding, "
          "int[] dilation, int groups, int x_qmin, int x_qmax, int w_qmin, int w_qmax, int gemm, bool digits_x, "
          "bool digits_w, bool digits_amx, float eps) -> Tensor",
          observed_int_conv2d);
    m.def("bn_fold(Tensor weight, Tensor? bias, Tensor? gamma, Tensor? beta, Tensor running_mean, Tensor running_var, "
          "float eps) -> Tensor[]",
          [](const at::Tensor &weight, const c10::optional<at::Tensor> &bias, const c10::optional<at::Tensor> &gamma,
             const c10::optional<at::Tensor> &beta, const at::Tensor &running_mean, const at::Tensor &running_var,
             double eps) -> std::vector<at::Tensor> {
              TORCH_CHECK(weight.dim() == 4 && running_var.dim() == 1 && running_var.size(0) == weight.size(0),
                          "intqat_train::bn_fold: weight (O, C/g, kh, kw) and (O,) statistics, got ", weight.sizes(),
                          " and ", running_var.sizes());
              return BnFold::apply(weight, bias, gamma, beta, running_mean, running_var, eps);
          });
    // the fold alone, for int_conv2d's Python path (its eager CPU calls): the same loop, so the same bits
    m.def("fold_padded(Tensor cols, int B, int Ho, int Wo, int C, int H, int W, int kh, int kw, int[] stride, "
          "int[] padding, int[] dilation) -> Tensor",
          [](const at::Tensor &cols, int64_t B, int64_t Ho, int64_t Wo, int64_t C, int64_t H, int64_t W, int64_t kh,
             int64_t kw, at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation) {
              TORCH_CHECK(cols.scalar_type() == at::kFloat && cols.dim() == 2 && cols.size(0) == B * Ho * Wo &&
                              cols.size(1) == kh * kw * C, "intqat_train::fold_padded: cols must be (B*Ho*Wo, kh*kw*C) "
                              "float32, got ", cols.sizes());
              return fold_padded(cols, B, Ho, Wo, C, H, W, kh, kw, stride, padding, dilation);
          });
}
