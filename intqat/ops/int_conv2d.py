"""Differentiable integer 2-D convolution: im2col of int8 codes + int_mm; STE backward on the int8 units (digits) or fp32.

Forward, x (B, C, H, W), W (O, C/g, kh, kw):
    q_x  = quantize(x, s_x, z_x)                           per tensor (static, or dynamic symmetric)
    cols = im2col(pad(q_x, value=z_x))                     (B*Ho*Wo, C*kh*kw) int8, channels innermost;
                                                           padding holds the code of 0.0: adds nothing
    acc  = int_mm(cols, q_wᵀ) - z_x * colsum(q_w)          groups == 1: int32, exact
    acc  = conv2d_fp32(q_x - z_x, q_w, groups)             groups > 1 (depthwise too): one grouped conv of
                                                           the codes in fp32, exact (see _grouped_acc)
    y    = float32(acc) * (s_x * s_w[o]) + b[o]
Backward (STE), then the clip masks, and LSQ gradients for learned scales, as in int_linear:
    fp32:   aten.convolution_backward on x_hat = dequantize(q_x) and w_hat = dequantize(q_w); a depthwise conv
            (groups == C == O): the table's `depthwise_grad` (on the CPU kernels/cpu/depthwise_backward.c, ~6x aten's
            at ConvNeXt's 7x7; the same sums in a fixed order of its own)
    digits (groups == 1, grad_gemm "int8x3", where `digits_pay` says so for the im2col GEMM (M, K', O),
    M = B*Ho*Wo, K' = C*kh*kw): int_linear's two backward GEMMs on the im2col form (`_digit_grads`),
        g_mat      = g as (M, O), rows NHWC pixels
        grad_w_mat = (g_mat * s_x)ᵀ @ (cols - z_x)       (O, K')  digit_matmul, contraction over M
        grad_cols  = (g_mat * s_w[o]) @ q_w_mat          (M, K')  digit_matmul, contraction over O
        grad_x     = fold(grad_cols)                     each input pixel: the sum of its <= kh*kw window
                                                         entries, in fp32, in (i, j) order (`_fold_nhwc`)
    grad_b = sum over (B, Ho, Wo) of g. Each GEMM decides on its own (grad_x and grad_w); the one that does
    not pay stays in convolution_backward. Grouped / depthwise convs keep convolution_backward.

`intqat::int_conv2d` is one torch.library custom op; eager calls go through `_IntConv2dEager`, the same forward and
backward without the dispatch: both built from the formulas below by `op_outline.IntegerOp` (CONV), the scalar
options as one ConvSpec. Which path a call takes is the backend table's decision (`conv_step`: the C++ op, backend
cpp_step, or this Python path, the reference's); the forward's integer GEMM is oneDNN's int8 conv where the table
runs `conv_int8` on onednn_conv, else im2col + int_mm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from typing import NamedTuple

from intqat.ops import backends, cpp_step
from intqat.ops.backends.reference import Reference
from intqat.ops.backends.formulas import conv_grad_x_digits_may_pay
from intqat.ops.digit_gemm import check_grad_gemm, digit_matmul, digits_pay
from intqat.ops.int_linear import integer_epilogue, quantize_weight, rounded_zero_point, rounded_zero_point_int
from intqat.ops.int_mm import int_mm
from intqat.ops.lsq import lsq_grad_factor, lsq_scale_grad_elem
from intqat.ops.op_outline import IntegerOp
from intqat.ops.qparams import SCALE_EPS, row_absmax
from intqat.ops.quant import check_qrange, dequantize, quantize, quantize_with_mask

__all__ = ["int_conv2d", "conv_call", "conv_codes_forward", "conv_output_size", "conv_geometry", "conv_backward_gemms"]


def conv_output_size(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


def _pad_codes_nhwc(q: Tensor, z: Tensor | int, ph: int, pw: int) -> Tensor:
    """Pad int8 codes (B, H, W, C) in H and W with the code of 0.0 (the zero point)."""
    if isinstance(z, int):
        return F.pad(q, (0, 0, pw, pw, ph, ph), value=z)
    # z as a tensor (traced programs cannot read its value): pad with 0, then write z on the border
    border = F.pad(torch.zeros_like(q[:1, :, :, :1], dtype=torch.bool), (0, 0, pw, pw, ph, ph), value=True)
    return torch.where(border, z.reshape(()).to(torch.int8), F.pad(q, (0, 0, pw, pw, ph, ph), value=0))


def _im2col(q: Tensor, z: Tensor | int, kernel, stride, padding, dilation, groups: int) -> tuple[Tensor, int, int]:
    """(B, C, H, W) int8 -> (B*Ho*Wo, C*kh*kw) int8; columns in (group, i, j, c) order (c fastest).

    Channels innermost: every copied run is a pixel's C/groups contiguous codes. The (c, i, j) order of
    the weight layout would make the copy gather single bytes, 5-20x slower here (conv 32->64 on
    64x16x16: 5.6 ms against 0.4 ms). The weight is reordered to match (`_weight_columns`); integer
    sums do not depend on the order.
    """
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    B, C, H, W = q.shape
    q = q.permute(0, 2, 3, 1)  # (B, H, W, C) view
    q = _pad_codes_nhwc(q, z, ph, pw) if (ph or pw) else q.contiguous()
    ext_h, ext_w = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    u = q.unfold(1, ext_h, sh).unfold(2, ext_w, sw)[..., ::dh, ::dw]  # (B, Ho, Wo, C, kh, kw) view
    Ho, Wo = u.shape[1], u.shape[2]
    u = u.reshape(B, Ho, Wo, groups, C // groups, kh, kw).permute(0, 1, 2, 3, 5, 6, 4)
    return u.reshape(B * Ho * Wo, C * kh * kw), Ho, Wo


def _weight_columns(q_w: Tensor) -> Tensor:
    """q_w (O, C/g, kh, kw) -> (O, kh*kw*C/g), columns in the (i, j, c) order of `_im2col`'s groups."""
    return q_w.permute(0, 2, 3, 1).reshape(q_w.shape[0], -1)


