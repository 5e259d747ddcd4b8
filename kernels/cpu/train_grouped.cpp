/* intqat_train::int_linear_grouped: the eager CPU training step of intqat::int_linear_grouped (per-group weight
 * scales, "8da4w") as one C++ autograd op, as train_linear.cpp is int_linear's.
 *
 * Why: the Python path runs ~15 small steps per call (quantize x, quantize W per group, pack the weight for the
 * VNNI kernel, the kernel, masks; backward: two dequantizations, two GEMMs, masks, the autograd.Function around
 * them): a Llama block's seven per-group layers paid ~0.15 ms each per step in interpreter and dispatch, on
 * layers whose GEMMs take a few tens of microseconds at small batch.
 *
 * Same bits as the Python path (intqat/ops/int_linear_grouped.py with backend cpu_fused, avx2_int16 or amx), step
 * for step: the passes and the per-group kernels are the fused C library's (fused.c, grouped_linear.c,
 * int16_gemm.c, amx_grouped.c: linked by path), the backward GEMMs the same aten calls on the same layouts
 * (digit_matmul.h). tests/test_grouped_cpp_step.py compares outputs and gradients bit for bit.
 *
 * Forward, x (M, K) fp32 contiguous, W (N, K), G = K / gs groups:
 *     q_x, s_x = quantize(x)                  dynamic per-token (z = 0), or static per-tensor with its clip mask
 *     q_w, s_w = quantize(W[n, group g], s_w[n, g], 0)   w_scale given (clip mask kept), or min-max per (n, g)
 *     y[m, n] = (sum_g float32(acc_g[m, n]) * s_w[n, g]) * s_x[m] + b[n]   grouped_linear.c's VNNI kernel,
 *                                                   amx_grouped.c's tile kernel or, on CPUs without int8 dot
 *                                                   products, int16_gemm.c's vpmaddwd kernel (gemm)
 * Backward (straight-through):
 *     grad_x = mask_x * (g @ w_hat),  w_hat[n, k] = q_w[n, k] s_w[n, g(k)]
 *     grad_w = mask_w * (gᵀ @ ((q_x - z) s_x))    or that GEMM as digits (digits_w: digit_gemm.py)
 *     grad_b = sum_m g */
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>

#include "train_common.h"  // the fused passes, masks as bits, activation codes, the node's state, grad_w / grad_b

extern "C" {  // grouped_linear.c
void intqat_grouped_pack(const int8_t *q_w, int64_t N, int64_t K, int64_t ldw, int64_t gs, int64_t Np, int8_t *bp,
                         int32_t *cs);
void intqat_grouped_linear_vnni(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const int8_t *bp,
                                const int32_t *cs, const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z,
                                const float *s_x, int64_t sx_stride, const float *bias, float *y, int64_t ldy);
void intqat_amx_grouped_linear(const int8_t *q_x, int64_t M, int64_t K, int64_t ldx, const int8_t *bp,
                               const int32_t *cs, const float *swt, int64_t N, int64_t Np, int64_t gs, int32_t z,
                               const float *s_x, int64_t sx_stride, const float *bias, float *y, int64_t ldy);
int intqat_grouped_quantize_available(void);
void intqat_grouped_quantize_pack(const float *w, int64_t N, int64_t K, int64_t gs, float qmin, float qmax,
                                  float eps, int8_t *q_w, float *s_w, int8_t *bp, int32_t *cs, float *swt,
                                  int64_t Np);
void intqat_grouped_dequantize(const int8_t *q_w, int64_t N, int64_t K, int64_t gs, const float *s_w, float *w_hat);
// int16_gemm.c (the avx2_int16 backend's per-group forward; taken only where cpu_kernels.int16_gemm_available())
void intqat_int16_linear_grouped(const int8_t *q_x, int64_t M, int64_t K, const int8_t *q_w, int64_t N,
                                 int64_t gs, int32_t z, const float *swt, int64_t Np, const float *s_x,
                                 int64_t sx_stride, const float *bias, int16_t *ap, int16_t *bp, float *y);
}

/* The forward kernel, as intqat/ops/cpp_step.py's LINEAR_GEMMS names the backend the table runs linear_grouped on */
enum GroupedGemm : int64_t {
    VNNI = 0 /* cpu_fused: grouped_linear.c */,
    INT16 = 1 /* avx2_int16: int16_gemm.c's vpmaddwd kernel (CPUs without int8 dot products), codes unpacked */,
    AMX = 2 /* amx: amx_grouped.c, the same packed operands as VNNI */
};

