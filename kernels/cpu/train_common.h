/* What the linear C++ training steps share (train_linear.cpp, train_grouped.cpp): the fused passes they call,
 * the activation codes of the forward, the clip masks as bits, and the backward's grad_w / grad_b.
 *
 * Forward, x (M, K) fp32 contiguous:
 *     dynamic: q_x, s_x (M, 1) = per-token symmetric codes (z = 0), nothing clips (no mask)
 *     static:  q_x = quantize(x, s_x, z) with s_x (1, 1), its clip mask packed to bits (intqat.ops.masks)
 * Backward (straight-through), g (M, N) fp32:
 *     grad_w = mask_w * (gᵀ @ ((q_x - z) s_x))   or that GEMM as digits (digit_matmul.h)
 *     grad_b = sum_m g */
#ifndef INTQAT_TRAIN_COMMON_H
#define INTQAT_TRAIN_COMMON_H
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <tuple>

#include "digit_matmul.h"  // intqat::digit_matmul, intqat::dequantized, intqat::data_or_null
#include "scratch.h"  // intqat::scratch

extern "C" {  // fused.c (the library intqat.ops.cpu_kernels loads)
void intqat_quantize_rows(const float *x, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                          float z, float qmin, float qmax, int8_t *out, uint8_t *mask, int32_t *rowsum);
void intqat_quantize_rows_dynamic(const float *x, int64_t rows, int64_t cols, float qmin, float qmax, float eps,
                                  int8_t *out, float *scale, int32_t *rowsum);
void intqat_pack_bits(const uint8_t *mask, int64_t n, uint8_t *packed);
void intqat_mask_zero_bits(float *g, const uint8_t *packed, int64_t n);
}

namespace intqat {
namespace train {

/* bool (n) -> bits ((n + 7) / 8,) uint8: intqat.ops.masks.pack_mask */
inline at::Tensor packed(const at::Tensor &mask) {
    at::Tensor bits = at::empty({(mask.numel() + 7) / 8}, at::TensorOptions().dtype(at::kByte));
    if (mask.numel())
        intqat_pack_bits((const uint8_t *)mask.data_ptr() /* bool: one byte, 0 or 1 */, mask.numel(),
                         data_or_null<uint8_t>(bits));
    return bits;
}

inline at::Tensor no_bits() { return at::empty({0}, at::TensorOptions().dtype(at::kByte)); }

/* where(mask, g, 0) in place from the bits; g: a fresh contiguous fp32 result (no mask saved: nothing clips) */
inline void mask_zero_bits_(at::Tensor &g, const at::Tensor &bits) {
    if (bits.numel() && g.numel()) intqat_mask_zero_bits(data_or_null<float>(g), data_or_null<uint8_t>(bits), g.numel());
}

/* (q_x (M, K) int8, s_x (M, 1) or (1, 1) fp32, mask bits) of x (M, K) fp32 contiguous: int_linear.quantize_activation */
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activation(const at::Tensor &x, bool x_dynamic,
                                                                         double x_scale, int32_t z, int64_t x_qmin,
                                                                         int64_t x_qmax, double eps) {
    const int64_t M = x.size(0), K = x.size(1);
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor q_x = at::empty({M, K}, at::TensorOptions().dtype(at::kChar)), s_x, bits_x = no_bits();
    if (x_dynamic) {
        s_x = at::empty({M, 1}, f32);
        if (M) intqat_quantize_rows_dynamic(data_or_null<float>(x), M, K, (float)x_qmin, (float)x_qmax, (float)eps,
                                            data_or_null<int8_t>(q_x), data_or_null<float>(s_x), nullptr);
    } else {
        s_x = at::full({1, 1}, x_scale, f32);
        at::Tensor mask = scratch("mask_x", {M * K}, at::kBool);
        if (x.numel()) intqat_quantize_rows(data_or_null<float>(x), M, K, data_or_null<float>(s_x), 0, (float)z,
                                            (float)x_qmin, (float)x_qmax, data_or_null<int8_t>(q_x),
                                            (uint8_t *)mask.data_ptr(), nullptr);
        bits_x = packed(mask);
    }
    return {q_x, s_x, bits_x};
}

/* The autograd node's state: the codes, masks and scales, and the numbers the backward reads, packed into one
 * saved_data entry (saved_data is a map keyed by std::string: one insert and one lookup a step instead of four each,
 * ~0.1 us apiece on a layer whose whole step has ~20 us of fixed cost at 8 x 128 -> 10, Zen 4).
 * "step": bits 0-31 z (int32), bit 32 digits_x, bit 33 digits_w, bit 34 has_bias. */
struct StepFlags {
    int32_t z;
    bool digits_x, digits_w, has_bias;
};

inline void save_step(torch::autograd::AutogradContext *ctx, const at::Tensor &q_x, const at::Tensor &bits_x,
                      const at::Tensor &q_w, const at::Tensor &bits_w, const at::Tensor &s_x, const at::Tensor &s_w,
                      int32_t z, bool digits_x, bool digits_w, bool has_bias) {
    ctx->save_for_backward({q_x, bits_x, q_w, bits_w, s_x, s_w});
    ctx->saved_data["step"] = (int64_t)((uint64_t)(uint32_t)z | (uint64_t)digits_x << 32 | (uint64_t)digits_w << 33 |
                                        (uint64_t)has_bias << 34);
}

inline StepFlags step_flags(torch::autograd::AutogradContext *ctx) {
    const uint64_t v = (uint64_t)ctx->saved_data["step"].toInt();
    return {(int32_t)(uint32_t)(v & 0xFFFFFFFFu), (bool)(v >> 32 & 1), (bool)(v >> 33 & 1), (bool)(v >> 34 & 1)};
}

/* The backward's aten calls (mm, t, sum, the digit GEMM's _int_mm) below the autograd and ADInplaceOrView kernels,
 * which only record a graph in grad mode: ~0.1 us a call less (Zen 4). In grad mode (a double backward,
 * create_graph=True) they run as before, so what is recorded is unchanged. Made after get_saved_variables(): its
 * unpack hooks run user code (torch.utils.checkpoint recomputes the forward there, which must record as usual). */
struct BackwardDispatch {
    c10::optional<at::AutoDispatchBelowADInplaceOrView> below;
    BackwardDispatch() {
        if (!at::GradMode::is_enabled()) below.emplace();
    }
};

/* grad_w (out[1]) and grad_b (out[2]) of the saved step, each where autograd asks for it */
inline void grad_weight_and_bias(torch::autograd::AutogradContext *ctx, const StepFlags &f, const at::Tensor &g,
                                 const torch::autograd::variable_list &saved, torch::autograd::variable_list &out) {
    const at::Tensor &q_x = saved[0], &bits_w = saved[3], &s_x = saved[4];
    const int32_t z = f.z;
    if (ctx->needs_input_grad(1)) {
        // s_x (M, 1) or (1, 1) as it is: both read it through its data (a reshape to (-1,) would be one more
        // dispatched op per step)
        at::Tensor gw = f.digits_w
                            ? digit_matmul(g.t(), s_x, q_x, z)
                            : at::mm(g.t(), dequantized("x_hat", q_x, s_x, z, /*per_row=*/s_x.numel() > 1));
        mask_zero_bits_(gw, bits_w);
        out[1] = gw;
    }
    // (edges: x, weight, then bias only when given: ask about edge 2 only then)
    if (f.has_bias && ctx->needs_input_grad(2)) out[2] = g.sum(0);
}

}  // namespace train
}  // namespace intqat
#endif