def conv_codes_forward(
    q_x: Tensor, z_x: Tensor, s_x: Tensor, q_w: Tensor, w_colsum: Tensor, w_scale: Tensor,
    bias: Tensor | None, stride, padding, dilation, groups: int, pad_value: int | None = None,
) -> Tensor:
    """Integer conv from codes: q_x (B, C, H, W) int8, q_w (O, C/g, kh, kw) int8 -> y (B, O, Ho, Wo) fp32.
    pad_value: z_x as a Python int when known (faster padding); None reads it from the tensor z_x."""
    if groups > 1:
        return _grouped_forward(q_x, z_x, s_x, q_w, w_scale, bias, stride, padding, dilation, groups)
    B = q_x.shape[0]
    O, C, kh, kw = q_w.shape
    Ho = conv_output_size(q_x.shape[2], kh, stride[0], padding[0], dilation[0])
    Wo = conv_output_size(q_x.shape[3], kw, stride[1], padding[1], dilation[1])
    # oneDNN's int8 conv where the table takes it (backend onednn_conv: regular convs of few channels): the same
    # exact accumulator without im2col, laid out channels_last, then the same epilogue steps
    b = backends.select("conv_int8", q_x, q_w, shape=(B * Ho * Wo, C * kh * kw, O),
                        spec=conv_geometry(kh, kw, stride, padding, dilation, groups))
    if b is not None:
        acc = b.conv_int8(q_x, int(z_x) if pad_value is None else pad_value, q_w, stride, padding, dilation, groups)
        y = _scaled_(acc, s_x, w_scale, bias)
        return y if is_channels_last(q_x) else y.contiguous()
    cols, Ho, Wo = _im2col(q_x, z_x if pad_value is None else pad_value, (kh, kw), stride, padding, dilation, groups)
    acc = int_mm(cols, _weight_columns(q_w).t())  # (B*Ho*Wo, O) int32
    y = integer_epilogue(acc, z_x, w_colsum, s_x, w_scale, bias)
    # The (B*Ho*Wo, O) rows are NHWC pixels. Like nn.Conv2d, the output takes the input's memory
    # format: for channels_last input that is these rows as they are (no copy, and the next integer
    # conv reads its codes in place); for NCHW input, a transposing copy (code that calls .view() on
    # a conv's output keeps working).
    y = y.reshape(B, Ho, Wo, O).permute(0, 3, 1, 2)
    return y if is_channels_last(q_x) else y.contiguous()


# fp32 holds every integer up to 2^24 exactly; a product (q_x - z_x) * q_w is at most 255 * 128 < 2^15 in
# magnitude, so any sum of <= 2^24 / 2^15 = 512 of them (any order, any blocking, FMA or not) is exact:
# docs/numerics.md's "Exact int8 products on fp32 units", with the zero point taken into the codes. It stays exact with oneDNN's reduced
# fp32 precision modes too (torch.backends.mkldnn.conv.fp32_precision "tf32" / "bf16", checked here): the
# operands are integers of <= 8 significant bits, which both formats hold, and the sums stay fp32.
_EXACT_FP32_TERMS = 512


