"""oneDNN's int8 convolution as a backend: the integer conv's accumulator without im2col (primitive `conv_int8`).

    conv_int8(q_x, z, q_w, stride, padding, dilation, groups) -> acc (B, O, Ho, Wo) fp32, channels_last
        the exact integer sums of (q_x - z) * q_w (intqat/ops/conv_onednn.py says why they are exact)
        shape: the conv as a GEMM (M = B Ho Wo, K = C kh kw, N = O); spec: (kh, kw, stride, padding, dilation, groups)

Only this backend implements it: where it does not take a call, `select` returns None and the op keeps its im2col
+ int_mm path (int_conv2d.conv_codes_forward, and the C++ conv step's plan). It runs oneDNN's int8 kernels, so it
refuses them where that convolution failed its self-check (self_check.GEMMS["oneDNN int8 conv"]: e.g.
ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU, whose kernel saturates int16 pair sums), and is slow without int8 dot
products. The shape rules are ratios against the im2col + torch._int_mm path on the same int8 units (forward with
the weight prepack oneDNN needs per call, 1 thread), measured on a 2-core 4th-gen AMX Xeon:

    3x3 stride 1, 64 -> 64 ch, batch 16 at 16x16: 0.70x;  32 -> 32 at 32x32: 0.43x;  16 -> 16 at 16x16: 0.84x
    3x3 stride 2, 64 -> 128 at 16x16: 2.1x;  1x1 32 -> 128: 1.7x;  3x3 128 -> 128 at 8x8: 2.1x (prepack 0.7 ms)
    3x3 256 -> 256 at 4x4: 6.5x (prepack 2.7 ms: a oneDNN primitive descriptor per call, weights change each step)
    grouped / depthwise: 3x3 depthwise 128 ch 0.78x, 7x7 depthwise 96 ch 1.7x of the exact fp32 conv of the codes
"""

from __future__ import annotations

from intqat.ops import conv_onednn
from intqat.ops.backends import self_check
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.cpu_features import cpu_has_int8_dot

__all__ = ["OnednnConv", "ONEDNN_CONV_MAX_CHANNELS", "ONEDNN_CONV_MIN_M"]

ONEDNN_CONV_MAX_CHANNELS = 64  # above: the per-call weight prepack costs more than im2col saves (0.7 ms at 128 ch)
ONEDNN_CONV_MIN_M = 4096  # B * Ho * Wo below: oneDNN's per-call setup (~0.05 ms) outweighs im2col (2.2x at M = 256)


class OnednnConv(Backend):
    name = "onednn_conv"
    needs = "torch built with oneDNN (torch.ops.onednn.qconv_pointwise) and int8 dot-product units"
    primitives = frozenset({"conv_int8"})

    def unavailable(self):
        return conv_onednn.unavailable_reason()

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        if traced:
            return "not while tracing (exported programs hold the portable im2col + aten._int_mm form)"
        reason = conv_onednn.unavailable_reason()
        if reason is not None:
            return reason
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        forced = self.table.state()[0]
        if forced not in (None, self.name):  # (a test forcing a GEMM backend must see the conv's GEMM on it)
            return f"backend {forced} is forced: the conv's GEMM runs on it (im2col + int_mm)"
        if spec is not None and spec[5] != 1:
            return "grouped / depthwise convs run one exact fp32 conv of the codes (oneDNN's int8 one measured 0.78x-1.7x of it)"
        return self_check.untrusted("oneDNN int8 conv")

    def slow(self, primitive, shape, spec=None):
        if not cpu_has_int8_dot():
            return "no int8 dot-product units: oneDNN's int8 conv would not be faster than fp32"
        if shape is None or spec is None:
            return None
        M, K, N = shape
        kh, kw, stride = spec[0], spec[1], spec[2]
        if kh * kw == 1:
            return "a 1x1 conv is a GEMM already: no im2col to save (torch._int_mm measured 0.6x oneDNN's conv)"
        if max(stride) > 1:
            return "stride > 1: im2col + torch._int_mm measured 0.5x oneDNN's conv (its copy is 1/4 the size)"
        C = K // (kh * kw)
        if max(C, N) > ONEDNN_CONV_MAX_CHANNELS:
            return f"more than {ONEDNN_CONV_MAX_CHANNELS} channels (ONEDNN_CONV_MAX_CHANNELS): the per-call weight prepack costs more than im2col"
        if M < ONEDNN_CONV_MIN_M:
            return f"B * Ho * Wo < {ONEDNN_CONV_MIN_M} (ONEDNN_CONV_MIN_M): oneDNN's per-call setup outweighs im2col"
        return None

    def conv_int8(self, q_x, z, q_w, stride, padding, dilation, groups):
        return conv_onednn.conv_acc(q_x, z, q_w, stride, padding, dilation, groups)
