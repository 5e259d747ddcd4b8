"""The differentiable integer linear layer: int8 forward (the deployed arithmetic), fp32 STE backward.

Forward, x (M, K) and W (N, K) in the nn.Linear layout (docs/numerics.md):
    q_x = quantize(x, s_x, z_x)                  # static per-tensor, or dynamic per-token (z_x = 0)
    q_w = quantize(W, s_w[n], 0)                 # symmetric, per output channel
    acc = int_mm(q_x, q_wᵀ) - z_x * colsum(q_w)  # (M, N) int32, exact
    y   = float32(acc) * (s_x[m] * s_w[n]) + b[n]
Backward (straight-through, fp32) needs only the int8 codes, the clip masks and the scales:
    grad_xhat = (g * s_w) @ float(q_w)           # (M, N) @ (N, K)
    grad_x    = grad_xhat * mask_x
    grad_what = gᵀ @ x_hat,  x_hat = (float(q_x) - z_x) * s_x
    grad_w    = grad_what * mask_w
By default (grad_gemm="int8x3") the backward GEMMs of a large layer run on the int8 units, g split
into three int8 digits (intqat.ops.digit_gemm): grad_x where int8 dot products pay, grad_w too on
AMX; grad_gemm="fp32" keeps both GEMMs in fp32.
plus LSQ gradients for learnable scales and the LSQ+ gradient for the activation zero point.

`intqat::int_linear` is one torch.library custom op with autograd, so torch.compile and torch.export see a
single opaque node; eager calls skip torch.library's dispatch through an autograd.Function over the same
forward / backward functions. Both come from the formulas below through `op_outline.IntegerOp` (LINEAR), the
scalar options as one LinearSpec. Which path a call takes is the backend table's decision (`linear_step`: the
C++ op, backend cpp_step, or this Python path, the reference's). The functions `quantize_activation`, `quantize_weight`
and `integer_epilogue` are what both the op and the deployed (eval / exported) module run, so
training and deployment compute the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from typing import NamedTuple

from intqat.ops import backends
from intqat.ops.backends import MAX_K_INT32
from intqat.ops.backends.reference import Reference
from intqat.ops.digit_gemm import check_grad_gemm, digit_matmul, digits_pay
from intqat.ops.masks import pack_mask, unpack_mask
from intqat.ops.lsq import activation_lsq_grads, lsq_grad_factor, weight_scale_grad
from intqat.ops.op_outline import IntegerOp
from intqat.ops.qparams import SCALE_EPS, row_absmax
from intqat.ops.quant import check_qrange
from intqat.ops.backends.formulas import weight_colsum  # noqa: F401 (re-exported)

__all__ = [
    "int_linear",
    "quantize_activation",
    "quantize_weight",
    "integer_epilogue",
    "integer_linear",
    "weight_colsum",
    "minmax_weight_scale",
    "rounded_zero_point",
    "rounded_zero_point_int",
    "lsq_grad_factor",
]


def _no_mask(like: Tensor) -> Tensor:
    # A fresh empty tensor each time: custom op outputs may not alias each other.
    return torch.empty(0, dtype=torch.bool, device=like.device)


# ---------------------------------------------------------------------------------------------
# Pieces shared by the training op and the deployed module (same ops -> same bits)
# ---------------------------------------------------------------------------------------------


_EXACT_IN_FP32 = (torch.float32, torch.int32, torch.int16, torch.int8, torch.uint8)


def rounded_zero_point(zero_point: Tensor, qmin: int, qmax: int) -> Tensor:
    """A learnable (float) zero point as the integer the hardware uses: round, clamp -> int32 (1,)."""
    if zero_point.numel() == 1 and zero_point.dtype in _EXACT_IN_FP32 and backends.eager_cpu((zero_point,)):
        z = rounded_zero_point_int(zero_point, qmin, qmax)
        if z is not None:
            return torch.tensor([z], dtype=torch.int32)
    return torch.round(zero_point.detach().reshape(1).to(torch.float32)).clamp_(qmin, qmax).to(torch.int32)


def rounded_zero_point_int(zero_point: Tensor, qmin: int, qmax: int) -> int | None:
    """`rounded_zero_point` as a Python int, for an eager one-element CPU tensor; None for NaN (and for a
    dtype float() would not hold exactly), where the tensor ops say what torch says.

    float() of an fp32 / small-integer value is exact; clamping to integer bounds commutes with
    rounding; round() is half-to-even, as torch.round."""
    if zero_point.dtype not in _EXACT_IN_FP32:
        return None
    z = float(zero_point)
    return round(min(max(z, qmin), qmax)) if z == z else None


def quantize_activation(
    x: Tensor, x_scale: Tensor | None, z_x: Tensor, qmin: int, qmax: int, dynamic: bool, need_mask: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """x (M, K) fp32 -> (q_x int8 (M, K), clip mask or None, s_x fp32 (M, 1) or (1, 1)).

    dynamic: symmetric per-token scales from each row's absolute max, z_x = 0; nothing clips.
    """
    if dynamic:
        q_x, s_x, _ = backends.select("quantize_rows_dynamic", x).quantize_rows_dynamic(x, qmin, qmax, SCALE_EPS)
        return q_x, None, s_x
    s_x = x_scale.detach().reshape(1, 1).to(torch.float32, copy=True)
    b = backends.select("quantize_rows", x, s_x, z_x)
    z = z_x.reshape(()) if b.traceable else float(z_x.reshape(()))  # traced: z stays data, not a constant
    q_x, mask, _ = b.quantize_rows(x, s_x, z, qmin, qmax, per_row=False, need_mask=need_mask)
    return q_x, mask, s_x


def minmax_weight_scale(weight: Tensor, qmax: int) -> Tensor:
    """Symmetric min-max scale per output channel, (N,) fp32: max(max|W[n]| / qmax, eps).

    The scale `WeightQuantizer` computes for non-learned per-channel weights; such a scale never clips."""
    return torch.clamp(row_absmax(weight.detach().reshape(weight.shape[0], -1), dim=1) / qmax, min=SCALE_EPS)


def quantize_weight(
    weight: Tensor, w_scale: Tensor | None, qmin: int, qmax: int, need_mask: bool = False, need_colsum: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """W (N, K) fp32 -> (q_w int8 (N, K), clip mask bool (N, K) or None, colsum int32 (N,) or None, s_w (N,)).

    Symmetric per output channel. w_scale None: the min-max scale (`minmax_weight_scale`), computed
    here. On the CPU, scale, codes, mask and colsum come from one fused pass over W.
    """
    w = weight.detach()
    if w_scale is None:
        b = backends.select("quantize_rows_dynamic", w)
        q_w, s, colsum = b.quantize_rows_dynamic(w, qmin, qmax, SCALE_EPS, need_rowsum=need_colsum)
        return q_w, torch.ones_like(q_w, dtype=torch.bool) if need_mask else None, colsum, s.reshape(-1)
    s = w_scale.detach().reshape(-1)
    b = backends.select("quantize_rows", w, s)
    q_w, mask, colsum = b.quantize_rows(w, s, 0.0, qmin, qmax, per_row=True, need_mask=need_mask,
                                        need_rowsum=need_colsum)
    return q_w, mask, colsum, s


def integer_epilogue(
    acc: Tensor, z_x: Tensor | None, w_colsum: Tensor | None, s_x: Tensor, w_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """acc (M, N) int32 from int_mm(q_x, q_wᵀ) -> y (M, N) fp32, one rounding per step.

    acc -= z_x * colsum(q_w)            (int32, exact; skipped for symmetric activations: z_x None)
    y    = float32(acc) * (s_x[m] * s_w[n]) + b[n]
    """
    return backends.select("epilogue", acc, s_x, w_scale, bias).epilogue(acc, z_x, w_colsum, s_x, w_scale, bias)


def integer_linear(q_x: Tensor, q_w: Tensor, z_x: Tensor | None, w_colsum: Tensor | None, s_x: Tensor,
                   w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """y = integer_epilogue(int_mm(q_x, q_wᵀ), ...): q_x (M, K), q_w (N, K) int8 -> (M, N) fp32.

    z_x int32 (1,) or None (symmetric activations), w_colsum (N,) int32 (needed with z_x), s_x (M, 1)
    or (1, 1), w_scale (N,). The backend table picks the implementation (AMX tiles, torch._int_mm +
    the fused epilogue, exact fp32 GEMMs where the CPU has no int8 dot products, Triton on GPUs):
    the same bits everywhere (Triton: acc exact, y within 1 ulp).
    """
    shape = (q_x.shape[0], q_x.shape[1], q_w.shape[0])
    b = backends.select("linear", q_x, q_w, s_x, w_scale, bias, w_colsum, shape=shape)
    return b.linear(q_x, q_w, z_x, w_colsum, s_x, w_scale, bias)


# ---------------------------------------------------------------------------------------------
# The custom op
# ---------------------------------------------------------------------------------------------


class LinearSpec(NamedTuple):
    """int_linear's scalar options, as one value; the op schema's plain arguments, in this order (op_outline)."""

    x_qmin: int
    x_qmax: int
    w_qmin: int
    w_qmax: int
    x_dynamic: bool
    x_clip_mask: bool  # keep the activation clip mask for backward (static activations)
    w_clip_mask: bool
    grad_gemm: str = "int8x3"  # read by the backward only


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor, x_zero_point: Tensor,
             w_scale: Tensor | None, spec: LinearSpec) -> tuple[Tensor, ...]:
    """-> (y (M, N) fp32, q_x (M, K) int8, mask_x, q_w (N, K) int8, mask_w, s_x, z_x int32 (1,), s_w (N,)).

    Masks are (M, K) / (N, K) bool when requested, else empty: the backward reads only what it needs.
    s_w is w_scale, or the min-max scale computed here when w_scale is None.
    """
    x_dynamic = spec.x_dynamic
    z_x = torch.zeros(1, dtype=torch.int32) if x_dynamic else rounded_zero_point(x_zero_point, spec.x_qmin, spec.x_qmax)
    q_x, mask_x, s_x = quantize_activation(x, x_scale, z_x, spec.x_qmin, spec.x_qmax, x_dynamic, spec.x_clip_mask)
    w_clip_mask = spec.w_clip_mask and w_scale is not None  # a min-max scale never clips
    # dynamic activations are symmetric: no zero-point correction, no colsum
    q_w, mask_w, w_colsum, s_w = quantize_weight(weight, w_scale, spec.w_qmin, spec.w_qmax, need_mask=w_clip_mask,
                                                 need_colsum=not x_dynamic)
    s_w = s_w.to(torch.float32, copy=w_scale is not None)  # an output may not alias an input
    y = integer_linear(q_x, q_w, None if x_dynamic else z_x, w_colsum, s_x, s_w,
                       None if bias is None else bias.detach())
    empty = _no_mask(x)
    return (y, q_x, empty if mask_x is None else mask_x, q_w, mask_w if w_clip_mask else _no_mask(x), s_x, z_x, s_w)


def _fake(x, weight, bias, x_scale, x_zero_point, w_scale, spec: LinearSpec):
    M, K = x.shape
    N = weight.shape[0]
    mask_x = x.new_empty((M, K) if (spec.x_clip_mask and not spec.x_dynamic) else (0,), dtype=torch.bool)
    mask_w = x.new_empty((N, K) if (spec.w_clip_mask and w_scale is not None) else (0,), dtype=torch.bool)
    s_x = x.new_empty((M, 1) if spec.x_dynamic else (1, 1), dtype=torch.float32)
    return (
        x.new_empty((M, N), dtype=torch.float32),
        x.new_empty((M, K), dtype=torch.int8),
        mask_x,
        x.new_empty((N, K), dtype=torch.int8),
        mask_w,
        s_x,
        x.new_empty((1,), dtype=torch.int32),
        x.new_empty((N,), dtype=torch.float32),
    )


def _packed(mask: Tensor) -> Tensor:
    return pack_mask(mask) if mask.numel() else mask  # no mask (nothing clips): nothing to pack


def _save(ctx, tensors, spec: LinearSpec, output):
    x, weight, bias, x_scale, x_zero_point, w_scale = tensors
    _, q_x, mask_x, q_w, mask_w, s_x, z_x, s_w = output
    x_lsq = not spec.x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad)
    w_lsq = w_scale is not None and w_scale.requires_grad
    # LSQ's in-range scale gradient (x_hat - x) / s needs x itself: saved only when a scale is learned.
    # the clip masks as bits (intqat.ops.masks): 1/8 of the bytes of the bool masks
    ctx.mask_shapes = (mask_x.shape, mask_w.shape)
    ctx.save_for_backward(
        q_x, _packed(mask_x), q_w, _packed(mask_w), s_x, z_x, s_w,
        x if x_lsq else None, weight if w_lsq else None,
    )
    ctx.ranges = (spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax)
    ctx.x_lsq, ctx.w_lsq = x_lsq, w_lsq
    ctx.has_bias = bias is not None
    ctx.grad_gemm = spec.grad_gemm
    ctx.x_scale_shape = x_scale.shape
    ctx.x_zero_point_shape = x_zero_point.shape
    ctx.w_scale_shape = None if w_scale is None else w_scale.shape


def _backward(ctx, g, _gq_x, _gmask_x, _gq_w, _gmask_w, _gs_x, _gz_x, _gs_w):
    """-> the gradients of (x, weight, bias, x_scale, x_zero_point, w_scale)."""
    if g is None:  # eager path with unmaterialised grads: y did not reach the loss
        return (None,) * 6
    q_x, bits_x, q_w, bits_w, s_x, z_x, w_scale, x, weight = ctx.saved_tensors
    # the clip masks stay bits where the plain fp32 path applies them (`_mask_zero_bits_`); the digit GEMM,
    # Triton and the LSQ terms take them as bool tensors (unpacked here, empty when nothing clips)
    mask_x, mask_w = (_Mask(b, shape) for b, shape in zip((bits_x, bits_w), ctx.mask_shapes))
    x_qmin, x_qmax, w_qmin, w_qmax = ctx.ranges
    need_x, need_w, need_b, need_sx, need_zx, need_sw = ctx.needs_input_grad[:6]
    g = g.to(torch.float32)
    grad_x = grad_w = grad_b = grad_sx = grad_zx = grad_sw = None
    fused_ste = backends.select("ste_grad_input", g, q_w)  # Triton: the whole STE GEMM with its mask, or None
    int8x3 = ctx.grad_gemm == "int8x3"
    M, K, N = q_x.shape[0], q_x.shape[1], q_w.shape[0]

    if need_x or need_sx or need_zx:
        if fused_ste is not None:
            grad_x, grad_xhat = fused_ste.ste_grad_input(g, q_w, w_scale, mask_x.bool() if mask_x else None)
        elif int8x3 and digits_pay(M, K, N, grad="x"):
            # grad_xhat = (g * s_w) @ q_w on the int8 units (digit_gemm); the mask is applied in the
            # same pass unless the LSQ terms below need grad_xhat unmasked
            fuse = mask_x and not ctx.x_lsq
            grad_xhat = digit_matmul(g, w_scale, q_w, 0, mask_x.bool() if fuse else None)
            grad_x = grad_xhat if (fuse or not mask_x) else torch.where(mask_x.bool(), grad_xhat, 0.0)
        else:
            # grad_xhat = g @ w_hat, w_hat = q_w * s_w[n]    (M, N) @ (N, K) -> (M, K), one pass to make w_hat
            grad_xhat = g @ _dequantized(q_w, w_scale, 0, per_row=True, role="w_hat")
            if not mask_x:
                grad_x = grad_xhat
            elif ctx.x_lsq:  # the LSQ terms below still need grad_xhat unmasked
                grad_x = torch.where(mask_x.bool(), grad_xhat, 0.0)
            else:
                grad_x = _mask_zero_bits_(grad_xhat, mask_x.bits)
        if ctx.x_lsq:
            grad_sx, grad_zx = activation_lsq_grads(grad_xhat, q_x, mask_x.bool(), x, s_x, z_x, x_qmin, x_qmax,
                                                    need_sx, need_zx)
            grad_sx = None if grad_sx is None else grad_sx.reshape(ctx.x_scale_shape)
            grad_zx = None if grad_zx is None else grad_zx.reshape(ctx.x_zero_point_shape)
    if need_w or need_sw:
        if fused_ste is not None:
            grad_w, grad_sw_raw = fused_ste.ste_grad_weight(
                g, q_x, s_x.reshape(-1), z_x, mask_w.bool() if mask_w else None,
                weight if need_sw else None, w_scale if need_sw else None, w_qmin, w_qmax,
                lsq_grad_factor(q_w.shape[1], w_qmax),
            )
            grad_what = None
        elif int8x3 and digits_pay(M, K, N, grad="w"):
            # grad_what = (g * s_x)ᵀ @ (q_x - z_x) on the int8 units; mask fused unless LSQ needs it unmasked
            fuse = mask_w and not need_sw
            grad_what = digit_matmul(g.t(), s_x.reshape(-1), q_x, z_x, mask_w.bool() if fuse else None)
            grad_w = grad_what if (fuse or not mask_w) else torch.where(mask_w.bool(), grad_what, 0.0)
        else:
            # grad_what = gᵀ @ x_hat, x_hat = (q_x - z_x) * s_x     (N, M) @ (M, K) -> (N, K)
            x_hat = _dequantized(q_x, s_x.reshape(-1), z_x, per_row=s_x.numel() != 1, role="x_hat")
            grad_what = g.t() @ x_hat
            if not mask_w:
                grad_w = grad_what
            elif need_sw:
                grad_w = torch.where(mask_w.bool(), grad_what, 0.0)
            else:
                grad_w = _mask_zero_bits_(grad_what, mask_w.bits)
        if need_sw:
            if fused_ste is not None:
                grad_sw = grad_sw_raw.reshape(ctx.w_scale_shape)
            else:
                m = mask_w.bool() if mask_w else mask_w.bits  # (empty: nothing clipped)
                grad_sw = weight_scale_grad(grad_what, q_w, m, weight, w_scale.reshape(-1, 1), w_qmin, w_qmax)
                grad_sw = grad_sw.reshape(ctx.w_scale_shape)
    if need_b and ctx.has_bias:
        grad_b = g.sum(dim=0)
    return grad_x, grad_w, grad_b, grad_sx, grad_zx, grad_sw


def _dequantized(q: Tensor, scale: Tensor, z, per_row: bool, role: str) -> Tensor:
    """(q - z) * s as fp32 for a backward matmul. role: names a reusable scratch buffer (the result
    dies in the matmul), which eager CPU backends write into instead of a fresh tensor."""
    b = backends.select("dequantize_rows", q, scale, z if isinstance(z, Tensor) else None)
    if b.traceable:  # traced: the zero point stays data
        return b.dequantize_rows(q, scale.reshape(-1), z if isinstance(z, int) else z.reshape(()), per_row)
    return b.dequantize_rows(q, scale, 0.0 if isinstance(z, int) else float(z.reshape(())), per_row, scratch=role)


class _Mask:
    """A clip mask saved as bits (`pack_mask`); false when nothing clips (saved empty). `.bool()` unpacks
    it once, for the consumers that take a bool tensor."""

    __slots__ = ("bits", "shape", "_bool")

    def __init__(self, bits: Tensor, shape: torch.Size):
        self.bits, self.shape, self._bool = bits, shape, None

    def __bool__(self) -> bool:
        return bool(self.bits.numel())  # (a SymInt under dynamic shapes: bool() guards on it, as before)

    def bool(self) -> Tensor:
        if self._bool is None:
            self._bool = unpack_mask(self.bits, self.shape)
        return self._bool


def _mask_zero_bits_(g: Tensor, bits: Tensor) -> Tensor:
    """where(mask, g, 0) with the mask still as bits, in place on g (a fresh matmul result) where the
    backend can (one pass, no bool tensor)."""
    return backends.select("mask_zero_packed_", g, bits).mask_zero_packed_(g, bits)


LINEAR = IntegerOp("intqat::int_linear", tensors=("x", "weight", "bias?", "x_scale", "x_zero_point", "w_scale?"),
                   spec=LinearSpec, outputs=8, forward=_forward, fake=_fake, save=_save, backward=_backward,
                   eager_name="_IntLinearEager")
_int_linear_op = LINEAR.op  # the custom op (torch.ops.intqat.int_linear)


class LinearStep(NamedTuple):
    """One int_linear call: its options (`op`) and the facts the table decides the step from (hashable: part of
    its cache key). learned: an LSQ scale or zero point requires grad; finite: the static activation scale and
    zero point are not NaN (read only for eager CPU calls)."""

    op: LinearSpec
    w_scale_given: bool
    learned: bool
    x_scale_float32: bool
    finite: bool


def _python_step(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec: LinearStep, s_x, z_x) -> Tensor:
    """The reference backend's `linear_step`: the op's Python path (the custom op while a tracer watches)."""
    return LINEAR(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec=spec.op)[0]


Reference.define("linear_step", _python_step)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _check_inputs(x, weight, bias, x_scale, x_zero_point, w_scale, x_dynamic) -> None:
    def bad(msg):
        raise ValueError(f"int_linear: {msg}")

    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1:
        bad(f"x must be a floating-point tensor (..., K), got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if weight.dim() != 2 or not weight.is_floating_point():
        bad(f"weight must be a 2-D float (N, K) tensor, got {weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape
    if x.shape[-1] != K:
        bad(f"K mismatch: x is {tuple(x.shape)} (..., K) and weight is {tuple(weight.shape)} (N, K)")
    if bias is not None and tuple(bias.shape) != (N,):
        bad(f"bias must have shape ({N},) for weight {tuple(weight.shape)}, got {tuple(bias.shape)}")
    for name, t in (("x_scale", x_scale), ("x_zero_point", x_zero_point), ("w_scale", w_scale), ("bias", bias)):
        if t is not None and not isinstance(t, Tensor):
            bad(f"{name} must be a tensor (or None), got {type(t).__name__} {t!r}")
    if w_scale is not None and w_scale.numel() != N:
        bad(f"w_scale must have one scale per output channel, shape ({N},), got {tuple(w_scale.shape)}")
    if not x_dynamic:
        if x_scale is None or x_scale.numel() != 1:
            bad(f"static activations need a per-tensor x_scale of shape (1,), got {None if x_scale is None else tuple(x_scale.shape)}")
        if x_zero_point is None or x_zero_point.numel() != 1:
            bad(f"static activations need a per-tensor x_zero_point of shape (1,), got {None if x_zero_point is None else tuple(x_zero_point.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("w_scale", w_scale), ("x_scale", x_scale)):
        if t is not None and t.device != x.device:
            bad(f"{name} is on {t.device} but x is on {x.device}")


def int_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    x_scale: Tensor | None,
    x_zero_point: Tensor | None,
    w_scale: Tensor | None,
    *,
    x_qmin: int = -128,
    x_qmax: int = 127,
    w_qmin: int = -127,
    w_qmax: int = 127,
    x_dynamic: bool = False,
    w_clip_mask: bool | None = None,
    grad_gemm: str = "int8x3",
) -> Tensor:
    """y = x @ Wᵀ + b through int8 codes and an int32 matmul; differentiable (STE + LSQ).

    x (..., K) float, weight (N, K), bias (N,) or None.
    w_scale (N,) fp32 (learnable or not), or None for the min-max scale max(max|W[n]| / w_qmax, eps)
    computed inside the op (on the CPU in the same pass that makes the codes; it never clips).
    Scales must be positive: the op does not read them to check (that would sync a GPU per call); the
    modules keep theirs >= eps (observers, LSQ's clamp, set_qparams' check).
    Static activations: x_scale (1,) and x_zero_point (1,) (float or int; learnable by LSQ / LSQ+).
    `x_dynamic=True`: per-token symmetric scales from the data; x_scale / x_zero_point are ignored.
    `w_clip_mask`: keep the weight clip mask for backward (default True). A caller whose w_scale is
    the weight's own max|W| / qmax may pass False: such a scale never clips, the mask is all ones.
    `grad_gemm`: "int8x3" (default): the backward GEMMs grad_x = (g * s_w) @ q_w and, on AMX CPUs,
    grad_w = (g * s_x)ᵀ @ (q_x - z_x) run on the int8 units, g split into three int8 digits (21 bits
    below each row's max, rounded once; intqat.ops.digit_gemm), for the layers where that is faster
    (`digits_pay`); "fp32": fp32 GEMMs only. The Triton (GPU) backward runs fp32 GEMMs.
    """
    b, args = linear_call(x, weight, bias, x_scale, x_zero_point, w_scale, x_qmin=x_qmin, x_qmax=x_qmax, w_qmin=w_qmin,
                          w_qmax=w_qmax, x_dynamic=x_dynamic, w_clip_mask=w_clip_mask, grad_gemm=grad_gemm)
    y = b.linear_step(*args)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])


def linear_call(x, weight, bias, x_scale, x_zero_point, w_scale, *, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic,
                w_clip_mask, grad_gemm, record: bool = True):
    """int_linear's checks and the table's choice: (backend, the arguments of its `linear_step`). record=False: a
    question (intqat.nn.eager_step caches the answer per layer), not a call."""
    _check_inputs(x, weight, bias, x_scale, x_zero_point, w_scale, x_dynamic)
    check_qrange(x_qmin, x_qmax)
    check_qrange(w_qmin, w_qmax)
    check_grad_gemm(grad_gemm)
    if x_dynamic:
        x_scale = x_zero_point = x.new_zeros(1, dtype=torch.float32)
    else:
        x_zero_point = x_zero_point.to(torch.float32) if not x_zero_point.is_floating_point() else x_zero_point
    if w_clip_mask is None:
        w_clip_mask = True
    flat = x.dim() == 2  # (M, K) already: no view on either side (each one an autograd node per step)
    # row-major on every backend: the codes and x_hat the backward multiplies keep one layout, so the fp32
    # GEMMs sum in the same order everywhere (a permuted x gave the reference another grad_w, 1 ulp)
    x2d = (x if flat else x.reshape(-1, x.shape[-1])).to(torch.float32).contiguous()
    tensors = (x2d, weight, bias, x_scale, x_zero_point, w_scale)
    learned = (w_scale is not None and w_scale.requires_grad) or (
        not x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad))
    s_x = z = None
    eager = backends.eager_cpu(tensors)
    if eager and not (x_dynamic or learned):  # what the C++ step takes as numbers
        s_x, z = float(x_scale), rounded_zero_point_int(x_zero_point, x_qmin, x_qmax)
    op = LinearSpec(x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic, not x_dynamic, w_clip_mask, grad_gemm)
    spec = LinearStep(op, w_scale is not None, learned, x_dynamic or x_scale.dtype == torch.float32,
                      s_x is None or (s_x == s_x and z is not None))
    M, K = x2d.shape
    b = backends.select("linear_step", *tensors, shape=(M, K, weight.shape[0]), spec=spec, eager=eager, record=record)
    return b, (x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z)