def _grouped_acc(xz: Tensor, w: Tensor, stride, padding, dilation, groups: int) -> Tensor:
    """acc[b, o] = sum (q_x - z_x) * q_w over o's group, exact: fp32 codes xz (B, C, H, W), w (O, C/g, kh, kw).

    One grouped fp32 convolution (oneDNN's depthwise / grouped kernels) when a group's C/g * kh * kw terms
    fit _EXACT_FP32_TERMS; else the input channels of every group are cut into chunks that do (a few convs,
    each covering all groups), whose exact partial sums are added in int32. Zero padding is exact: the
    padded code is z_x, and xz = q_x - z_x is 0 there."""
    O, Cg, kh, kw = w.shape
    per = max(1, _EXACT_FP32_TERMS // (kh * kw))  # input channels per group per chunk
    if Cg <= per:
        return F.conv2d(xz, w, None, stride, padding, dilation, groups)
    acc = None
    base = torch.arange(groups, device=xz.device).reshape(-1, 1) * Cg
    for c0 in range(0, Cg, per):
        c1 = min(Cg, c0 + per)
        chans = (base + torch.arange(c0, c1, device=xz.device)).reshape(-1)  # chunk c0:c1 of every group
        part = F.conv2d(xz.index_select(1, chans), w[:, c0:c1], None, stride, padding, dilation, groups)
        part = part.to(torch.int32)
        acc = part if acc is None else acc + part
    fmt = torch.channels_last if is_channels_last(xz) else torch.contiguous_format  # as nn.Conv2d would return
    return acc.to(torch.float32).contiguous(memory_format=fmt)


def conv_geometry(kh: int, kw: int, stride, padding, dilation, groups: int) -> tuple:
    """The conv's geometry as the `conv_int8` primitive's spec (hashable): (kh, kw, stride, padding, dilation, groups)."""
    return kh, kw, tuple(stride), tuple(padding), tuple(dilation), groups


def _scaled_(acc: Tensor, s_x: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """y = acc * (s_x * s_w[o]) + b[o], in place on acc (B, O, Ho, Wo) fp32 holding exact integers: the epilogue's
    float steps in its order (integer_epilogue: float32(acc) * (s_x s_w[n]) + b[n]), so the same bits."""
    O = acc.shape[1]
    scale = (s_x.reshape(1, 1) * w_scale.reshape(1, -1)).reshape(1, O, 1, 1)
    y = acc.mul_(scale)
    return y.add_(bias.to(torch.float32).reshape(1, O, 1, 1)) if bias is not None else y


def _grouped_forward(q_x, z_x, s_x, q_w, w_scale, bias, stride, padding, dilation, groups) -> Tensor:
    """Grouped / depthwise integer conv as one computation: y = float32(acc) * (s_x * s_w[o]) + b[o], the
    epilogue of integer_epilogue in the same float steps (so the same bits as a per-group int_mm would give),
    laid out (B, O, Ho, Wo) in the input's memory format by the convolution itself: no transposing copy."""
    # (q_x - z_x) * 1.0 in one fused pass on the CPU: exact integers within [-255, 255]
    xz = dequantize(q_x, torch.ones((), dtype=torch.float32, device=q_x.device), z_x.reshape(()))
    acc = _grouped_acc(xz, q_w.to(torch.float32), stride, padding, dilation, groups)  # fresh: updated in place
    return _scaled_(acc, s_x, w_scale, bias)


def is_channels_last(t: Tensor) -> bool:
    """Does t (4-D) live in channels_last memory format (and not also in the contiguous one)?"""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _not_a_view(t: Tensor) -> Tensor:
    """t itself if it owns its memory, else a tensor over the same memory that is not a view (no copy).

    The GEMM rows (B*Ho*Wo, O) come back permuted to (B, O, Ho, Wo): a view when the output is
    channels_last, or 1x1 spatially (where .contiguous() has nothing to do). Autograd forbids in-place
    ops on a custom op's outputs that are views (MobileNet-V2's ReLU6(inplace=True) after a 1x1 conv
    output: "Output 0 of GeneratedBackwardFor_intqat_int_conv2d_default is a view and is being modified
    inplace"); the base is the op's own temporary, so nothing else can see the memory."""
    if t._base is None:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                t.shape, t.stride())


def _quantize_input(x, x_scale, x_zero_point, qmin, qmax, dynamic, need_mask):
    if dynamic:
        s = torch.clamp(row_absmax(x.detach(), dim=None) / qmax, min=SCALE_EPS).reshape(1, 1)
        z = torch.zeros(1, dtype=torch.int32, device=x.device)
        return quantize(x, s.reshape(()), 0, qmin, qmax), None, s, z
    s = x_scale.detach().reshape(1, 1).to(torch.float32, copy=True)
    z = rounded_zero_point(x_zero_point, qmin, qmax)
    if need_mask:
        q, m = quantize_with_mask(x, s.reshape(()), z.reshape(()), qmin, qmax)
        return q, m, s, z
    return quantize(x, s.reshape(()), z.reshape(()), qmin, qmax), None, s, z


class ConvSpec(NamedTuple):
    """int_conv2d's scalar options, as one value; the op schema's plain arguments, in this order (op_outline)."""

    stride: list[int]
    padding: list[int]
    dilation: list[int]
    groups: int
    x_qmin: int
    x_qmax: int
    w_qmin: int
    w_qmax: int
    x_dynamic: bool
    w_clip_mask: bool
    grad_gemm: str = "int8x3"  # read by the backward only


def _forward(x, weight, bias, x_scale, x_zero_point, w_scale, spec: ConvSpec):
    """-> (y fp32, q_x int8, mask_x, q_w int8, mask_w, s_x (1, 1), z_x int32 (1,)); empty masks when unused."""
    q_x, mask_x, s_x, z_x = _quantize_input(x, x_scale, x_zero_point, spec.x_qmin, spec.x_qmax, spec.x_dynamic,
                                            not spec.x_dynamic)
    w2 = weight.detach().reshape(weight.shape[0], -1)
    ws = w_scale.detach().reshape(-1)
    # codes, clip mask and colsum in one pass on the CPU
    q_w, mask_w, colsum, _ = quantize_weight(w2, ws, spec.w_qmin, spec.w_qmax, need_mask=spec.w_clip_mask,
                                             need_colsum=not spec.x_dynamic)
    q_w = q_w.reshape(weight.shape)
    if spec.x_dynamic:
        colsum = torch.zeros(1, dtype=torch.int32, device=x.device)
    y = conv_codes_forward(q_x, z_x, s_x, q_w, colsum, ws, None if bias is None else bias.detach(),
                           spec.stride, spec.padding, spec.dilation, spec.groups, pad_value=int(z_x))
    empty = lambda: torch.empty(0, dtype=torch.bool, device=x.device)  # noqa: E731 (outputs may not alias)
    return (_not_a_view(y), q_x, mask_x if mask_x is not None else empty(), q_w,
            mask_w.reshape(weight.shape) if mask_w is not None else empty(), s_x, z_x)


def _fake(x, weight, bias, x_scale, x_zero_point, w_scale, spec: ConvSpec):
    B, _, H, W = x.shape
    O, _, kh, kw = weight.shape
    stride, padding, dilation = spec.stride, spec.padding, spec.dilation
    Ho = conv_output_size(H, kh, stride[0], padding[0], dilation[0])
    Wo = conv_output_size(W, kw, stride[1], padding[1], dilation[1])
    return (
        torch.empty((B, O, Ho, Wo), dtype=torch.float32, device=x.device,
                    memory_format=torch.channels_last if is_channels_last(x) else torch.contiguous_format),
        torch.empty_like(x, dtype=torch.int8),  # codes and mask keep x's layout, as quantize does
        torch.empty_like(x, dtype=torch.bool) if not spec.x_dynamic else x.new_empty((0,), dtype=torch.bool),
        x.new_empty(weight.shape, dtype=torch.int8),
        x.new_empty(weight.shape if spec.w_clip_mask else (0,), dtype=torch.bool),
        x.new_empty((1, 1)),
        x.new_empty((1,), dtype=torch.int32),
    )


def _save(ctx, tensors, spec: ConvSpec, output):
    x, weight, bias, x_scale, x_zero_point, w_scale = tensors
    _, q_x, mask_x, q_w, mask_w, s_x, z_x = output
    x_lsq = not spec.x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad)
    w_lsq = w_scale.requires_grad
    ctx.save_for_backward(q_x, mask_x, q_w, mask_w, s_x, z_x, w_scale,
                          x if x_lsq else None, weight if w_lsq else None)
    ctx.conv = (spec.stride, spec.padding, spec.dilation, spec.groups)
    ctx.ranges = (spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax)
    ctx.x_lsq, ctx.has_bias = x_lsq, bias is not None
    ctx.grad_gemm = spec.grad_gemm
    ctx.shapes = (x_scale.shape, x_zero_point.shape, w_scale.shape)