namespace {

using intqat::data_or_null;
using intqat::scratch;
using intqat::train::mask_zero_bits_;
using intqat::train::packed;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/* The kernel's weight operands: bp (Np / 16, K / 4, 16, 4) int8, cs (G, Np) colsums, swt (G, Np) = s_wᵀ padded.
 * They die in the forward: this thread's scratch buffers (a fresh bp and y of a 768 x 256 layer page-faulted on
 * every step). */
struct Packed {
    at::Tensor bp, cs, swt;
};

Packed packed_weight(int64_t N, int64_t K, int64_t G) {
    const int64_t Np = (N + 31) / 32 * 32;
    return {scratch("grouped_bp", {Np * K}, at::kChar), scratch("grouped_cs", {G, Np}, at::kInt),
            scratch("grouped_swt", {G, Np}, at::kFloat)};
}

/* The backward's dequantized operands, w_hat (N, K) for grad_x and then x_hat (M, K) for grad_w, in one scratch
 * buffer: w_hat dies in grad_x's mm before x_hat is written, and every per-group layer's backward reuses the same
 * lines, which are then still in cache (two roles kept ~1.2 MB of scratch for the Llama block's 8da4w layers, whose
 * writes missed to memory: perf put the two dequantize passes at 0.2-0.25 ns an element in the step, 0.08 warm). */
constexpr const char *HAT = "grouped_hat";

/* The whole-row min-max pass (grouped_linear.c) where this build has it: codes, scales and the packed operands in one */
bool quantize_pack_in_one(int64_t gs) { return gs % 16 == 0 && intqat_grouped_quantize_available(); }

/* swt (G, Np) = s_wᵀ (s_w (N, G) contiguous), its padded columns zero: what intqat_grouped_pack's caller writes for
 * the kernels, in one loop (zero_ + narrow + copy_ of the transpose are four dispatched ops). */
void fill_swt(const at::Tensor &s_w, at::Tensor &swt) {
    const int64_t N = s_w.size(0), G = s_w.size(1), Np = swt.size(1);
    const float *s = data_or_null<float>(s_w);
    float *t = data_or_null<float>(swt);
    for (int64_t g = 0; g < G; ++g) {
        for (int64_t n = 0; n < N; ++n) t[g * Np + n] = s[n * G + g];
        for (int64_t n = N; n < Np; ++n) t[g * Np + n] = 0.0f;
    }
}

/* y (M, N) through the per-group kernel the table runs linear_grouped on (gemm):
 *   VNNI / AMX: cpu_kernels.grouped_linear(fp32_codes=False, amx=...), the same packs. p: the packed weight, already
 *     filled by the whole-row pass, or (filled = false) packed here from q_w, s_w.
 *   INT16: cpu_kernels.int16_linear_grouped (avx2_int16's linear_grouped): the kernel widens and packs the codes
 *     itself (ap: M rounded up to 12 rows of K int16, bp: N rounded up to 16 columns of K int16, both scratch as the
 *     Python side's); of p it reads swt only (Np: N rounded up to 32 here, 16 there: the kernel takes Np as swt's
 *     row stride and reads columns below N rounded up to 16). Needs an even group size. */
at::Tensor grouped_forward(const at::Tensor &q_x, const at::Tensor &q_w, const at::Tensor &s_w, int32_t z,
                           const at::Tensor &s_x, const at::Tensor &bias, int64_t gs, Packed &p, bool filled,
                           int64_t gemm) {
    const int64_t M = q_x.size(0), K = q_x.size(1), N = q_w.size(0);
    at::Tensor y = at::empty({M, N}, at::TensorOptions().dtype(at::kFloat));
    if (M == 0 || N == 0) return y;
    const int64_t Np = p.cs.size(1);
    if (gemm == INT16) {
        fill_swt(s_w, p.swt);
        at::Tensor ap = scratch("int16_a", {(M + 11) / 12 * 12 * K}, at::kShort);
        at::Tensor bp = scratch("int16_b", {(N + 15) / 16 * 16 * K}, at::kShort);
        intqat_int16_linear_grouped(data_or_null<int8_t>(q_x), M, K, data_or_null<int8_t>(q_w), N, gs, z,
                                    data_or_null<float>(p.swt), Np, data_or_null<float>(s_x),
                                    s_x.numel() == 1 ? 0 : 1, data_or_null<float>(bias), data_or_null<int16_t>(ap),
                                    data_or_null<int16_t>(bp), data_or_null<float>(y));
        return y;
    }
    if (!filled) {
        intqat_grouped_pack(data_or_null<int8_t>(q_w), N, K, K, gs, Np, data_or_null<int8_t>(p.bp),
                            data_or_null<int32_t>(p.cs));
        fill_swt(s_w, p.swt);
    }
    (gemm == AMX ? intqat_amx_grouped_linear : intqat_grouped_linear_vnni)(
        data_or_null<int8_t>(q_x), M, K, K, data_or_null<int8_t>(p.bp), data_or_null<int32_t>(p.cs),
        data_or_null<float>(p.swt), N, Np, gs, z, data_or_null<float>(s_x), s_x.numel() == 1 ? 0 : 1,
        data_or_null<float>(bias), data_or_null<float>(y), N);
    return y;
}

}  // namespace

