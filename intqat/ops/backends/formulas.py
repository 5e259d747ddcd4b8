"""The pure-torch formulas the reference backend computes with, which the ops reuse.

They live here, below the backend table, so that no backend imports an op file (tests/test_layering.py):
the digit split and combine of the digit backward (intqat.ops.digit_gemm), the clip-mask packing in torch
ops (intqat.ops.masks), the weight column sums of the zero-point correction (intqat.ops.int_linear), and the
per-group integer linear (intqat.ops.int_linear_grouped). The op modules re-export them under their old
names. docs/numerics.md has the why of each.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from intqat.ops.backends.base import tracing

__all__ = ["CONV_DIGITS_X_MIN_OUT_CHANNELS", "conv_grad_x_digits_may_pay", "split_digits", "combine_digits", "pack_mask_torch", "unpack_mask_torch", "weight_colsum", "group_sums",
           "grouped_reference"]

# An integer conv's grad_x as a digit GEMM contracts over its O output channels and writes grad_cols, kh*kw times
# the input gradient, which the fold then sums: a cost per output element that the int8 units do not shorten. With
# a contraction of 64 the digit GEMM alone is no faster than the fp32 GEMM (AMX Xeon, 2026-11-28: (4096, 64) @
# (64, 576) 1.02x), and with the fold the 64 -> 64 3x3 conv's grad_x was 1.14x fp32's convolution_backward; from
# 128 channels it was 0.69x-0.79x. Every class's digit GEMM (AMX tiles or torch._int_mm) does three int8 planes
# per fp32 one, so below this contraction no class gains; the linear layers' shape rules then apply on top.
CONV_DIGITS_X_MIN_OUT_CHANNELS = 128


def conv_grad_x_digits_may_pay(gemm_shape: tuple[int, int, int]) -> str | None:
    """None, or why an integer conv's grad_x stays fp32 whatever the linear rule says, for its im2col GEMM
    gemm_shape = (B*Ho*Wo, C*kh*kw, O)."""
    if gemm_shape[2] < CONV_DIGITS_X_MIN_OUT_CHANNELS:
        return (f"{gemm_shape[2]} output channels < CONV_DIGITS_X_MIN_OUT_CHANNELS = {CONV_DIGITS_X_MIN_OUT_CHANNELS} "
                "(grad_cols + fold cost more than the short contraction saves)")
    return None


_DIGIT = 128.0  # 2^7: the weight of one digit relative to the next
_SCALE_ALL = 16384.0  # 2^14: d0's weight relative to d2
# x * _GATHER moves the low bit of byte i of an int64 to bit 56 + i (the classic bit-gather multiply:
# every cross term lands below bit 56 or past bit 63), so (x * _GATHER) >> 56 is the packed byte.
_GATHER = 0x0102040810204080


def split_digits(a: Tensor, col_scale: Tensor, need_rowsum: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """a (R, C) fp32 times col_scale ((C,) or one value) -> three int8 digit planes, torch ops.

    Returns (digits int8 (3, R, C), shift int32 (R,), digit row sums int32 (3, R) or None).
    shift[r] = t with max_c |v[r, c]| * 2^t in [63.75, 127.5), v = a * col_scale in fp32. A row with
    a NaN or an infinity gets shift INT32_MIN and zero digits (combine_digits writes NaN there).
    """
    v = a.to(torch.float32) * col_scale.detach().to(torch.float32).reshape(1, -1)  # one fp32 rounding
    amax = v.abs().amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])
    finite = torch.isfinite(amax)
    amax = torch.where(finite, amax, 0.0)
    # amax = f * 2^e, f in [0.5, 1). frexp of the fp32 value (the same e as of its double): inductor's
    # vectorized frexp of doubles does not compile (torch 2.13), and a gᵀ operand vectorizes it.
    _, e = torch.frexp(amax)
    amax = amax.double()
    t = 7 - e.to(torch.int32)
    t = t - (amax * torch.exp2(t.double()) >= 127.5).to(torch.int32)
    x = v.double() * torch.exp2(t.double()).unsqueeze(1)  # exact: a power of two
    x = torch.where(finite.unsqueeze(1), x, 0.0)
    d0 = torch.round(x)
    r1 = (x - d0) * _DIGIT
    d1 = torch.round(r1)
    d2 = torch.round((r1 - d1) * _DIGIT)
    digits = torch.stack([d0, d1, d2]).to(torch.int8)
    shift = torch.where(finite, t, torch.iinfo(torch.int32).min)
    rowsum = digits.sum(dim=2, dtype=torch.int32) if need_rowsum else None
    return digits, shift, rowsum


def combine_digits(acc: Tensor, shift: Tensor, rowsum: Tensor | None, z: int | Tensor,
                   mask: Tensor | None) -> Tensor:
    """acc int32 (3R, K), the digit planes times codes q (C, K) -> (a @ (q - z)) fp32 (R, K), torch ops.

    out[r, k] = float32(2^-(t + 14) * sum_j 2^(14 - 7j) * (acc_j[r, k] - z * rowsum_j[r])), exact
    until the one rounding to fp32; NaN on rows the split flagged; where(mask, out, 0) if a mask is given.
    """
    R, K = acc.shape[0] // 3, acc.shape[1]
    planes = acc.reshape(3, R, K).double()
    if rowsum is not None and isinstance(z, Tensor):  # traced (compile): z is data, not a constant
        planes = planes - z.reshape(()).double() * rowsum.double().unsqueeze(2)
    elif rowsum is not None and z:
        planes = planes - float(z) * rowsum.double().unsqueeze(2)
    total = planes[0] * _SCALE_ALL + planes[1] * _DIGIT + planes[2]
    bad = shift == torch.iinfo(torch.int32).min
    p = torch.exp2(-(torch.where(bad, 0, shift).double() + 14.0))
    out = (total * p.unsqueeze(1)).to(torch.float32)
    out = torch.where(bad.unsqueeze(1), float("nan"), out)
    return out if mask is None else torch.where(mask, out, 0.0)


def pack_mask_torch(mask: Tensor) -> Tensor:
    """`pack_mask` in torch ops (the reference backend's)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    lanes = flat.view(torch.uint8).view(torch.int64)  # 8 mask bytes (0 / 1) per int64
    return ((lanes * _GATHER) >> 56).to(torch.uint8)  # wraps mod 2^64; the cast keeps bits 56..63


def unpack_mask_torch(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """`unpack_mask` in torch ops (the reference backend's)."""
    n = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts).bitwise_and_(1)  # (n / 8, 8) of 0 / 1
    # != 0, not .view(torch.bool): inductor's CPU code for a uint8 -> bool bit cast does not compile
    # (Vectorized<bool> has no cast), which broke torch.compile of every static-activation layer after a norm
    return bits.reshape(-1)[:n].ne(0).view(shape)


def weight_colsum(q_w: Tensor) -> Tensor:
    """colsum_k(q_w) (N,) int32 for q_w (N, K) int8.

    Summed in float32: every partial sum is an integer below 128 * K <= 2^24 while K <= 131072
    (int_mm's own int32 bound), so it is exact, and 4x faster than an int32 sum here (that one
    widens the whole matrix to int32 first).
    """
    if q_w.shape[-1] <= 131072:
        return q_w.to(torch.float32).sum(dim=1).to(torch.int32)
    return q_w.sum(dim=1, dtype=torch.int32)


def group_sums(q_x: Tensor, q_w: Tensor, G: int, z_x: Tensor | None) -> Tensor:
    """acc (G, M, N) fp32 holding the exact int32 group sums of (q_x - z_x) * q_w.

    Traced (what exported programs hold): one batched fp32 GEMM of the codes: every partial sum is an
    integer of magnitude <= gs * 2^14 <= 2^24, so any summation order gives the exact value. Eager on the
    CPU (the definition the kernels are tested against): one batched int64 GEMM, aten's own integer loop,
    sharing no kernel with them (docs/numerics.md, "The definition does not lean on the kernels it checks").
    The same integers either way. The zero-point correction z_x * colsum_g(q_w) is applied in int32 (the
    difference may exceed 2^24).
    """
    M, K = q_x.shape
    N = q_w.shape[0]
    gs = K // G
    exact = torch.int64 if q_x.is_cpu and not tracing(q_x, q_w, z_x) else torch.float32
    xg = q_x.to(exact).reshape(M, G, gs).transpose(0, 1)  # (G, M, gs)
    wg = q_w.to(exact).reshape(N, G, gs).permute(1, 2, 0)  # (G, gs, N)
    acc = torch.bmm(xg, wg)
    if z_x is None:
        return acc if exact is torch.float32 else acc.to(torch.float32)
    colsum = q_w.to(torch.float32).reshape(N, G, gs).sum(dim=2).to(torch.int32).t()  # (G, N), exact
    acc = acc.to(torch.int32) - z_x.to(torch.int32).reshape(()) * colsum.unsqueeze(1)
    return acc.to(torch.float32)


def grouped_reference(q_x: Tensor, q_w: Tensor, s_w: Tensor, z_x: Tensor | None, s_x: Tensor,
                      bias: Tensor | None) -> Tensor:
    """The definition, in aten ops (what torch.export records): y (M, N) fp32.

    p_g = float32(acc_g) * s_w[:, g]; t = p_0 + p_1 + ... + p_{G-1} left to right; y = t * s_x + b.
    """
    G = s_w.shape[1]
    p = group_sums(q_x, q_w, G, z_x) * s_w.t().unsqueeze(1)  # (G, M, N)
    t = p[0]
    for g in range(1, G):  # G - 1 adds in increasing g: the order is part of the result
        t = t + p[g]
    y = t * s_x.reshape(-1, 1)
    return y + bias.to(torch.float32) if bias is not None else y