def _digits_chosen(grad_gemm: str, groups: int, gemm_shape: tuple) -> tuple[bool, bool]:
    """(grad_x, grad_w as digit GEMMs?) for a conv whose im2col GEMM is gemm_shape = (B*Ho*Wo, C*kh*kw, O): the linear
    layers' rule (`digits_pay`, per GEMM) on that shape, grad_x only from CONV_DIGITS_X_MIN_OUT_CHANNELS output
    channels (formulas.conv_grad_x_digits_may_pay); never for grouped / depthwise convs or grad_gemm "fp32"."""
    if grad_gemm != "int8x3" or groups != 1:
        return False, False
    digits_x = conv_grad_x_digits_may_pay(gemm_shape) is None and digits_pay(*gemm_shape, grad="x")
    return digits_x, digits_pay(*gemm_shape, grad="w")


def conv_backward_gemms(x_shape, weight_shape, stride=1, padding=0, dilation=1, groups: int = 1,
                        grad_gemm: str = "int8x3") -> dict[str, str]:
    """How an integer conv's STE backward runs on this CPU, per gradient: {"grad_x": ..., "grad_w": ...}, each
    "digits" (the im2col GEMM on the int8 units) or "fp32 convolution_backward: <why>". x_shape (B, C, H, W),
    weight_shape (O, C/groups, kh, kw). The same decision the op takes (`_digits_chosen`)."""
    stride, padding, dilation = _pair(stride, "stride", 1), _pair(padding, "padding", 0), _pair(dilation, "dilation", 1)
    B, C, H, W = x_shape
    O, _, kh, kw = weight_shape
    Ho = conv_output_size(H, kh, stride[0], padding[0], dilation[0])
    Wo = conv_output_size(W, kw, stride[1], padding[1], dilation[1])
    shape = (B * Ho * Wo, C * kh * kw, O)
    out = {}
    for grad, chosen in zip("xw", _digits_chosen(check_grad_gemm(grad_gemm), groups, shape)):
        if chosen:
            out[f"grad_{grad}"] = "digits"
            continue
        if grad_gemm != "int8x3":
            why = f"grad_gemm={grad_gemm!r}"
        elif groups != 1:
            why = f"a grouped conv (groups={groups}): only groups == 1 has the im2col digit form"
        elif grad == "x" and conv_grad_x_digits_may_pay(shape) is not None:
            why = conv_grad_x_digits_may_pay(shape)
        else:
            b = backends.select("digit_matmul", record=False, at_run_time=True)
            why = ("no backend runs the digit GEMM here" if b is None else
                   f"{b.name}: {b.slow('digit_matmul', shape, grad)}")
        out[f"grad_{grad}"] = f"fp32 convolution_backward: {why} (im2col GEMM (M, K, N) = {shape})"
    return out