namespace intqat {  // (named: the autograd node reads CppNode<intqat::IntLinearGroupedTrain>)

struct IntLinearGroupedTrain : public torch::autograd::Function<IntLinearGroupedTrain> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const c10::optional<at::Tensor> &bias_in, const c10::optional<at::Tensor> &w_scale,
                              double x_scale, int64_t x_zero_point, int64_t group_size, int64_t x_qmin, int64_t x_qmax,
                              int64_t w_qmin, int64_t w_qmax, bool x_dynamic, bool w_clip_mask, int64_t gemm,
                              bool digits_w, double eps) {
        TORCH_CHECK(gemm == VNNI || gemm == INT16 || gemm == AMX,
                    "intqat_train::int_linear_grouped: unknown forward kernel ", gemm);
        TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                    "intqat_train::int_linear_grouped: x must be a contiguous (M, K) float32 tensor, got ", x.sizes());
        const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), gs = group_size, G = K / gs;
        TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K && K % gs == 0,
                    "intqat_train::int_linear_grouped: weight ", weight.sizes(), " and group_size ", gs,
                    " do not fit x ", x.sizes());
        TORCH_CHECK(gemm != INT16 || gs % 2 == 0,
                    "intqat_train::int_linear_grouped: the int16 kernel takes whole pairs of k: an even group size, got ",
                    gs);
        const at::AutoDispatchBelowADInplaceOrView below_autograd;  // (no-grad mode here: train_linear.cpp says why)
        const auto f32 = at::TensorOptions().dtype(at::kFloat), i8 = at::TensorOptions().dtype(at::kChar);
        const int32_t z = x_dynamic ? 0 : (int32_t)x_zero_point;
        // activations (int_linear.quantize_activation)
        at::Tensor q_x, s_x, bits_x;
        std::tie(q_x, s_x, bits_x) = intqat::train::quantize_activation(x, x_dynamic, x_scale, z, x_qmin, x_qmax, eps);
        // weights per (row, group): each group one row of the (N * G, gs) view (quantize_weight_grouped)
        const at::Tensor w = weight.detach().to(at::kFloat).contiguous();
        at::Tensor q_w = at::empty({N, K}, i8), s_w, bits_w = intqat::train::no_bits();
        Packed p = packed_weight(N, K, G);
        bool filled = false;
        const bool given = w_scale.has_value() && w_scale->defined();
        if (given) {
            s_w = w_scale->detach().to(at::kFloat, false, /*copy=*/true).contiguous();  // (N, G)
            at::Tensor mask = w_clip_mask ? scratch("mask_w", {N * K}, at::kBool) : at::Tensor();
            if (w.numel()) intqat_quantize_rows(data_or_null<float>(w), N * G, gs, data_or_null<float>(s_w), 1, 0.0f,
                                                (float)w_qmin, (float)w_qmax, data_or_null<int8_t>(q_w),
                                                mask.defined() ? (uint8_t *)mask.data_ptr() : nullptr, nullptr);
            if (mask.defined()) bits_w = packed(mask);
        } else if (gemm != INT16 && quantize_pack_in_one(gs)) {
            // symmetric min-max per group, whole rows: never clips, no mask. (Not for INT16: it would pack bp for the
            // VNNI layout the int16 kernel does not read, and AVX2-only builds, that kernel's CPUs, do not have it.)
            s_w = at::empty({N, G}, f32);
            // (the AMX kernel reads the column sums only with a zero point: without one they are not made)
            int32_t *cs = gemm == AMX && z == 0 ? nullptr : data_or_null<int32_t>(p.cs);
            if (w.numel()) intqat_grouped_quantize_pack(data_or_null<float>(w), N, K, gs, (float)w_qmin, (float)w_qmax,
                                                        (float)eps, data_or_null<int8_t>(q_w), data_or_null<float>(s_w),
                                                        data_or_null<int8_t>(p.bp), cs, data_or_null<float>(p.swt),
                                                        p.cs.size(1));
            filled = w.numel() > 0;
        } else {  // symmetric min-max per group (the plan takes no other): never clips, no mask
            s_w = at::empty({N, G}, f32);
            if (w.numel()) intqat_quantize_rows_dynamic(data_or_null<float>(w), N * G, gs, (float)w_qmin, (float)w_qmax,
                                                        (float)eps, data_or_null<int8_t>(q_w), data_or_null<float>(s_w),
                                                        nullptr);
        }
        const at::Tensor bias = bias_in.has_value() && bias_in->defined()
                                    ? bias_in->detach().to(at::kFloat).contiguous() : at::Tensor();
        at::Tensor y = grouped_forward(q_x, q_w, s_w, z, s_x, bias, gs, p, filled, gemm);
        intqat::train::save_step(ctx, q_x, bits_x, q_w, bits_w, s_x, s_w, z, /*digits_x=*/false, digits_w, bias.defined());
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list out(16);  // one per forward input; only x, weight, bias get gradients
        at::Tensor g = grads[0];
        if (!g.defined()) return out;
        g = g.to(at::kFloat);
        auto saved = ctx->get_saved_variables();  // (before the guard: a checkpoint's unpack hook reruns the forward)
        const intqat::train::BackwardDispatch below_autograd;
        const intqat::train::StepFlags f = intqat::train::step_flags(ctx);
        const at::Tensor &q_x = saved[0], &bits_x = saved[1], &q_w = saved[2], &bits_w = saved[3], &s_x = saved[4],
                         &s_w = saved[5];
        if (ctx->needs_input_grad(0)) {  // g @ w_hat, w_hat = dequantize_weight_grouped(q_w, s_w)
            const int64_t N = q_w.size(0), K = q_w.size(1), G = s_w.size(1);
            at::Tensor w_hat;
            if (quantize_pack_in_one(K / G)) {  // whole rows (grouped_linear.c): fused.c's per-row pass, same bits
                w_hat = scratch(HAT, {N, K}, at::kFloat);
                intqat_grouped_dequantize(data_or_null<int8_t>(q_w), N, K, K / G, data_or_null<float>(s_w),
                                          data_or_null<float>(w_hat));
            } else {
                w_hat = intqat::dequantized(HAT, q_w.view({N * G, K / G}), s_w, 0, /*per_row=*/true).view({N, K});
            }
            at::Tensor gx = at::mm(g, w_hat);
            mask_zero_bits_(gx, bits_x);
            out[0] = gx;
        }
        // grad_w and grad_b: train_common.h's grad_weight_and_bias, with x_hat in the buffer w_hat has just left
        const int32_t z = f.z;
        if (ctx->needs_input_grad(1)) {
            at::Tensor s = s_x.reshape({-1});
            at::Tensor gw = f.digits_w
                                ? intqat::digit_matmul(g.t(), s, q_x, z)
                                : at::mm(g.t(), intqat::dequantized(HAT, q_x, s, z, /*per_row=*/s.numel() > 1));
            mask_zero_bits_(gw, bits_w);
            out[1] = gw;
        }
        // (edges: x, weight, then bias only when given: ask about edge 2 only then)
        if (f.has_bias && ctx->needs_input_grad(2)) out[2] = g.sum(0);
        return out;
    }
};

}  // namespace intqat

namespace {

at::Tensor int_linear_grouped(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                              const c10::optional<at::Tensor> &w_scale, double x_scale, int64_t x_zero_point,
                              int64_t group_size, int64_t x_qmin, int64_t x_qmax, int64_t w_qmin, int64_t w_qmax,
                              bool x_dynamic, bool w_clip_mask, int64_t gemm, bool digits_w, double eps) {
    return intqat::IntLinearGroupedTrain::apply(x, weight, bias, w_scale, x_scale, x_zero_point, group_size, x_qmin,
                                                x_qmax, w_qmin, w_qmax, x_dynamic, w_clip_mask, gemm, digits_w, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(intqat_train, m) {
    m.def("int_linear_grouped(Tensor x, Tensor weight, Tensor? bias, Tensor? w_scale, float x_scale, "
          "int x_zero_point, int group_size, int x_qmin, int x_qmax, int w_qmin, int w_qmax, bool x_dynamic, "
          "bool w_clip_mask, int gemm, bool digits_w, float eps) -> Tensor",
          int_linear_grouped);
}
