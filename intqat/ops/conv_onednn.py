"""oneDNN's int8 convolution, where it gives the reference's bits: the integer conv's accumulator without im2col.

    acc[b, o, h, w] = sum_{c, i, j} (q_x[b, c, h s + i d - p, ...] - z_x) * q_w[o, c, i, j]     exact integers

torch ships oneDNN's int8 convolution as `torch.ops.onednn.qconv_pointwise` (what Inductor's x86 int8 path calls):
u8 activations with a zero point, s8 weights prepacked by `onednn.qconv_prepack`, int32 accumulation, and an
fp32 output `float32(acc) * (x_scale * w_scale[o]) + bias`. Asked with unit scales and no bias, the output is
float32(acc): the int32 accumulator converted once. intqat's epilogue (docs/numerics.md) then runs on it as on the
im2col GEMM's int32 result. Why that is exact:

- activations: our int8 codes q as u8 are q + 128 (the bits xor 0x80), with zero point z + 128, so
  u8 - zp = q - z: the same differences, and padding is the zero point (adds nothing), as im2col's;
- the accumulator: oneDNN sums u8 x s8 products in int32 on VNNI / AMX (no intermediate saturation; the
  pre-VNNI kernel's saturating int16 pairs are caught by the self-check, `self_check.GEMMS`);
- the conversion: every int32 oneDNN forms (the raw sum of u8 * w, the zero-point compensation zp * sum w, and
  their difference) is at most 255 * sum_{c,i,j} |q_w[o, c, i, j]| in magnitude. Where that is <= 2^24 for every
  output channel, each is an fp32 integer and every conversion or subtraction of them is exact, wherever oneDNN
  does it. Where it is not, the input channels are cut into chunks whose weights fit (`channel_chunks`: at most
  2^24 // 255 = 65793 of |q_w| per output channel; a 3x3 channel holds at most 9 * 128 = 1152), each chunk one
  conv, their exact results added in int32. Typical trained weights (|q_w| ~ 30 on average) fit in one conv up
  to K = C kh kw ~ 2000.

Which convs take it is the backend table's decision (`intqat/ops/backends/onednn_conv.py`, primitive `conv_int8`:
shape rules measured on the AMX Xeon); INTQAT_ONEDNN_CONV=0 switches it off (checked once, at first use).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = ["unavailable_reason", "conv_acc", "channel_chunks", "gemm_via_conv", "WEIGHT_ABS_LIMIT"]

# the largest sum_k |q_w[o, k]| per output channel for which 255 * it <= 2^24: every int32 oneDNN forms is an fp32 integer
WEIGHT_ABS_LIMIT = 2**24 // 255

_reason: str | None | bool = False  # False: not decided yet


def unavailable_reason() -> str | None:
    """Why oneDNN's int8 conv cannot be used in this process (None: it can)."""
    global _reason
    if _reason is False:
        if os.environ.get("INTQAT_ONEDNN_CONV", "1") == "0":
            _reason = "switched off (INTQAT_ONEDNN_CONV=0)"
        elif not torch.backends.mkldnn.is_available():
            _reason = "this torch is built without oneDNN (mkldnn)"
        elif not (hasattr(torch.ops.onednn, "qconv_pointwise") and hasattr(torch.ops.onednn, "qconv_prepack")):
            _reason = "this torch has no torch.ops.onednn.qconv_pointwise / qconv_prepack"
        else:
            _reason = None
    return _reason


def channel_chunks(q_w: Tensor) -> list[tuple[int, int]]:
    """Input-channel ranges [c0, c1) of q_w (O, C, kh, kw) int8 whose |q_w| sum per output channel fits
    WEIGHT_ABS_LIMIT: one range (the whole conv) for nearly every layer; greedy contiguous ranges otherwise."""
    per = q_w.to(torch.int32).abs().sum(dim=(2, 3))  # (O, C); int32 first: |-128| does not fit int8
    C = per.shape[1]
    if C == 0 or int(per.sum(dim=1).max()) <= WEIGHT_ABS_LIMIT:
        return [(0, C)]
    chunks, c0, run = [], 0, torch.zeros(per.shape[0], dtype=torch.int32)
    for c in range(C):  # (rare: a layer whose weights are mostly at the clip)
        if c > c0 and int((run + per[:, c]).max()) > WEIGHT_ABS_LIMIT:
            chunks.append((c0, c))
            c0, run = c, torch.zeros_like(run)
        run += per[:, c]
    chunks.append((c0, C))
    return chunks


def _one_conv(u8: Tensor, zp: int, q_w: Tensor, stride, padding, dilation, groups: int) -> Tensor:
    O = q_w.shape[0]
    ones = torch.ones(O, dtype=torch.float32)
    zeros = torch.zeros(O, dtype=torch.int64)
    # the unit weight scale as one number: the prepack reads a per-channel one back channel by channel (O tensor
    # ops); the reorder at scale 1 is the identity either way (train_conv.cpp onednn_one)
    packed = torch.ops.onednn.qconv_prepack(q_w, torch.ones(()), 1.0, zp, stride, padding, dilation, groups, list(u8.shape))
    return torch.ops.onednn.qconv_pointwise(u8, 1.0, zp, packed, ones, zeros, None, stride, padding, dilation, groups,
                                            1.0, 0, torch.float32, "none", [], "")


def conv_acc(q_x: Tensor, z: int, q_w: Tensor, stride, padding, dilation, groups: int = 1) -> Tensor:
    """acc (B, O, Ho, Wo) fp32, channels_last, holding the exact integer sums of (q_x - z) * q_w (module docstring).

    q_x (B, C, H, W) int8 (any memory format), z the activation zero point (int), q_w (O, C/groups, kh, kw) int8."""
    u8 = q_x.view(torch.uint8).bitwise_xor(128)  # q + 128, in q_x's memory format
    zp = int(z) + 128
    chunks = channel_chunks(q_w) if groups == 1 else [(0, q_w.shape[1])]
    if len(chunks) == 1:
        return _one_conv(u8, zp, q_w, stride, padding, dilation, groups)
    acc = None
    for c0, c1 in chunks:  # each chunk's sums exact in fp32, added in int32
        part = _one_conv(u8[:, c0:c1], zp, q_w[:, c0:c1].contiguous(), stride, padding, dilation, 1).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc.to(torch.float32)


def gemm_via_conv(a: Tensor, b: Tensor) -> Tensor:
    """a (M, K) int8 @ b (K, N) int8 -> int32 (M, N) through `conv_acc` as a 1x1 conv (z = 0): the self-check's
    runner (self_check.GEMMS), so the worst-case operands go through the very kernel, packing and chunking."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, dtype=torch.int32)
    x = a.t().reshape(1, K, 1, M)  # x[0, k, 0, m] = a[m, k]
    w = b.t().contiguous().reshape(N, K, 1, 1)
    out = conv_acc(x, 0, w, [1, 1], [0, 0], [1, 1])  # (1, N, 1, M)
    return out[0, :, 0, :].t().to(torch.int32)