def _fold_nhwc(cols: Tensor, B: int, Ho: int, Wo: int, C: int, H: int, W: int, kernel, stride, padding,
               dilation) -> Tensor:
    """col2im of grad_cols (B*Ho*Wo, kh*kw*C), columns in `_im2col`'s (i, j, c) order -> (B, C, H, W) fp32, a view
    with channels_last strides. Each input pixel gets the sum of its <= kh*kw window entries, added in fp32 onto 0 in
    (i, j) order. Eager CPU calls with the C++ ops built run their loop (`intqat_train::fold_padded`, train_conv.cpp:
    one pass per image); elsewhere one strided add per kernel offset, the same additions in the same order, so the
    same bits. A 1x1 kernel at stride 1 without padding has nothing to sum: the GEMM's rows as they are."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    if (kh, kw, sh, sw, ph, pw) == (1, 1, 1, 1, 0, 0):
        return cols.view(B, Ho, Wo, C).permute(0, 3, 1, 2)
    if backends.eager_cpu((cols,)) and cpp_step.available():
        out = torch.ops.intqat_train.fold_padded(cols, B, Ho, Wo, C, H, W, kh, kw, list(stride), list(padding),
                                                 list(dilation))
    else:
        u = cols.view(B, Ho, Wo, kh, kw, C)
        out = cols.new_zeros(B, H + 2 * ph, W + 2 * pw, C)
        for i in range(kh):
            for j in range(kw):
                out[:, i * dh: i * dh + sh * (Ho - 1) + 1: sh, j * dw: j * dw + sw * (Wo - 1) + 1: sw].add_(
                    u[:, :, :, i, j])
    return out[:, ph: ph + H, pw: pw + W].permute(0, 3, 1, 2)


def _digit_grads(g, q_x, z_x, s_x, q_w, s_w, stride, padding, dilation, digits_x: bool, digits_w: bool):
    """The STE GEMMs of a groups == 1 conv on the im2col form, as digit GEMMs (int_linear's two):
    g (B, O, Ho, Wo) fp32, q_x (B, C, H, W), q_w (O, C, kh, kw) int8, s_x (1, 1), s_w (O,) ->
    (grad_xhat (B, C, H, W) or None, grad_what (O, C, kh, kw) or None), unmasked."""
    B, O, Ho, Wo = g.shape
    _, C, kh, kw = q_w.shape
    g_mat = g.permute(0, 2, 3, 1).reshape(B * Ho * Wo, O)  # (M, O), rows NHWC pixels (a view if g is channels_last)
    grad_xhat = grad_what = None
    if digits_w:
        # grad_w_mat (O, K') = (g_mat * s_x)ᵀ @ (cols - z_x), contraction over the M pixels; cols in (i, j, c) order
        cols, _, _ = _im2col(q_x, z_x if backends.tracing(z_x) else int(z_x), (kh, kw), stride, padding, dilation, 1)
        grad_what = digit_matmul(g_mat.t(), s_x.reshape(-1), cols.contiguous(), z_x)
        grad_what = grad_what.view(O, kh, kw, C).permute(0, 3, 1, 2).contiguous()
    if digits_x:
        # grad_cols (M, K') = (g_mat * s_w[o]) @ q_w_mat, contraction over O; then col2im
        grad_cols = digit_matmul(g_mat, s_w, _weight_columns(q_w).contiguous(), 0)
        grad_xhat = _fold_nhwc(grad_cols, B, Ho, Wo, C, q_x.shape[2], q_x.shape[3], (kh, kw), stride, padding,
                               dilation)
    return grad_xhat, grad_what


def pointwise_nchw(g: Tensor, q_x: Tensor, q_w: Tensor, padding, groups: int) -> bool:
    """A 1x1 conv without padding or groups, g and the codes NCHW-contiguous: its fp32 backward is two batched GEMMs
    (`_pointwise_grads`), ~0.55-0.7x of aten's convolution_backward at MBConv's shapes (oneDNN's 1x1 backward; 1 thread,
    AMX Xeon). The C++ conv step takes the same branch with the same calls."""
    return (q_w.shape[2] == 1 and q_w.shape[3] == 1 and groups == 1 and tuple(padding) == (0, 0)
            and g.is_contiguous() and q_x.is_contiguous())


def _pointwise_grads(g, x_hat, w_hat, stride, x_shape, need_x, need_w, need_b):
    """The fp32 STE gradients of a pointwise conv (`pointwise_nchw`), each None where not asked: g (B, O, Ho, Wo),
    x_hat (B, C, H, W) (None unless need_w), w_hat (O, C, 1, 1); with stride s the conv reads x[:, :, ::s, ::s]:
        grad_x[:, :, ::s, ::s] = w_hatᵀ (C, O) @ g[b] (O, Ho*Wo)   per image (0 elsewhere)
        grad_w = sum over images of g[b] (O, Ho*Wo) @ x_sub[b]ᵀ (Ho*Wo, C);   grad_b = g summed over (B, Ho, Wo)"""
    B, O, Ho, Wo = g.shape
    C = w_hat.shape[1]
    g3 = g.reshape(B, O, Ho * Wo)
    gx = gw = gb = None
    if need_x:
        gx = torch.matmul(w_hat.reshape(O, C).t(), g3).view(B, C, Ho, Wo)
        if tuple(stride) != (1, 1):
            full = g.new_zeros(x_shape)
            full[:, :, ::stride[0], ::stride[1]] = gx
            gx = full
    if need_w:
        x_sub = x_hat if tuple(stride) == (1, 1) else x_hat[:, :, ::stride[0], ::stride[1]]
        gw = torch.bmm(g3, x_sub.reshape(B, C, Ho * Wo).transpose(1, 2)).sum(0).view(O, C, 1, 1)
    if need_b:
        gb = g.sum(dim=(0, 2, 3))
    return gx, gw, gb


def _backward(ctx, g, *_unused):
    """-> the gradients of (x, weight, bias, x_scale, x_zero_point, w_scale)."""
    if g is None:  # eager path with unmaterialised grads: y did not reach the loss
        return (None,) * 6
    q_x, mask_x, q_w, mask_w, s_x, z_x, w_scale, x, weight = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    x_qmin, x_qmax, w_qmin, w_qmax = ctx.ranges
    sx_shape, zx_shape, sw_shape = ctx.shapes
    need_x, need_w, need_b, need_sx, need_zx, need_sw = ctx.needs_input_grad[:6]
    g = g.to(torch.float32)  # any layout: convolution_backward takes channels_last as it comes
    ws = w_scale.detach().reshape(-1, 1, 1, 1).to(torch.float32)
    O, C, kh, kw = q_w.shape
    M = g.shape[0] * g.shape[2] * g.shape[3]
    digits_x, digits_w = _digits_chosen(ctx.grad_gemm, groups, (M, C * kh * kw, O))
    want_x, want_w = need_x or need_sx or need_zx, need_w or need_sw
    want_b = need_b and ctx.has_bias
    grad_xhat = grad_what = grad_b = None
    if (want_x and digits_x) or (want_w and digits_w):
        grad_xhat, grad_what = _digit_grads(g, q_x, z_x, s_x, q_w, ws.reshape(-1), stride, padding, dilation,
                                            want_x and digits_x, want_w and digits_w)
        if want_b:  # (convolution_backward below, if it runs, is not asked for it: one definition per path)
            grad_b = g.sum(dim=(0, 2, 3))
            want_b = False
    fp32_x, fp32_w = want_x and grad_xhat is None, want_w and grad_what is None
    if (fp32_x or fp32_w or want_b) and C == 1 and O == groups:  # depthwise: the table's depthwise_grad
        gx, gw, gb = backends.select("depthwise_grad", g, q_x, q_w).depthwise_grad(
            g, q_x, z_x, s_x, q_w, ws.reshape(-1), stride, padding, dilation, fp32_x, fp32_w, want_b)
        grad_xhat = gx if fp32_x else grad_xhat
        grad_what = gw if fp32_w else grad_what
        grad_b = gb if want_b else grad_b
    elif (fp32_x or fp32_w or want_b) and pointwise_nchw(g, q_x, q_w, padding, groups):
        x_hat = dequantize(q_x, s_x.reshape(()), z_x.reshape(())) if fp32_w else None
        w_hat = dequantize(q_w, ws.reshape(-1), 0, axis=0)
        gx, gw, gb = _pointwise_grads(g, x_hat, w_hat, stride, q_x.shape, fp32_x, fp32_w, want_b)
        grad_xhat = gx if fp32_x else grad_xhat
        grad_what = gw if fp32_w else grad_what
        grad_b = gb if want_b else grad_b
    elif fp32_x or fp32_w or want_b:
        x_hat = dequantize(q_x, s_x.reshape(()), z_x.reshape(()))  # one fused pass each on the CPU
        w_hat = dequantize(q_w, ws.reshape(-1), 0, axis=0)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            g, x_hat, w_hat, [O] if ctx.has_bias else None, stride, padding, dilation,
            False, [0, 0], groups, [fp32_x, fp32_w, want_b],
        )
        grad_xhat = gx if fp32_x else grad_xhat
        grad_what = gw if fp32_w else grad_what
        grad_b = gb if want_b else grad_b
    grad_x = grad_w = grad_sx = grad_zx = grad_sw = None
    if need_x:
        grad_x = torch.where(mask_x, grad_xhat, 0.0) if mask_x.numel() else grad_xhat
    if ctx.x_lsq and (need_sx or need_zx):
        m = mask_x if mask_x.numel() else torch.ones_like(q_x, dtype=torch.bool)
        gf = lsq_grad_factor(q_x.numel(), x_qmax)
        s = s_x.reshape(())
        if need_sx:
            ds = lsq_scale_grad_elem(q_x, m, x.detach().to(torch.float32), s, z_x.reshape(()), x_qmin, x_qmax)
            grad_sx = ((grad_xhat * ds).sum() * gf).reshape(sx_shape)
        if need_zx:
            grad_zx = (-(grad_xhat * ~m).sum() * s * gf).reshape(zx_shape)
    if need_w:
        grad_w = torch.where(mask_w, grad_what, 0.0) if mask_w.numel() else grad_what
    if need_sw:
        m = mask_w if mask_w.numel() else torch.ones_like(q_w, dtype=torch.bool)
        ds = lsq_scale_grad_elem(q_w, m, weight.detach().to(torch.float32), ws, torch.zeros((), dtype=torch.int32), w_qmin, w_qmax)
        gf = lsq_grad_factor(q_w[0].numel(), w_qmax)
        grad_sw = ((grad_what * ds).sum(dim=(1, 2, 3)) * gf).reshape(sw_shape)
    return grad_x, grad_w, grad_b if ctx.has_bias else None, grad_sx, grad_zx, grad_sw


# the custom op (torch.ops.intqat.int_conv2d: what torch.compile / torch.export / opcheck see) and the eager
# autograd.Function (`_IntConv2dEager`: ~0.1-0.2 ms per conv and step less than torch.library's Python dispatch)
CONV = IntegerOp("intqat::int_conv2d", tensors=("x", "weight", "bias?", "x_scale", "x_zero_point", "w_scale"),
                 spec=ConvSpec, outputs=7, forward=_forward, fake=_fake, save=_save, backward=_backward,
                 eager_name="_IntConv2dEager")
_int_conv2d_op = CONV.op


def _pair(v, name: str, least: int) -> list[int]:
    """stride / padding / dilation as [h, w]: an int or a pair of ints >= least, else a ValueError naming it."""
    pair = [v, v] if isinstance(v, int) else list(v) if isinstance(v, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(a, int) and not isinstance(a, bool) and a >= least
                                                 for a in pair):
        hint = " (string padding such as 'same' is resolved by IntConv2d, not by the op)" if isinstance(v, str) else ""
        raise ValueError(f"int_conv2d: {name} must be an int or a pair of ints >= {least}, got {v!r}{hint}")
    return pair


def _check_inputs(x, weight, bias, x_scale, x_zero_point, w_scale, groups, x_dynamic) -> None:
    def bad(msg):
        raise ValueError(f"int_conv2d: {msg}")

    if not isinstance(x, Tensor) or x.dim() != 4 or not x.is_floating_point():
        bad(f"x must be a float (B, C, H, W) tensor, got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(groups, int) or groups < 1:
        bad(f"groups must be a positive int, got {groups!r}")
    if not isinstance(weight, Tensor) or weight.dim() != 4 or x.shape[1] != weight.shape[1] * groups or weight.shape[0] % groups:
        bad(f"weight {tuple(getattr(weight, 'shape', ()))} (O, C/groups, kh, kw) does not fit x {tuple(x.shape)} "
            f"with groups={groups}")
    O = weight.shape[0]
    if not isinstance(w_scale, Tensor) or w_scale.numel() != O:
        got = tuple(w_scale.shape) if isinstance(w_scale, Tensor) else repr(w_scale)
        bad(f"w_scale must be a tensor of one scale per output channel, shape ({O},), got {got}")
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (O,)):
        bad(f"bias must have shape ({O},) for weight {tuple(weight.shape)}, got "
            f"{tuple(bias.shape) if isinstance(bias, Tensor) else repr(bias)}")
    if not x_dynamic:
        for name, t in (("x_scale", x_scale), ("x_zero_point", x_zero_point)):
            if not isinstance(t, Tensor) or t.numel() != 1:
                bad(f"static activations need {name} as a tensor of shape (1,), got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else repr(t)}")


def _check_window(x, weight, stride, padding, dilation) -> None:
    """The (dilated) kernel must fit the padded input: else the output would be empty or unfold's error."""
    for d, name in ((0, "height"), (1, "width")):
        extent = dilation[d] * (weight.shape[2 + d] - 1) + 1
        if x.shape[2 + d] + 2 * padding[d] < extent:
            raise ValueError(
                f"int_conv2d: the kernel's {name} {weight.shape[2 + d]} (dilation {dilation[d]}: {extent}) exceeds the "
                f"padded input's {x.shape[2 + d]} + 2 * {padding[d]} (x {tuple(x.shape)}, weight {tuple(weight.shape)})")


def int_conv2d(
    x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor | None, x_zero_point: Tensor | None,
    w_scale: Tensor, *, stride=1, padding=0, dilation=1, groups: int = 1,
    x_qmin: int = -128, x_qmax: int = 127, w_qmin: int = -127, w_qmax: int = 127,
    x_dynamic: bool = False, w_clip_mask: bool | None = None, grad_gemm: str = "int8x3",
) -> Tensor:
    """Integer conv2d, differentiable (STE + LSQ). x (B, C, H, W) float; weight (O, C/groups, kh, kw);
    w_scale (O,); static activations: x_scale (1,), x_zero_point (1,); scales positive (not read to check, as
    int_linear). Padding must be numeric (string padding is resolved by IntConv2d).

    `grad_gemm`: "int8x3" (default): a groups == 1 conv's two backward GEMMs run as digit GEMMs on the im2col form
    where the linear layers' rule (`digits_pay`) says they pay for its im2col GEMM (`conv_backward_gemms` says so per
    layer); "fp32": fp32 convolution_backward only."""
    b, args = conv_call(x, weight, bias, x_scale, x_zero_point, w_scale, stride=stride, padding=padding,
                        dilation=dilation, groups=groups, x_qmin=x_qmin, x_qmax=x_qmax, w_qmin=w_qmin, w_qmax=w_qmax,
                        x_dynamic=x_dynamic, w_clip_mask=w_clip_mask, grad_gemm=grad_gemm)
    return b.conv_step(*args)


def conv_call(x, weight, bias, x_scale, x_zero_point, w_scale, *, stride, padding, dilation, groups, x_qmin, x_qmax,
              w_qmin, w_qmax, x_dynamic, w_clip_mask, grad_gemm, record: bool = True):
    """int_conv2d's checks and the table's choice: (backend, the arguments of its `conv_step`). record=False: a
    question (intqat.nn.conv_step caches the answer per layer), not a call."""
    _check_inputs(x, weight, bias, x_scale, x_zero_point, w_scale, groups, x_dynamic)
    stride, padding, dilation = _pair(stride, "stride", 1), _pair(padding, "padding", 0), _pair(dilation, "dilation", 1)
    _check_window(x, weight, stride, padding, dilation)
    check_qrange(x_qmin, x_qmax)
    check_qrange(w_qmin, w_qmax)
    check_grad_gemm(grad_gemm)
    if x_dynamic:
        x_scale = x_zero_point = x.new_zeros(1, dtype=torch.float32)
    x_zero_point = x_zero_point if x_zero_point.is_floating_point() else x_zero_point.to(torch.float32)
    if w_clip_mask is None:
        w_clip_mask = True  # a min-max scale never clips: callers holding one may pass False
    tensors = (x, weight, bias, x_scale, x_zero_point, w_scale)
    learned = not x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad) or w_scale.requires_grad
    s_x = z = None
    O, Cg, kh, kw = weight.shape
    empty, K, gemm_shape, geometry = False, 0, None, None
    eager = backends.eager_cpu(tensors)
    if eager:  # the facts the C++ step needs (not read while tracing: no guards on them)
        empty, K = not (x.numel() and O), x.shape[1] * kh * kw
        Ho = conv_output_size(x.shape[2], kh, stride[0], padding[0], dilation[0])
        Wo = conv_output_size(x.shape[3], kw, stride[1], padding[1], dilation[1])
        gemm_shape, geometry = (x.shape[0] * Ho * Wo, K, O), conv_geometry(kh, kw, stride, padding, dilation, groups)
        if not (x_dynamic or learned):  # what it takes as numbers
            s_x, z = float(x_scale), rounded_zero_point_int(x_zero_point, x_qmin, x_qmax)
    spec = ConvStep(x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic, w_clip_mask, groups, learned,
                    x_dynamic or x_scale.dtype == torch.float32, s_x is None or (s_x == s_x and z is not None),
                    empty, Cg * kh * kw <= _EXACT_FP32_TERMS, K, gemm_shape, geometry, grad_gemm,
                    groups > 1 and Cg == 1 and O == groups)
    b = backends.select("conv_step", *tensors, spec=spec, eager=eager, record=record)
    return b, (x.to(torch.float32), weight, bias, x_scale, x_zero_point, w_scale, stride, padding, dilation, spec, s_x,
               z)


