/* intqat_train::int_linear: the eager CPU training step of intqat::int_linear as one C++ autograd op.
 *
 * Why: in Python, each call of an integer layer ran ~12 small steps around its three GEMMs (select a
 * backend, quantize x, quantize W, the epilogue, pack a mask, an autograd.Function, then the backward's
 * split / GEMM / combine twice): ~0.15 ms of interpreter and dispatch per layer and step, which a
 * BERT-tiny layer's whole fp32 step (~0.2-0.5 ms at 2 threads) cannot hide. Here the same kernels run
 * in one call for the forward and one autograd node for the backward (~5 us of overhead).
 *
 * Same bits as the Python path (intqat/ops/int_linear.py, backends cpu_fused / avx2_int16), step for
 * step: the elementwise passes and the AVX2 GEMM are the very functions of the fused C library (fused.c,
 * int16_gemm.c; linked by path, one copy in the process), the other GEMMs the same aten calls
 * (torch._int_mm, mm) on the same layouts. tests/test_cpp_step.py compares outputs and gradients bit
 * for bit.
 *
 * Taken only where the backend table would run the forward GEMM on cpu_fused (gemm INT_MM), avx2_int16
 * (INT16) or amx (AMX: the AMX forward kernel with its epilogue) and everything else on cpu_fused (intqat/ops/cpp_step.py decides per shape): plain CPU
 * tensors, nothing tracing, no learned (LSQ) scales.
 *
 * Forward, x (M, K) fp32 contiguous, W (N, K) (any strides):
 *     q_x, mask_x = quantize(x, s_x, z)          static per-tensor; dynamic: per-token s_x[m], z = 0
 *     q_w, s_w, colsum = quantize(W, s_w, 0)     w_scale given, or min-max per channel
 *     y = epilogue(int_mm(q_x, q_wᵀ))            float32(acc - z colsum[n]) * (s_x[m] s_w[n]) + b[n]
 * Backward (straight-through; digits_x / digits_w: that GEMM on the int8 units, digit_gemm.py):
 *     grad_x = mask_x * (g @ (q_w * s_w[n]))      or combine(int_mm(split(g, s_w), q_w))
 *     grad_w = mask_w * (gᵀ @ ((q_x - z) * s_x))  or combine(int_mm(split(gᵀ, s_x), q_x), z)
 *     grad_b = sum_m g
 * Masks are kept as bits (1/8 of the bytes) and applied from the bits. */
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "int_mm_layout.h"  // intqat::int_mm_operand
#include "observe.h"  // intqat::train::observe_then_qparams, one_float
#include "quantize_bits.h"  // intqat::train::quantize_bits: static codes and mask bits in one pass
#include "train_common.h"  // the fused passes, masks as bits, activation codes, the node's state, grad_w / grad_b

extern "C" {  // fused.c (the library intqat.ops.cpu_kernels loads)
void intqat_minmax(const float *x, int64_t n, float *out);
void intqat_epilogue(const int32_t *acc, int64_t M, int64_t N, int32_t z_x, const int32_t *colsum, const float *s_x,
                     int64_t sx_stride, const float *s_w, const float *bias, float *y);
// int16_gemm.c (the avx2_int16 backend's linear; in every build, an aborting stub without AVX2, which the
// Python side never asks for: cpu_kernels.int16_gemm_available())
void intqat_int16_linear(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N, int32_t z_x,
                         const int32_t *colsum, const float *s_x, int64_t sx_stride, const float *s_w,
                         const float *bias, int16_t *ap, int16_t *bp, float *y);
// amx_linear.c (the amx backend's linear; taken only where cpu_kernels.amx_available(): the process holds the AMX
// state, asked by the library itself)
void intqat_amx_pack_bt(const int8_t *q, int64_t N, int64_t K, int64_t qs, int64_t Kp, int64_t Np, int8_t *bpack);
void intqat_amx_linear(const int8_t *qx, const int8_t *qx_tail, int64_t M, int64_t lda, const int8_t *bpack,
                       int64_t Kp, int64_t N, int32_t z_x, const int32_t *colsum, const float *s_x, int64_t sx_stride,
                       const float *s_w, const float *bias, float *y);
}

