/* The backward GEMMs' operands shared by the C++ training ops (train_linear.cpp, train_grouped.cpp), so every
 * step computes them with the same calls (and the Python path's bits, intqat/ops/digit_gemm.py):
 *
 *     digit_matmul(a, col_scale, q, z)   (a * col_scale) @ (q - z) on the int8 units: a (R, C) fp32 (any strides)
 *                                        split into three int8 digit planes, one torch._int_mm of the stacked
 *                                        planes (3R, C) @ q (C, K), the exact combine -> (R, K) fp32
 *                                        (cpu_fused.digit_matmul; the split and combine are fused.c's)
 *     digit_matmul_amx(a, col_scale, q, z)   the same bits on AMX tiles (amx_digits.c: the planes accumulated and
 *                                        combined per 32x32 block; cpu_kernels.amx_digit_matmul's steps), for a
 *                                        caller the backend table sends to amx; only where intqat_amx_available()
 *     amx_packed_b + digit_matmul_amx_packed   its two halves: q packed once, then the split and tile GEMM on any
 *                                        row ranges (train_conv.cpp's grad_x: one thread per range of images)
 *     dequantized(role, q, scale, z, per_row)   (q - z) * scale per row or one scale, fp32, into this thread's
 *                                        scratch for `role` (an operand that dies in the next mm) */
#ifndef INTQAT_DIGIT_MATMUL_H
#define INTQAT_DIGIT_MATMUL_H
#include <ATen/ATen.h>

#include <cstdint>

#include "int_mm_layout.h"  // intqat::int_mm_operand
#include "scratch.h"  // intqat::scratch

extern "C" {  // fused.c (the library intqat.ops.cpu_kernels loads)
void intqat_split_digits(const float *a, int64_t R, int64_t C, int64_t rs, int64_t cs, const float *col_scale,
                         int64_t ss, int8_t *digits, int64_t ld, int64_t plane, int32_t *shift, int32_t *rowsum);
void intqat_combine_digits(const int32_t *acc, int64_t R, int64_t K, const int32_t *shift, const int32_t *rowsum,
                           int32_t z, const uint8_t *mask, float *out);
void intqat_dequantize_rows(const int8_t *q, int64_t rows, int64_t cols, const float *scale, int64_t scale_stride,
                            float z, float *out);
// amx_digits.c (stubs without AMX: the Python side asks cpu_kernels.amx_available() before it sends a call here)
void intqat_amx_pack_b(const int8_t *q, int64_t C, int64_t K, int64_t qs, int64_t ld, int64_t Kp, int8_t *bpack);
void intqat_amx_digit_gemm(const int8_t *digits, int64_t R, int64_t ld, const int8_t *bpack, int64_t K,
                           const int32_t *shift, const int32_t *rowsum, int32_t z, const uint8_t *mask, float *out);
}

