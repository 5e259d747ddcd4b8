"""Straight-through backward of the integer linear, fp32, from the int8 codes (docs/numerics.md).

    grad_xhat = (grad_out * s_w[None, :]) @ float(q_w)          (M, N) @ (N, K) -> (M, K)
    grad_x    = grad_xhat * mask_x
    grad_what = grad_outᵀ @ ((float(q_x) - z_x) * s_x)          (N, M) @ (M, K) -> (N, K)
    grad_w    = grad_what * mask_w
    grad_s_w  = w_grad_factor * sum_k grad_what * d w_hat / d s_w     (LSQ, per channel)

Codes are read as int8 and converted tile by tile; neither w_hat nor x_hat is materialized.
Dots use input_precision="ieee": on GPU the default would be tf32 (10-bit mantissa).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from intqat.kernels.int_gemm import (
    _INT_DTYPES,
    alignment_pruner,
    check_matrix,
    check_same_device,
    check_vector,
    kernel_op,
    launches_skipped,
    mul_rn,
    round_half_even,
    vector_stride,
)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# GPU configs, checked by `intqat-bench kernels` for sm_80 and sm_90 (see int_gemm.py's note):
# BLOCK_R tiles the reduction axis (N for grad_input, M for grad_weight), BLOCK_O the output rows.
# The output's K tile is fixed (GPU_BLOCK_K) so the LSQ partial sums have a shape the launcher knows.
# fp32 dots (input_precision="ieee") run on the FMA units and hold both operand tiles in registers,
# so the tiles are smaller than the int8 GEMM's.
GRAD_INPUT_ALIGNED = [
    # dropped: 64x64 w4 s3 (spilled 564 B on sm_80) and 32x64 w4 s4 (52 B on sm_80)
    triton.Config({"BLOCK_O": 128, "BLOCK_R": 32, "GROUP": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_O": 64, "BLOCK_R": 32, "GROUP": 8}, num_stages=4, num_warps=4),
]
GRAD_INPUT_RAGGED = [
    # 128x32 w8 and 64x32 w4 spill 56-180 B on sm_80 with ragged operands, at any stage count
    triton.Config({"BLOCK_O": 32, "BLOCK_R": 32, "GROUP": 8}, num_stages=3, num_warps=4),
]
GRAD_WEIGHT_ALIGNED = [
    # every former config spilled (128x32 w8 s3: 684 B, 64x32 w4 s4: 696 B, 64x64 w4 s3: 8 KiB,
    # 32x64 w4 s4: 3.7 KiB): the transposed grad_out tile and x_hat in fp32 both sit in registers
    triton.Config({"BLOCK_O": 64, "BLOCK_R": 32, "GROUP": 8}, num_stages=2, num_warps=8),
    triton.Config({"BLOCK_O": 32, "BLOCK_R": 32, "GROUP": 8}, num_stages=2, num_warps=4),
    triton.Config({"BLOCK_O": 32, "BLOCK_R": 16, "GROUP": 8}, num_stages=2, num_warps=4),
]
GRAD_WEIGHT_RAGGED = [
    # 64x32 w8 s2 spills 8 B on sm_90 with ragged operands
    triton.Config({"BLOCK_O": 32, "BLOCK_R": 32, "GROUP": 8}, num_stages=2, num_warps=4),
    triton.Config({"BLOCK_O": 32, "BLOCK_R": 16, "GROUP": 8}, num_stages=2, num_warps=4),
]


def gpu_configs(kernel: str) -> list[triton.Config]:
    """GPU configs of "grad_input" or "grad_weight", whatever TRITON_INTERPRET says."""
    return {"grad_input": GRAD_INPUT_ALIGNED + GRAD_INPUT_RAGGED,
            "grad_weight": GRAD_WEIGHT_ALIGNED + GRAD_WEIGHT_RAGGED}[kernel]


def get_autotune_config(kernel: str) -> list[triton.Config]:
    if triton.knobs.runtime.interpret:
        return [triton.Config({"BLOCK_O": 32, "BLOCK_R": 32, "GROUP": 4})]
    return gpu_configs(kernel)


prune_grad_input_configs = alignment_pruner(GRAD_INPUT_ALIGNED, GRAD_INPUT_RAGGED, ("grad_out_ptr", "q_w_ptr"))
prune_grad_weight_configs = alignment_pruner(GRAD_WEIGHT_ALIGNED, GRAD_WEIGHT_RAGGED, ("grad_out_ptr", "q_x_ptr"))


GPU_BLOCK_K = 64
_BLOCK_K = 32 if triton.knobs.runtime.interpret else GPU_BLOCK_K


@triton.jit
def _grouped_pids(pid, num_pid_o, num_pid_k, GROUP: tl.constexpr):
    # GROUP output row-blocks in a row share the same K columns while they sit in L2.
    num_pid_in_group = GROUP * num_pid_k
    group_id = pid // num_pid_in_group
    first_pid_o = group_id * GROUP
    group_size = min(num_pid_o - first_pid_o, GROUP)
    pid_o = first_pid_o + ((pid % num_pid_in_group) % group_size)
    pid_k = (pid % num_pid_in_group) // group_size
    return pid_o, pid_k


@triton.autotune(configs=get_autotune_config("grad_input"), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_grad_input_configs})
@triton.jit
def _ste_grad_input_kernel(
    # pointers
    grad_out_ptr,  # (M, N) fp32 / bf16 / fp16
    q_w_ptr,  # (N, K) int8
    w_scale_ptr,  # (N,) fp32
    mask_x_ptr,  # (M, K) bool, or None
    grad_x_ptr,  # (M, K) fp32, or None (no mask: grad_x is grad_xhat)
    grad_xhat_ptr,  # (M, K) fp32
    # sizes
    M,
    N,
    K,
    # strides
    stride_gm,
    stride_gn,
    stride_wn,
    stride_wk,
    stride_ws,
    stride_mask_m,
    stride_mask_k,
    stride_om,  # grad_x and grad_xhat share one layout
    stride_ok,
    # meta-parameters
    HAS_MASK: tl.constexpr,
    BLOCK_O: tl.constexpr,  # rows of M
    BLOCK_R: tl.constexpr,  # reduction over N
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_m, pid_k = _grouped_pids(tl.program_id(0), tl.cdiv(M, BLOCK_O), tl.cdiv(K, BLOCK_K), GROUP)
    offs_m = pid_m.to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_R)
    mask_m = offs_m < M
    mask_k = offs_k < K
    g_ptrs = grad_out_ptr + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn  # (BLOCK_O, BLOCK_R)
    w_ptrs = q_w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # (BLOCK_R, BLOCK_K)

    # grad_xhat = (grad_out * w_scale[None, :]) @ float(q_w)
    acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    for n in range(0, tl.cdiv(N, BLOCK_R)):
        mask_n = offs_n < N - n * BLOCK_R
        g = tl.load(g_ptrs, mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        w_scale = tl.load(w_scale_ptr + (n * BLOCK_R + offs_n) * stride_ws, mask=mask_n, other=0.0)
        q_w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0)
        acc = tl.dot(g * w_scale[None, :], q_w.to(tl.float32), acc, input_precision="ieee")
        g_ptrs += BLOCK_R * stride_gn
        w_ptrs += BLOCK_R * stride_wn

    mask_o = mask_m[:, None] & mask_k[None, :]
    out_offs = offs_m[:, None] * stride_om + offs_k[None, :] * stride_ok
    tl.store(grad_xhat_ptr + out_offs, acc, mask=mask_o)
    if HAS_MASK:
        # grad_x = grad_xhat * mask_x     (a product, as torch's STE: nan * 0 stays nan)
        keep = tl.load(mask_x_ptr + offs_m[:, None] * stride_mask_m + offs_k[None, :] * stride_mask_k,
                       mask=mask_o, other=0)
        tl.store(grad_x_ptr + out_offs, acc * keep.to(tl.float32), mask=mask_o)


@triton.autotune(configs=get_autotune_config("grad_weight"), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_grad_weight_configs})
@triton.jit
def _ste_grad_weight_kernel(
    # pointers
    grad_out_ptr,  # (M, N) fp32 / bf16 / fp16
    q_x_ptr,  # (M, K) int8
    x_scale_ptr,  # (1,) or (M,) fp32
    x_zero_point_ptr,  # (1,) or (M,) int32 / int64
    mask_w_ptr,  # (N, K) bool, or None
    weight_ptr,  # (N, K) float        [LSQ]
    w_inv_scale_ptr,  # (N,) fp32 = float32(1 / w_scale)   [LSQ]
    grad_w_ptr,  # (N, K) fp32
    grad_s_partial_ptr,  # (N, cdiv(K, BLOCK_K)) fp32   [LSQ]
    # sizes
    M,
    N,
    K,
    # strides (x vectors: 0 when per tensor)
    stride_gm,
    stride_gn,
    stride_xm,
    stride_xk,
    stride_xs,
    stride_xzp,
    stride_mask_n,
    stride_mask_k,
    stride_wt_n,
    stride_wt_k,
    stride_wis,
    stride_on,
    stride_ok,
    stride_pn,
    stride_pk,
    # weight code range   [LSQ]
    w_qmin,
    w_qmax,
    # meta-parameters
    HAS_MASK: tl.constexpr,
    LSQ: tl.constexpr,
    BLOCK_O: tl.constexpr,  # rows of N
    BLOCK_R: tl.constexpr,  # reduction over M
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid_n, pid_k = _grouped_pids(tl.program_id(0), tl.cdiv(N, BLOCK_O), tl.cdiv(K, BLOCK_K), GROUP)
    offs_n = pid_n.to(tl.int64) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_R)
    mask_n = offs_n < N
    mask_k = offs_k < K
    g_ptrs = grad_out_ptr + offs_n[:, None] * stride_gn + offs_m[None, :] * stride_gm  # (BLOCK_O, BLOCK_R) = gᵀ
    x_ptrs = q_x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk  # (BLOCK_R, BLOCK_K)

    # grad_what = grad_outᵀ @ x_hat,   x_hat = (float(q_x) - z_x[m]) * s_x[m]
    acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
    for m in range(0, tl.cdiv(M, BLOCK_R)):
        mask_m = offs_m < M - m * BLOCK_R
        rows = m * BLOCK_R + offs_m
        g_t = tl.load(g_ptrs, mask=mask_n[:, None] & mask_m[None, :], other=0.0).to(tl.float32)
        x_scale = tl.load(x_scale_ptr + rows * stride_xs, mask=mask_m, other=0.0)
        x_zero_point = tl.load(x_zero_point_ptr + rows * stride_xzp, mask=mask_m, other=0).to(tl.float32)
        mask_x = mask_m[:, None] & mask_k[None, :]
        q_x = tl.load(x_ptrs, mask=mask_x, other=0)
        x_hat = (q_x.to(tl.float32) - x_zero_point[:, None]) * x_scale[:, None]
        x_hat = tl.where(mask_x, x_hat, 0.0)
        acc = tl.dot(g_t, x_hat, acc, input_precision="ieee")
        g_ptrs += BLOCK_R * stride_gm
        x_ptrs += BLOCK_R * stride_xm

    mask_o = mask_n[:, None] & mask_k[None, :]
    grad_w = acc
    if HAS_MASK:
        # grad_w = grad_what * mask_w
        keep = tl.load(mask_w_ptr + offs_n[:, None] * stride_mask_n + offs_k[None, :] * stride_mask_k,
                       mask=mask_o, other=0)
        grad_w = acc * keep.to(tl.float32)
    tl.store(grad_w_ptr + offs_n[:, None] * stride_on + offs_k[None, :] * stride_ok, grad_w, mask=mask_o)

    if LSQ:
        # v = w * inv_s[n], r = nearbyint(v)        (z_w = 0)
        # d w_hat / d s = r - v  where qmin <= r <= qmax,  qmin  where r < qmin,  qmax  where r > qmax
        # partial[n, pid_k] = sum_{k in tile} grad_what[n, k] * d w_hat / d s[n, k]
        w = tl.load(weight_ptr + offs_n[:, None] * stride_wt_n + offs_k[None, :] * stride_wt_k,
                    mask=mask_o, other=0.0).to(tl.float32)
        inv_s = tl.load(w_inv_scale_ptr + offs_n * stride_wis, mask=mask_n, other=0.0)
        v = mul_rn(w, inv_s[:, None])  # rounded before r - v, as on the CPU (no fma)
        r = round_half_even(v)
        lo = w_qmin * 1.0  # int -> fp32, also if the launcher specialized it to a constant
        hi = w_qmax * 1.0
        ds = tl.where(r < lo, lo, tl.where(r > hi, hi, r - v))
        ds = tl.where(mask_o, ds, 0.0)
        partial = tl.sum(acc * ds, axis=1)  # (BLOCK_O,)
        tl.store(grad_s_partial_ptr + offs_n * stride_pn + pid_k * stride_pk, partial, mask=mask_n)


# ---------------------------------------------------------------------------------------------
# Launchers. Custom ops cannot return aliased or optional outputs, so each maskless / non-LSQ
# variant is its own op and the public functions below pick one.
# ---------------------------------------------------------------------------------------------


def _check_grad_input(grad_out: Tensor, q_w: Tensor, w_scale: Tensor, mask_x: Optional[Tensor]) -> None:
    check_matrix("grad_out", grad_out, _GRAD_DTYPES)
    check_matrix("q_w", q_w, (torch.int8,))
    if grad_out.shape[1] != q_w.shape[0]:
        raise ValueError(
            f"grad_out (M, N) and q_w (N, K) must share N, got grad_out {tuple(grad_out.shape)} "
            f"and q_w {tuple(q_w.shape)}"
        )
    check_vector("w_scale", w_scale, (q_w.shape[0],), (torch.float32,))
    if mask_x is not None:
        check_matrix("mask_x", mask_x, (torch.bool,))
        want = (grad_out.shape[0], q_w.shape[1])
        if tuple(mask_x.shape) != want:
            raise ValueError(f"mask_x must have shape (M, K) = {want}, got {tuple(mask_x.shape)}")
    check_same_device(grad_out=grad_out, q_w=q_w, w_scale=w_scale, mask_x=mask_x)


def grad_input_launch_args(grad_out, q_w, w_scale, mask_x, grad_x, grad_xhat, block_k=None) -> tuple[tuple, dict]:
    """(positional args, constexpr kwargs) of one _ste_grad_input_kernel launch; shared with
    `intqat-bench kernels`, which compiles the kernel for these."""
    M, N = grad_out.shape
    K = q_w.shape[1]
    args = (
        grad_out, q_w, w_scale, mask_x, grad_x, grad_xhat,
        M, N, K,
        grad_out.stride(0), grad_out.stride(1), q_w.stride(0), q_w.stride(1), vector_stride(w_scale),
        mask_x.stride(0) if mask_x is not None else 0, mask_x.stride(1) if mask_x is not None else 0,
        grad_xhat.stride(0), grad_xhat.stride(1),
    )
    return args, {"HAS_MASK": mask_x is not None, "BLOCK_K": block_k or _BLOCK_K}


def _launch_grad_input(grad_out, q_w, w_scale, mask_x, grad_x, grad_xhat) -> None:
    M, N = grad_out.shape
    K = q_w.shape[1]
    if M == 0 or K == 0 or launches_skipped():  # N == 0 runs: the kernel writes zeros
        return

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_O"]) * triton.cdiv(K, _BLOCK_K),)

    args, constexprs = grad_input_launch_args(grad_out, q_w, w_scale, mask_x, grad_x, grad_xhat)
    wrap_triton(_ste_grad_input_kernel)[grid](*args, **constexprs)


@kernel_op("intqat::ste_grad_xhat")
def ste_grad_xhat(grad_out: Tensor, q_w: Tensor, w_scale: Tensor) -> Tensor:
    """grad_xhat = (grad_out * w_scale[None, :]) @ float(q_w), (M, K) fp32."""
    _check_grad_input(grad_out, q_w, w_scale, None)
    grad_xhat = torch.empty((grad_out.shape[0], q_w.shape[1]), dtype=torch.float32, device=grad_out.device)
    _launch_grad_input(grad_out, q_w, w_scale, None, None, grad_xhat)
    return grad_xhat


@kernel_op("intqat::ste_grad_input_masked")
def ste_grad_input_masked(grad_out: Tensor, q_w: Tensor, w_scale: Tensor, mask_x: Tensor) -> tuple[Tensor, Tensor]:
    """(grad_x, grad_xhat): grad_xhat as ste_grad_xhat, grad_x = grad_xhat * mask_x."""
    _check_grad_input(grad_out, q_w, w_scale, mask_x)
    shape = (grad_out.shape[0], q_w.shape[1])
    grad_xhat = torch.empty(shape, dtype=torch.float32, device=grad_out.device)
    grad_x = torch.empty(shape, dtype=torch.float32, device=grad_out.device)
    _launch_grad_input(grad_out, q_w, w_scale, mask_x, grad_x, grad_xhat)
    return grad_x, grad_xhat


def ste_grad_input(
    grad_out: Tensor, q_w: Tensor, w_scale: Tensor, mask_x: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    """Input gradient of the integer linear: (grad_x, grad_xhat), both (M, K) fp32.

    grad_xhat = (grad_out * w_scale[None, :]) @ float(q_w) is dL/dx_hat (what an LSQ
    activation scale needs); grad_x = grad_xhat * mask_x. Without a mask the two are the
    same tensor.
    """
    if mask_x is None:
        grad_xhat = ste_grad_xhat(grad_out, q_w, w_scale)
        return grad_xhat, grad_xhat
    return ste_grad_input_masked(grad_out, q_w, w_scale, mask_x)


def _check_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w) -> tuple[int, int, int]:
    check_matrix("grad_out", grad_out, _GRAD_DTYPES)
    check_matrix("q_x", q_x, (torch.int8,))
    if grad_out.shape[0] != q_x.shape[0]:
        raise ValueError(
            f"grad_out (M, N) and q_x (M, K) must share M, got grad_out {tuple(grad_out.shape)} "
            f"and q_x {tuple(q_x.shape)}"
        )
    M, N = grad_out.shape
    K = q_x.shape[1]
    check_vector("x_scale", x_scale, (1, M), (torch.float32,))
    check_vector("x_zero_point", x_zero_point, (1, M), _INT_DTYPES)
    if mask_w is not None:
        check_matrix("mask_w", mask_w, (torch.bool,))
        if tuple(mask_w.shape) != (N, K):
            raise ValueError(f"mask_w must have shape (N, K) = {(N, K)}, got {tuple(mask_w.shape)}")
    check_same_device(grad_out=grad_out, q_x=q_x, x_scale=x_scale, x_zero_point=x_zero_point, mask_w=mask_w)
    return M, N, K


def grad_weight_launch_args(grad_out, q_x, x_scale, x_zero_point, mask_w, grad_w, *, weight=None, w_inv_scale=None,
                            grad_s_partial=None, w_qmin=0, w_qmax=0, block_k=None) -> tuple[tuple, dict]:
    """(positional args, constexpr kwargs) of one _ste_grad_weight_kernel launch; shared with
    `intqat-bench kernels`, which compiles the kernel for these."""
    M, N = grad_out.shape
    K = q_x.shape[1]
    lsq = weight is not None
    args = (
        grad_out, q_x, x_scale, x_zero_point, mask_w, weight, w_inv_scale, grad_w, grad_s_partial,
        M, N, K,
        grad_out.stride(0), grad_out.stride(1), q_x.stride(0), q_x.stride(1),
        vector_stride(x_scale), vector_stride(x_zero_point),
        mask_w.stride(0) if mask_w is not None else 0, mask_w.stride(1) if mask_w is not None else 0,
        weight.stride(0) if lsq else 0, weight.stride(1) if lsq else 0, vector_stride(w_inv_scale),
        grad_w.stride(0), grad_w.stride(1),
        grad_s_partial.stride(0) if lsq else 0, grad_s_partial.stride(1) if lsq else 0,
        w_qmin, w_qmax,
    )
    return args, {"HAS_MASK": mask_w is not None, "LSQ": lsq, "BLOCK_K": block_k or _BLOCK_K}


def _launch_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w, grad_w, **lsq) -> None:
    N = grad_out.shape[1]
    K = q_x.shape[1]
    if N == 0 or K == 0 or launches_skipped():  # M == 0 runs: the kernel writes zeros
        return

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_O"]) * triton.cdiv(K, _BLOCK_K),)

    args, constexprs = grad_weight_launch_args(grad_out, q_x, x_scale, x_zero_point, mask_w, grad_w, **lsq)
    wrap_triton(_ste_grad_weight_kernel)[grid](*args, **constexprs)


@kernel_op("intqat::ste_grad_weight_plain")
def ste_grad_weight_plain(
    grad_out: Tensor, q_x: Tensor, x_scale: Tensor, x_zero_point: Tensor, mask_w: Optional[Tensor] = None
) -> Tensor:
    """grad_w = (grad_outᵀ @ ((float(q_x) - z_x) * x_scale)) * mask_w, (N, K) fp32."""
    M, N, K = _check_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w)
    grad_w = torch.empty((N, K), dtype=torch.float32, device=grad_out.device)
    _launch_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w, grad_w)
    return grad_w


@kernel_op("intqat::ste_grad_weight_lsq")
def ste_grad_weight_lsq(
    grad_out: Tensor,
    q_x: Tensor,
    x_scale: Tensor,
    x_zero_point: Tensor,
    mask_w: Optional[Tensor],
    weight: Tensor,
    w_scale: Tensor,
    w_qmin: int,
    w_qmax: int,
    w_grad_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(grad_w, grad_w_scale): grad_w as ste_grad_weight_plain; the per-channel LSQ scale
    gradient grad_w_scale[n] = w_grad_factor * sum_k grad_what[n, k] * d w_hat / d s[n, k]
    (docs/numerics.md, z_w = 0), = torch._fake_quantize_learnable_per_channel_affine's backward."""
    M, N, K = _check_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w)
    check_matrix("weight", weight, _GRAD_DTYPES)
    if tuple(weight.shape) != (N, K):
        raise ValueError(f"weight must have shape (N, K) = {(N, K)}, got {tuple(weight.shape)}")
    check_vector("w_scale", w_scale, (N,), (torch.float32,))
    if w_qmin > w_qmax:
        raise ValueError(f"need w_qmin <= w_qmax, got w_qmin={w_qmin}, w_qmax={w_qmax}")
    check_same_device(grad_out=grad_out, weight=weight, w_scale=w_scale)

    grad_w = torch.empty((N, K), dtype=torch.float32, device=grad_out.device)
    # inv_s = float32(1 / s) once per channel; the kernel multiplies (docs/numerics.md).
    w_inv_scale = torch.reciprocal(w_scale)
    grad_s_partial = torch.empty((N, triton.cdiv(K, _BLOCK_K)), dtype=torch.float32, device=grad_out.device)
    _launch_grad_weight(grad_out, q_x, x_scale, x_zero_point, mask_w, grad_w, weight=weight,
                        w_inv_scale=w_inv_scale, grad_s_partial=grad_s_partial, w_qmin=w_qmin, w_qmax=w_qmax)
    # Sum the per-tile partials in a fixed order: deterministic, no atomics.
    grad_w_scale = grad_s_partial.sum(dim=1) * w_grad_factor
    return grad_w, grad_w_scale