enum Gemm : int64_t {
    INT_MM = 0 /* torch._int_mm: cpu_fused */,
    INT16 = 1 /* AVX2 vpmaddwd: avx2_int16 */,
    AMX = 2 /* AMX tiles with the epilogue in the tile loop: amx (amx_linear.c) */
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using intqat::dequantized;
using intqat::digit_matmul;
using intqat::scratch;
using intqat::train::mask_zero_bits_;
using intqat::train::packed;

template <typename T>
T *ptr(const at::Tensor &t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

/* t's values as a contiguous fp32 tensor, to read through its data: t itself where it is one already (a layer's
 * weight and bias at every step: detach, to and contiguous are three dispatched ops, ~2 us a call), else a copy */
at::Tensor fp32_contiguous(const at::Tensor &t) {
    if (t.scalar_type() == at::kFloat && t.is_contiguous()) return t;
    return t.detach().to(at::kFloat).contiguous();
}

/* a (1, 1) fp32 tensor holding v: at::full's value without its fill_ (a dispatched op) */
at::Tensor one_scale(double v) {
    at::Tensor t = at::empty({1, 1}, at::TensorOptions().dtype(at::kFloat));
    *t.data_ptr<float>() = (float)v;
    return t;
}

}  // namespace

namespace intqat {  // (named: the autograd node reads CppNode<intqat::IntLinearTrain>)

struct IntLinearTrain : public torch::autograd::Function<IntLinearTrain> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const c10::optional<at::Tensor> &bias, const c10::optional<at::Tensor> &w_scale,
                              double x_scale, int64_t x_zero_point, int64_t x_qmin, int64_t x_qmax, int64_t w_qmin,
                              int64_t w_qmax, bool x_dynamic, bool w_clip_mask, int64_t gemm, bool digits_x,
                              bool digits_w, double eps) {
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "intqat_train::int_linear: x must be a contiguous (M, K) float32 tensor, got ", x.sizes());
        TORCH_CHECK(weight.dim() == 2 && weight.size(1) == x.size(1), "intqat_train::int_linear: weight ",
                    weight.sizes(), " does not match x ", x.sizes());
        const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
        // (Function::apply runs this in no-grad mode: the aten calls below record nothing, so they may skip the
        // autograd and ADInplaceOrView kernels, ~0.1 us a call)
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        const auto f32 = at::TensorOptions().dtype(at::kFloat), i8 = at::TensorOptions().dtype(at::kChar),
                   i32 = at::TensorOptions().dtype(at::kInt);
        const int32_t z = x_dynamic ? 0 : (int32_t)x_zero_point;

