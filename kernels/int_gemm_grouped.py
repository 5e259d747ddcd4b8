"""int8 x int8 GEMM with per-group weight scales applied inside the K loop (intqat/ops/int_linear_grouped.py):

    for g in 0 .. G-1 (BLOCK_K = group_size):
        acc_g = sum_{k in g} q_x[m, k] * q_w[n, k] - z_x * colsum_g(q_w)[n]    int32, exact
        t     = t + float32(acc_g) * s_w[n, g]                                 fp32, increasing g
    y = t * s_x[m] + b[n]

The group's int32 sum never leaves registers. In the interpreter every step rounds as the CPU path
does (bit for bit); a GPU may contract multiply-add into an FMA (then y within 1 ulp per step).
`int_linear_grouped_sums` stores the per-group int32 sums (G, M, N) instead: the exact part, checked
bit for bit against the CPU path.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from intqat.kernels.int_gemm import _INT_DTYPES, check_matrix, check_same_device, check_vector, kernel_op, \
    launches_skipped, vector_stride


def get_autotune_config() -> list[triton.Config]:
    if triton.knobs.runtime.interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32})]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_stages=4, num_warps=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_stages=4, num_warps=4),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_stages=4, num_warps=4),
    ]


@triton.autotune(configs=get_autotune_config(), key=["M", "N", "K", "GROUP_SIZE"])
@triton.jit
def _int_gemm_grouped_kernel(
    # pointers
    a_ptr,  # (M, K) int8 activation codes
    w_ptr,  # (N, K) int8 weight codes
    s_w_ptr,  # (N, G) fp32 group scales
    x_scale_ptr,  # (1,) or (M,) fp32
    x_zero_point_ptr,  # (1,) int32
    bias_ptr,  # (N,) fp32 or None
    c_ptr,  # (M, N) fp32 y, or (G, M, N) int32 group sums [STORE_SUMS]
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_xs,
    stride_bias,
    stride_cg,
    stride_cm,
    stride_cn,
    # meta-parameters
    GROUP_SIZE: tl.constexpr,  # = BLOCK_K: one K step per group
    HAS_BIAS: tl.constexpr,
    STORE_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_SIZE)
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_c = mask_m[:, None] & mask_n[None, :]
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, GROUP_SIZE)
    b_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # (GROUP_SIZE, BLOCK_N) = q_wᵀ
    z = tl.load(x_zero_point_ptr).to(tl.int32)

    t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP_SIZE):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0)
        # acc_g = sum_{k in g} (q_x - z) * q_w = a @ b - z * colsum_g(b)      int32, exact
        acc = tl.dot(a, b, out_dtype=tl.int32)
        acc = acc - z * tl.sum(b.to(tl.int32), axis=0)[None, :]
        if STORE_SUMS:
            c_ptrs = c_ptr + g * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, acc, mask=mask_c)
        else:
            # t = t + float32(acc_g) * s_w[n, g]: two roundings, in increasing g
            s_w = tl.load(s_w_ptr + offs_n * stride_sn + g * stride_sg, mask=mask_n, other=0.0)
            t = t + acc.to(tl.float32) * s_w[None, :]
        a_ptrs += GROUP_SIZE * stride_ak
        b_ptrs += GROUP_SIZE * stride_wk

    if not STORE_SUMS:
        # y = t * s_x[m] + b[n]
        x_scale = tl.load(x_scale_ptr + offs_m * stride_xs, mask=mask_m, other=0.0)
        y = t * x_scale[:, None]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, y, mask=mask_c)


def _check(q_x: Tensor, q_w: Tensor, w_scale: Tensor, x_zero_point: Tensor) -> tuple[int, int, int, int]:
    check_matrix("q_x", q_x, (torch.int8,))
    check_matrix("q_w", q_w, (torch.int8,))
    check_matrix("w_scale", w_scale, (torch.float32,))
    M, K = q_x.shape
    N = q_w.shape[0]
    if q_w.shape[1] != K or w_scale.shape[0] != N or w_scale.shape[1] == 0 or K % w_scale.shape[1]:
        raise ValueError(f"q_x (M, K), q_w (N, K) and w_scale (N, G) with G dividing K, got {tuple(q_x.shape)}, "
                         f"{tuple(q_w.shape)}, {tuple(w_scale.shape)}")
    gs = K // w_scale.shape[1]
    if gs < 16 or gs & (gs - 1):
        raise ValueError(f"the Triton per-group kernel takes a power-of-two group size >= 16, got {gs}")
    check_vector("x_zero_point", x_zero_point, (1,), _INT_DTYPES)
    return M, N, K, gs


def _launch(q_x, q_w, w_scale, x_scale, x_zero_point, bias, c, store_sums: bool) -> Tensor:
    M, K = q_x.shape
    N = q_w.shape[0]
    if launches_skipped() or M == 0 or N == 0:
        return c
    G = w_scale.shape[1]
    sg, sm, sn = (c.stride(0), c.stride(1), c.stride(2)) if store_sums else (0, c.stride(0), c.stride(1))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))

    wrap_triton(_int_gemm_grouped_kernel)[grid](
        q_x, q_w, w_scale, x_scale, x_zero_point, bias, c,
        M, N, K,
        q_x.stride(0), q_x.stride(1), q_w.stride(0), q_w.stride(1), w_scale.stride(0), w_scale.stride(1),
        vector_stride(x_scale), vector_stride(bias), sg, sm, sn,
        GROUP_SIZE=K // G, HAS_BIAS=bias is not None, STORE_SUMS=store_sums,
    )
    return c


@kernel_op("intqat::int_linear_grouped_sums")
def int_linear_grouped_sums(q_x: Tensor, q_w: Tensor, w_scale: Tensor, x_zero_point: Tensor) -> Tensor:
    """(G, M, N) int32: acc_g[m, n] = sum_{k in group g} (q_x[m, k] - z_x) * q_w[n, k], exact."""
    M, N, K, gs = _check(q_x, q_w, w_scale, x_zero_point)
    c = torch.empty((K // gs, M, N), dtype=torch.int32, device=q_x.device)
    return _launch(q_x, q_w, w_scale, None, x_zero_point, None, c, True)


@kernel_op("intqat::int_linear_grouped_forward")
def int_linear_grouped_forward(q_x: Tensor, q_w: Tensor, x_scale: Tensor, x_zero_point: Tensor, w_scale: Tensor,
                               bias: Optional[Tensor]) -> Tensor:
    """y (M, N) fp32 = (sum over g in increasing order of float32(acc_g) * w_scale[:, g]) * x_scale[m] + bias.

    q_x (M, K) int8, q_w (N, K) int8, x_scale (1,) or (M,) fp32, x_zero_point (1,) int32 (0 for
    symmetric activations), w_scale (N, G) fp32, bias (N,) fp32 or None.
    """
    M, N, K, gs = _check(q_x, q_w, w_scale, x_zero_point)
    check_vector("x_scale", x_scale, (1, M), (torch.float32,))
    if bias is not None:
        check_vector("bias", bias, (N,), (torch.float32,))
    check_same_device(q_x=q_x, q_w=q_w, x_scale=x_scale, x_zero_point=x_zero_point, w_scale=w_scale, bias=bias)
    c = torch.empty((M, N), dtype=torch.float32, device=q_x.device)
    return _launch(q_x, q_w, w_scale, x_scale, x_zero_point, bias, c, False)