class ConvStep(NamedTuple):
    """One int_conv2d call's scalar options and the facts the table decides the step from (as int_linear's
    LinearStep): empty: no input elements or no output channels; fits_one_fp32_conv: a group's C/g * kh * kw
    terms fit _EXACT_FP32_TERMS; K: C * kh * kw; gemm_shape: the conv as a GEMM (B Ho Wo, K, O) and geometry
    (`conv_geometry`): what the table decides `conv_int8` (oneDNN's int8 conv) from, and the backward's digit GEMMs
    (`digits_pay` on gemm_shape). The facts are read on eager CPU calls only (None / 0 otherwise)."""

    x_qmin: int
    x_qmax: int
    w_qmin: int
    w_qmax: int
    x_dynamic: bool
    w_clip_mask: bool
    groups: int
    learned: bool
    x_scale_float32: bool
    finite: bool
    empty: bool
    fits_one_fp32_conv: bool
    K: int
    gemm_shape: tuple | None = None
    geometry: tuple | None = None
    grad_gemm: str = "int8x3"
    depthwise: bool = False  # groups == C == O: the backward is the table's depthwise_grad


def _python_step(x, weight, bias, x_scale, x_zero_point, w_scale, stride, padding, dilation, spec: ConvStep, s_x,
                 z_x) -> Tensor:
    """The reference backend's `conv_step`: the op's Python path (the custom op while a tracer watches)."""
    op = ConvSpec(stride, padding, dilation, spec.groups, spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax,
                  spec.x_dynamic, spec.w_clip_mask, spec.grad_gemm)
    return CONV(x, weight, bias, x_scale, x_zero_point, w_scale, spec=op)[0]


Reference.define("conv_step", _python_step)