        // activations: static per-tensor (clip mask kept for the STE) or dynamic per-token (nothing clips)
        at::Tensor q_x, s_x, bits_x;
        if (!x_dynamic && x.numel() && intqat::train::quantize_bits_available()) {  // codes and bits in one pass
            q_x = at::empty({M, K}, i8);
            s_x = one_scale(x_scale);
            bits_x = at::empty({(M * K + 7) / 8}, at::TensorOptions().dtype(at::kByte));
            intqat::train::quantize_bits(ptr<float>(x), M * K, *ptr<float>(s_x), (float)z, (float)x_qmin,
                                         (float)x_qmax, ptr<int8_t>(q_x), ptr<uint8_t>(bits_x));
        } else {
            std::tie(q_x, s_x, bits_x) = intqat::train::quantize_activation(x, x_dynamic, x_scale, z, x_qmin, x_qmax,
                                                                            eps);
        }
        // weights: symmetric per channel; a min-max scale (w_scale None) never clips
        const at::Tensor w = fp32_contiguous(weight);  // (read only: its data)
        at::Tensor q_w = at::empty({N, K}, i8), s_w, bits_w = intqat::train::no_bits();
        at::Tensor colsum = x_dynamic ? at::Tensor() : at::empty({N}, i32);
        if (w_scale.has_value() && w_scale->defined()) {
            s_w = w_scale->detach().reshape({-1}).to(at::kFloat, false, /*copy=*/true).contiguous();
            at::Tensor mask = w_clip_mask ? scratch("mask_w", {N * K}, at::kBool) : at::Tensor();
            if (w.numel()) intqat_quantize_rows(ptr<float>(w), N, K, ptr<float>(s_w), 1, 0.0f, (float)w_qmin,
                                                (float)w_qmax, ptr<int8_t>(q_w),
                                                mask.defined() ? (uint8_t *)mask.data_ptr() : nullptr,
                                                ptr<int32_t>(colsum));
            else if (colsum.defined()) colsum.zero_();
            if (mask.defined()) bits_w = packed(mask);
        } else {
            s_w = at::empty({N}, f32);
            if (N) intqat_quantize_rows_dynamic(ptr<float>(w), N, K, (float)w_qmin, (float)w_qmax, (float)eps,
                                                ptr<int8_t>(q_w), ptr<float>(s_w), ptr<int32_t>(colsum));
        }
        // the int32 GEMM and the epilogue
        at::Tensor y = at::empty({M, N}, f32);
        if (M && N) {
            const at::Tensor b = bias.has_value() && bias->defined() ? fp32_contiguous(*bias) : at::Tensor();
            const int32_t *cs = x_dynamic ? nullptr : ptr<int32_t>(colsum);
            if (gemm == INT16) {  // GEMM and epilogue in one pass (cpu_kernels.int16_linear: same packs)
                const int64_t kp = K + (K & 1);
                at::Tensor ap = scratch("int16_a", {(M + 11) / 12 * 12 * kp}, at::kShort);
                at::Tensor bp = scratch("int16_b", {(N + 15) / 16 * 16 * kp}, at::kShort);
                intqat_int16_linear(ptr<int8_t>(q_x), M, K, ptr<int8_t>(q_w), N, z, cs, ptr<float>(s_x),
                                    s_x.numel() > 1 ? 1 : 0, ptr<float>(s_w), ptr<float>(b), ptr<int16_t>(ap),
                                    ptr<int16_t>(bp), ptr<float>(y));
            } else if (gemm == AMX) {  // cpu_kernels.amx_linear: the same pads, pack and call
                constexpr int64_t rows = 32, cols = 32, depth = 64;  // cpu_kernels.AMX_ROWS, AMX_COLS, AMX_DEPTH
                const int64_t Kp = (K + depth - 1) / depth * depth, Np = (N + cols - 1) / cols * cols;
                at::Tensor a = q_x, tail;
                if (Kp != K) {  // tile rows are Kp bytes: a padded copy (its pad meets zero rows of B)
                    a = scratch("amx_a", {(M + rows - 1) / rows * rows, Kp}, at::kChar);
                    a.narrow(0, 0, M).narrow(1, 0, K).copy_(q_x);
                } else if (M % rows) {  // the last, partial row block from a 32-row copy, not past q_x's end
                    tail = scratch("amx_a_tail", {rows, Kp}, at::kChar);
                    tail.narrow(0, 0, M % rows).copy_(q_x.narrow(0, M - M % rows, M % rows));
                }
                at::Tensor bpack = scratch("amx_bt", {Np * Kp}, at::kChar);
                intqat_amx_pack_bt(ptr<int8_t>(q_w), N, K, q_w.stride(0), Kp, Np, ptr<int8_t>(bpack));
                intqat_amx_linear(ptr<int8_t>(a), tail.defined() ? ptr<int8_t>(tail) : nullptr, M, a.stride(0),
                                  ptr<int8_t>(bpack), Kp, N, z, cs, ptr<float>(s_x), s_x.numel() > 1 ? 1 : 0,
                                  ptr<float>(s_w), ptr<float>(b), ptr<float>(y));
            } else {  // torch._int_mm, then the epilogue (the accumulator dies here: scratch)
                at::Tensor acc = scratch("acc", {M, N}, at::kInt);
                at::_int_mm_out(acc, q_x, intqat::int_mm_operand(q_w.t()));  // (K = 1: a copy)
                intqat_epilogue(ptr<int32_t>(acc), M, N, z, cs, ptr<float>(s_x), s_x.numel() > 1 ? 1 : 0,
                                ptr<float>(s_w), ptr<float>(b), ptr<float>(y));
            }
        }
        intqat::train::save_step(ctx, q_x, bits_x, q_w, bits_w, s_x, s_w, z, digits_x, digits_w,
                                 bias.has_value() && bias->defined());
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list out(16);  // one per forward input; only x, weight, bias get gradients
        at::Tensor g = grads[0];
        if (!g.defined()) return out;
        if (g.scalar_type() != at::kFloat) g = g.to(at::kFloat);
        auto saved = ctx->get_saved_variables();  // (before the guard: a checkpoint's unpack hook reruns the forward)
        const intqat::train::BackwardDispatch below_autograd;
        const intqat::train::StepFlags f = intqat::train::step_flags(ctx);
        const at::Tensor &q_w = saved[2], &bits_x = saved[1], &s_w = saved[5];
        if (ctx->needs_input_grad(0)) {
            at::Tensor gx = f.digits_x
                                ? digit_matmul(g, s_w, q_w, 0)
                                : at::mm(g, dequantized("w_hat", q_w, s_w, 0, /*per_row=*/true));
            mask_zero_bits_(gx, bits_x);
            out[0] = gx;
        }
        intqat::train::grad_weight_and_bias(ctx, f, g, saved, out);
        return out;
    }
};

}  // namespace intqat