def ste_grad_weight(
    grad_out: Tensor,
    q_x: Tensor,
    x_scale: Tensor,
    x_zero_point: Tensor,
    mask_w: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    w_scale: Optional[Tensor] = None,
    w_qmin: Optional[int] = None,
    w_qmax: Optional[int] = None,
    w_grad_factor: float = 1.0,
) -> tuple[Tensor, Optional[Tensor]]:
    """Weight gradient of the integer linear: (grad_w (N, K) fp32, grad_w_scale (N,) or None).

    grad_what = grad_outᵀ @ x_hat, x_hat = (float(q_x) - z_x) * x_scale (per tensor or row);
    grad_w = grad_what * mask_w. Given weight and w_scale (learnable per-channel weight scale,
    LSQ; w_qmin and w_qmax then required) also returns the scale gradient, else None; the
    code range alone is ignored, so callers may always pass it.
    """
    if weight is None and w_scale is None:
        return ste_grad_weight_plain(grad_out, q_x, x_scale, x_zero_point, mask_w), None
    if weight is None or w_scale is None or w_qmin is None or w_qmax is None:
        raise ValueError("the LSQ weight-scale gradient needs all of weight, w_scale, w_qmin and w_qmax")
    return ste_grad_weight_lsq(grad_out, q_x, x_scale, x_zero_point, mask_w, weight, w_scale,
                               int(w_qmin), int(w_qmax), float(w_grad_factor))