namespace intqat {

template <typename T>
inline T *data_or_null(const at::Tensor &t) { return t.defined() ? t.data_ptr<T>() : nullptr; }

inline at::Tensor digit_matmul(const at::Tensor &a, const at::Tensor &col_scale, const at::Tensor &q, int32_t z,
                               at::Tensor out = at::Tensor() /* (R, K) fp32 contiguous to write into, or a new one */) {
    const int64_t R = a.size(0), C = a.size(1), K = q.size(1);
    at::Tensor digits = scratch("digits", {3, R, C}, at::kChar);
    at::Tensor shift = at::empty({R}, at::TensorOptions().dtype(at::kInt));
    at::Tensor rowsum = z ? at::empty({3, R}, at::TensorOptions().dtype(at::kInt)) : at::Tensor();
    if (!out.defined()) out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
    if (R == 0) return out;
    intqat_split_digits(data_or_null<float>(a), R, C, a.stride(0), a.stride(1), data_or_null<float>(col_scale),
                        col_scale.numel() > 1 ? 1 : 0, data_or_null<int8_t>(digits), C, R * C,
                        data_or_null<int32_t>(shift), data_or_null<int32_t>(rowsum));
    at::Tensor acc = scratch("digit_acc", {3 * R, K}, at::kInt);
    at::_int_mm_out(acc, digits.view({3 * R, C}), int_mm_operand(q));
    if (out.numel())
        intqat_combine_digits(data_or_null<int32_t>(acc), R, K, data_or_null<int32_t>(shift),
                              data_or_null<int32_t>(rowsum), z, nullptr, data_or_null<float>(out));
    return out;
}

constexpr int64_t AMX_ROWS = 32, AMX_COLS = 32, AMX_DEPTH = 64;  // cpu_kernels.AMX_ROWS, AMX_COLS, AMX_DEPTH

/* q (C, K) int8 -> AMX's packed B (amx_digits.c's layout), into this thread's scratch for `role`; ld, Kp: the
 * padded contraction depth and column count digit_matmul_amx_packed takes with it */
inline at::Tensor amx_packed_b(const char *role, const at::Tensor &q, int64_t &ld, int64_t &Kp) {
    const int64_t C = q.size(0), K = q.size(1);
    ld = (C + AMX_DEPTH - 1) / AMX_DEPTH * AMX_DEPTH;
    Kp = (K + AMX_COLS - 1) / AMX_COLS * AMX_COLS;
    at::Tensor bpack = scratch(role, {ld * Kp}, at::kChar);
    intqat_amx_pack_b(data_or_null<int8_t>(q), C, K, q.stride(0), ld, Kp, data_or_null<int8_t>(bpack));
    return bpack;
}

/* (a * col_scale) @ (q - z) with q already packed (amx_packed_b, K columns): the split and the tile GEMM. Rows are
 * independent (one shift and rowsum each), so a caller may run it on disjoint row ranges from several threads (the
 * C kernels' OpenMP loops then run on the calling thread alone: nested regions are inactive) with the same bits. */
inline at::Tensor digit_matmul_amx_packed(const at::Tensor &a, const at::Tensor &col_scale, const at::Tensor &bpack,
                                          int64_t ld, int64_t K, int32_t z, at::Tensor out = at::Tensor()) {
    const int64_t R = a.size(0), C = a.size(1);
    const int64_t Rp = (R + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    if (!out.defined()) out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
    if (R == 0 || K == 0) return out;
    at::Tensor digits = scratch("digits", {3, Rp, ld}, at::kChar);
    if (Rp > R) digits.narrow(1, R, Rp - R).zero_();  // the last row block's pad rows: zero digits
    at::Tensor shift = at::empty({R}, at::TensorOptions().dtype(at::kInt));
    at::Tensor rowsum = z ? at::empty({3, R}, at::TensorOptions().dtype(at::kInt)) : at::Tensor();
    intqat_split_digits(data_or_null<float>(a), R, C, a.stride(0), a.stride(1), data_or_null<float>(col_scale),
                        col_scale.numel() > 1 ? 1 : 0, data_or_null<int8_t>(digits), ld, Rp * ld,
                        data_or_null<int32_t>(shift), data_or_null<int32_t>(rowsum));
    intqat_amx_digit_gemm(data_or_null<int8_t>(digits), R, ld, data_or_null<int8_t>(bpack), K,
                          data_or_null<int32_t>(shift), data_or_null<int32_t>(rowsum), z, nullptr,
                          data_or_null<float>(out));
    return out;
}

inline at::Tensor digit_matmul_amx(const at::Tensor &a, const at::Tensor &col_scale, const at::Tensor &q, int32_t z,
                                   at::Tensor out = at::Tensor() /* as digit_matmul's */) {
    const int64_t R = a.size(0), K = q.size(1);
    if (!out.defined()) out = at::empty({R, K}, at::TensorOptions().dtype(at::kFloat));
    if (R == 0 || K == 0) return out;
    int64_t ld = 0, Kp = 0;
    const at::Tensor bpack = amx_packed_b("amx_b", q, ld, Kp);
    return digit_matmul_amx_packed(a, col_scale, bpack, ld, K, z, out);
}

inline at::Tensor dequantized(const char *role, const at::Tensor &q, const at::Tensor &scale, int32_t z, bool per_row) {
    at::Tensor out = scratch(role, q.sizes(), at::kFloat);
    const int64_t rows = per_row ? q.size(0) : 1;
    if (q.numel())
        intqat_dequantize_rows(data_or_null<int8_t>(q), rows, q.numel() / rows, data_or_null<float>(scale),
                               per_row ? 1 : 0, (float)z, data_or_null<float>(out));
    return out;
}

}  // namespace intqat
#endif