namespace {

at::Tensor int_linear(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                      const c10::optional<at::Tensor> &w_scale, double x_scale, int64_t x_zero_point, int64_t x_qmin,
                      int64_t x_qmax, int64_t w_qmin, int64_t w_qmax, bool x_dynamic, bool w_clip_mask, int64_t gemm,
                      bool digits_x, bool digits_w, double eps) {
    return intqat::IntLinearTrain::apply(x, weight, bias, w_scale, x_scale, x_zero_point, x_qmin, x_qmax, w_qmin, w_qmax,
                                 x_dynamic, w_clip_mask, gemm, digits_x, digits_w, eps);
}

/* An integer layer's eager training call in one op: its static activation observer (observe.h: what
 * ActivationQuantizer.integer_input runs, min-max or moving average) and then int_linear's C++ step on the
 * scale and zero point it leaves (intqat/nn/eager_step.py's fused_linear decides when; w_scale None, min-max
 * per-channel weights). x (..., K) fp32 -> y (..., N), the leading dims kept.
 *
 * Why: at BERT-tiny sizes the two calls and the Python between them (reading the scale and zero point back,
 * the step's decision) cost about what the layer's forward GEMM does.
 *
 * The same bits as the two calls: x's rows made contiguous once (int_linear's reshape(-1, K).contiguous(),
 * which observe_minmax_'s contiguous() copy equals element for element), min / max of those, the same
 * update, then s_x = float(scale) and z = round(clamp(float(zero_point), qmin, qmax)) as int_linear's
 * rounded_zero_point_int. Returns an empty (0,) tensor, having changed nothing, where the general path must
 * run: a batch holding NaN / inf (it raises), a kept range or scale / zero point that is not finite, buffers
 * that are not one float32 element each. */
at::Tensor observed_int_linear(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                               at::Tensor &min_val, at::Tensor &max_val, at::Tensor &scale, at::Tensor &zero_point,
                               at::Tensor &initialized, int64_t observe, bool first, bool moving_average,
                               double averaging_constant, bool symmetric, int64_t x_qmin, int64_t x_qmax,
                               int64_t w_qmin, int64_t w_qmax, int64_t gemm, bool digits_x, bool digits_w,
                               double eps) {
    using intqat::train::one_float;
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.numel() > 0,
                "intqat_train::observed_int_linear: x must be a non-empty float32 CPU tensor, got ", x.sizes());
    const auto none = [] { return at::empty({0}, at::TensorOptions().dtype(at::kFloat)); };
    if (!(one_float(min_val) && one_float(max_val) && one_float(scale) && one_float(zero_point))) return none();
    const int64_t K = x.size(-1);
    // (M, K), through autograd (x's gradient flows back), as int_linear's Python caller makes it
    at::Tensor x2d = (x.dim() == 2 ? x : x.reshape({-1, K})).contiguous();
    float s_x;
    int64_t z;
    if (!intqat::train::observe_then_qparams(x2d, observe, min_val, max_val, scale, zero_point, initialized, first,
                                             moving_average, averaging_constant, symmetric, x_qmin, x_qmax, eps, &s_x,
                                             &z))
        return none();
    at::Tensor y = intqat::IntLinearTrain::apply(x2d, weight, bias, c10::nullopt, (double)s_x, z, x_qmin, x_qmax,
                                                 w_qmin, w_qmax, /*x_dynamic=*/false, /*w_clip_mask=*/false, gemm,
                                                 digits_x, digits_w, eps);
    if (x.dim() == 2) return y;
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(intqat_train, m) {
    m.def("int_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? w_scale, float x_scale, int x_zero_point, "
          "int x_qmin, int x_qmax, int w_qmin, int w_qmax, bool x_dynamic, bool w_clip_mask, int gemm, "
          "bool digits_x, bool digits_w, float eps) -> Tensor",
          int_linear);
    m.def("observed_int_linear(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) min_val, Tensor(b!) max_val, "
          "Tensor(c!) scale, Tensor(d!) zero_point, Tensor(e!) initialized, int observe, bool first, "
          "bool moving_average, float averaging_constant, bool symmetric, int x_qmin, int x_qmax, int w_qmin, "
          "int w_qmax, int gemm, bool digits_x, bool digits_w, float eps) -> Tensor",
          observed_int_linear);
}
