"""The integer linear layer with per-group weight scales (LLM-style "8da4w": int8 per-token activations,
int4 weights with one scale per group of `group_size` input features).

x (M, K), W (N, K), groups g = 0 .. G-1 of the K axis, G = K / group_size, k in group g when
k // group_size == g. Forward (docs/numerics.md, "Per-group layers"):
    q_x      = quantize(x, s_x, z_x)                       # per-token dynamic (z_x = 0) or static per-tensor
    q_w      = quantize(W, s_w[n, g(k)], 0)                # symmetric, one scale per (row, group)
    acc_g    = sum_{k in g} (q_x[m, k] - z_x) * q_w[n, k]  # (G, M, N) int32, exact
    p_g      = float32(acc_g) * s_w[n, g]                  # one rounding
    t        = (...((p_0 + p_1) + p_2) + ...) + p_{G-1}    # fp32, increasing g, one rounding per add
    y        = t * s_x[m] + b[n]                           # one rounding per step, no FMA
Backward (straight-through, fp32), from the codes, scales and clip masks only (masks saved as bits, 8 a byte):
    w_hat     = q_w * s_w[n, g(k)]                          # (N, K)
    grad_x    = (g @ w_hat) * mask_x
    grad_w    = (gᵀ @ x_hat) * mask_w,  x_hat = (q_x - z_x) * s_x
plus LSQ gradients for learned scales: per group, n = group_size elements share s_w[n, g], so
grad_s_w[n, g] = sum_{k in g} grad_w_hat[n, k] * d w_hat / d s * 1/sqrt(group_size * qmax).

Where the forward runs:
- eager CPU with the C library (kernels/cpu/grouped_linear.c): one pass, the group sums stay in
  registers (AVX512-VNNI; on CPUs without it, exact fp32 multiply-adds of the codes), same bits as
  the reference below;
- otherwise (traced by torch.export / torch.compile, no compiler): the reference in portable aten
  ops: one batched fp32 GEMM of the codes, exact because every partial sum is an integer of
  magnitude <= group_size * 2^14 <= 2^24 (docs/numerics.md, "Exact int8 products on fp32 units"), then the sum over groups as
  G - 1 explicit adds, which fixes their order;
- CUDA / INTQAT_BACKEND=triton: kernels/int_gemm_grouped.py (scales applied inside its K loop).
`intqat::int_linear_grouped` is one torch.library custom op (export / compile see one node); eager calls go
through `_GroupedEager`, the same forward and backward without the dispatch: both built from the formulas
below by `op_outline.IntegerOp` (GROUPED), the scalar options as one GroupedSpec.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from intqat.ops import backends
from intqat.ops.digit_gemm import digit_matmul, digits_pay
from intqat.ops.backends.reference import Reference
from intqat.ops.backends.formulas import group_sums, grouped_reference  # noqa: F401 (re-exported)
from intqat.ops.int_linear import quantize_activation, rounded_zero_point, rounded_zero_point_int
from intqat.ops.lsq import activation_lsq_grads, weight_scale_grad
from intqat.ops.op_outline import IntegerOp
from intqat.ops.masks import pack_mask, unpack_mask
from intqat.ops.qparams import SCALE_EPS
from intqat.ops.quant import check_qrange, dequantize, quantize, quantize_with_mask

__all__ = [
    "int_linear_grouped",
    "grouped_integer_linear",
    "grouped_reference",
    "quantize_weight_grouped",
    "dequantize_weight_grouped",
    "minmax_group_scale",
    "check_group_size",
    "MAX_GROUP_SIZE",
]

# An fp32 GEMM of int8 codes is exact while each partial sum stays an integer <= 2^24: gs * 127 * 128 <= 2^24.
MAX_GROUP_SIZE = 1024


def check_group_size(K: int, group_size: int, what: str = "int_linear_grouped") -> int:
    """G = K // group_size, or a ValueError naming the sizes."""
    if not isinstance(group_size, int) or group_size <= 0 or K % group_size:
        raise ValueError(f"{what}: group_size={group_size!r} must be a positive divisor of K={K} (e.g. 32, 64, 128, 256)")
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(f"{what}: group_size={group_size} exceeds {MAX_GROUP_SIZE}: the group sums would no "
                         "longer be exact in the fp32 reference; use per-channel weights instead")
    return K // group_size


# ---------------------------------------------------------------------------------------------
# Weights: codes and scales per group
# ---------------------------------------------------------------------------------------------


def minmax_group_scale(weight: Tensor, group_size: int, qmax: float) -> Tensor:
    """(N, G) fp32: max(max|W[n, group g]| / qmax, eps). Such a scale never clips. qmax may be a float
    (7.5 for torch's [-8, 7] int4 grid)."""
    N, K = weight.shape
    w = weight.detach().reshape(N, K // group_size, group_size)
    amax = torch.maximum(w.amax(dim=2), w.amin(dim=2).neg()).to(torch.float32)
    return torch.clamp(amax / qmax, min=SCALE_EPS)


def quantize_weight_grouped(weight: Tensor, w_scale: Tensor | None, group_size: int, qmin: int, qmax: int,
                            need_mask: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
    """W (N, K) -> (q_w int8 (N, K), clip mask bool (N, K) or None, s_w fp32 (N, G)).

    w_scale None: the min-max scale (`minmax_group_scale` with qmax), computed in the pass that makes
    the codes on the CPU. Each (row, group) is one row of the (N * G, group_size) view, so the
    per-row quantize kernels do the work.
    """
    N, K = weight.shape
    G = check_group_size(K, group_size)
    w = weight.detach().reshape(N * G, group_size)
    if w_scale is None:
        if qmin == -qmax:  # symmetric: the dynamic per-row pass makes the min-max scale and the codes at once
            q, s, _ = backends.select("quantize_rows_dynamic", w).quantize_rows_dynamic(w, qmin, qmax, SCALE_EPS)
            return q.reshape(N, K), torch.ones(N, K, dtype=torch.bool) if need_mask else None, s.reshape(N, G)
        s = minmax_group_scale(weight, group_size, qmax)
    else:
        if tuple(w_scale.shape) != (N, G):
            raise ValueError(f"w_scale must be (N, G) = ({N}, {G}) for weight {tuple(weight.shape)} and "
                             f"group_size={group_size}, got {tuple(w_scale.shape)}")
        s = w_scale.detach().to(torch.float32)
    flat = s.reshape(-1)
    if need_mask:
        q, mask = quantize_with_mask(w, flat, 0, qmin, qmax, axis=0)
        return q.reshape(N, K), mask.reshape(N, K), s
    return quantize(w, flat, 0, qmin, qmax, axis=0).reshape(N, K), None, s


def dequantize_weight_grouped(q_w: Tensor, s_w: Tensor) -> Tensor:
    """w_hat (N, K) fp32 = q_w[n, k] * s_w[n, g(k)] (one rounding): what the backward multiplies by."""
    N, K = q_w.shape
    G = s_w.shape[1]
    return dequantize(q_w.reshape(N * G, K // G), s_w.reshape(-1), 0, axis=0).reshape(N, K)


# ---------------------------------------------------------------------------------------------
# Forward: the reference (aten, portable) and the C kernel (same bits)
# ---------------------------------------------------------------------------------------------


def grouped_integer_linear(q_x: Tensor, q_w: Tensor, s_w: Tensor, z_x: Tensor | None, s_x: Tensor,
                           bias: Tensor | None) -> Tensor:
    """y (M, N) fp32 from q_x (M, K) int8, q_w (N, K) int8, s_w (N, G), z_x (1,) int32 or None
    (symmetric), s_x (M, 1) or (1, 1), bias (N,) or None: the formulas of the module docstring.

    The backend table picks the implementation (`intqat.ops.backends`, primitive "linear_grouped"):
    the C kernel on VNNI CPUs (cpu_fused), its exact-fp32 twin without int8 dot products
    (avx2_int16 / fp32_exact), Triton on GPUs, `grouped_reference` when traced. Same bits everywhere.
    """
    shape = (q_x.shape[0], q_x.shape[1], q_w.shape[0])
    b = backends.select("linear_grouped", q_x, q_w, s_w, s_x, bias, z_x, shape=shape)
    return b.linear_grouped(q_x, q_w, s_w, z_x, s_x, bias)


# ---------------------------------------------------------------------------------------------
# The custom op
# ---------------------------------------------------------------------------------------------


def _empty(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.bool, device=like.device)  # outputs may not alias each other


class GroupedSpec(NamedTuple):
    """int_linear_grouped's scalar options, as one value; the op schema's plain arguments, in this order."""

    group_size: int
    x_qmin: int
    x_qmax: int
    w_qmin: int
    w_qmax: int
    x_dynamic: bool
    w_clip_mask: bool


def _forward(x: Tensor, weight: Tensor, bias: Tensor | None, x_scale: Tensor, x_zero_point: Tensor,
             w_scale: Tensor | None, spec: GroupedSpec):
    """-> (y (M, N), q_x (M, K) int8, mask_x, q_w (N, K) int8, mask_w, s_x, z_x (1,) int32, s_w (N, G))."""
    x_dynamic = spec.x_dynamic
    z_x = torch.zeros(1, dtype=torch.int32) if x_dynamic else rounded_zero_point(x_zero_point, spec.x_qmin, spec.x_qmax)
    q_x, mask_x, s_x = quantize_activation(x, x_scale, z_x, spec.x_qmin, spec.x_qmax, x_dynamic, not x_dynamic)
    w_clip_mask = spec.w_clip_mask and w_scale is not None  # a min-max scale never clips
    q_w, mask_w, s_w = quantize_weight_grouped(weight, w_scale, spec.group_size, spec.w_qmin, spec.w_qmax,
                                               need_mask=w_clip_mask)
    s_w = s_w.to(torch.float32, copy=True)  # an output may not alias an input
    b = None if bias is None else bias.detach()
    y = grouped_integer_linear(q_x, q_w, s_w, None if x_dynamic else z_x, s_x, b)
    return (y, q_x, _empty(x) if mask_x is None else mask_x, q_w, mask_w if w_clip_mask else _empty(x), s_x, z_x, s_w)


def _fake(x, weight, bias, x_scale, x_zero_point, w_scale, spec: GroupedSpec):
    M, K = x.shape
    N = weight.shape[0]
    return (
        x.new_empty((M, N), dtype=torch.float32),
        x.new_empty((M, K), dtype=torch.int8),
        x.new_empty((0,) if spec.x_dynamic else (M, K), dtype=torch.bool),
        x.new_empty((N, K), dtype=torch.int8),
        x.new_empty((N, K) if (spec.w_clip_mask and w_scale is not None) else (0,), dtype=torch.bool),
        x.new_empty((M, 1) if spec.x_dynamic else (1, 1), dtype=torch.float32),
        x.new_empty((1,), dtype=torch.int32),
        x.new_empty((N, K // spec.group_size), dtype=torch.float32),
    )


def _packed(mask: Tensor) -> Tensor:
    return pack_mask(mask) if mask.numel() else mask  # bool (...) -> uint8 (ceil(n / 8),); empty stays empty


def _save(ctx, tensors, spec: GroupedSpec, output):
    x, weight, bias, x_scale, x_zero_point, w_scale = tensors
    _, q_x, mask_x, q_w, mask_w, s_x, z_x, s_w = output
    x_lsq = not spec.x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad)
    w_lsq = w_scale is not None and w_scale.requires_grad
    # LSQ's in-range scale gradient (x_hat - x) / s needs x itself: saved only when a scale is learned.
    # The clip masks as bits (intqat.ops.masks, as int_linear does): 1/8 of the bytes of the bool masks;
    # an empty mask (dynamic activations, min-max weight scales: nothing clips) is saved as it is.
    ctx.mask_shapes = (mask_x.shape, mask_w.shape)
    ctx.save_for_backward(q_x, _packed(mask_x), q_w, _packed(mask_w), s_x, z_x, s_w, x if x_lsq else None,
                          weight if w_lsq else None)
    ctx.ranges = (spec.x_qmin, spec.x_qmax, spec.w_qmin, spec.w_qmax)
    ctx.x_lsq, ctx.w_lsq, ctx.has_bias = x_lsq, w_lsq, bias is not None
    ctx.shapes = (x_scale.shape, x_zero_point.shape, None if w_scale is None else w_scale.shape)


def _backward(ctx, g, *_unused):
    """-> the gradients of (x, weight, bias, x_scale, x_zero_point, w_scale)."""
    if g is None:  # eager path with unmaterialised grads: y did not reach the loss
        return (None,) * 6
    q_x, mask_x, q_w, mask_w, s_x, z_x, s_w, x, weight = ctx.saved_tensors
    mask_x, mask_w = (unpack_mask(m, shape) if m.numel() else m for m, shape in zip((mask_x, mask_w), ctx.mask_shapes))
    x_qmin, x_qmax, w_qmin, w_qmax = ctx.ranges
    need_x, need_w, need_b, need_sx, need_zx, need_sw = ctx.needs_input_grad[:6]
    sx_shape, zx_shape, sw_shape = ctx.shapes
    g = g.to(torch.float32)
    grad_x = grad_w = grad_b = grad_sx = grad_zx = grad_sw = None
    if need_x or need_sx or need_zx:
        # grad_xhat = g @ w_hat, w_hat = q_w * s_w[n, g(k)]     (M, N) @ (N, K) -> (M, K)
        grad_xhat = g @ dequantize_weight_grouped(q_w, s_w)
        grad_x = torch.where(mask_x, grad_xhat, 0.0) if mask_x.numel() else grad_xhat
        if ctx.x_lsq:
            grad_sx, grad_zx = activation_lsq_grads(grad_xhat, q_x, mask_x, x, s_x, z_x, x_qmin, x_qmax, need_sx, need_zx)
            grad_sx = None if grad_sx is None else grad_sx.reshape(sx_shape)
            grad_zx = None if grad_zx is None else grad_zx.reshape(zx_shape)
    if need_w or need_sw:
        # grad_what = gᵀ @ x_hat, x_hat = (q_x - z_x) * s_x      (N, M) @ (M, K) -> (N, K)
        if digits_pay(*q_x.shape, q_w.shape[0], grad="w"):
            grad_what = digit_matmul(g.t(), s_x.reshape(-1), q_x, z_x)  # on the int8 units (AMX CPUs)
        else:
            per_row = s_x.numel() != 1  # (per token: M scales, M may be 0)
            x_hat = dequantize(q_x, s_x.reshape(-1) if per_row else s_x.reshape(()), z_x.reshape(()),
                               axis=0 if per_row else None)
            grad_what = g.t() @ x_hat
        grad_w = torch.where(mask_w, grad_what, 0.0) if mask_w.numel() else grad_what
        if need_sw:
            N, K = q_w.shape
            G = s_w.shape[1]
            per_group = lambda t: t.reshape(N, G, K // G)  # noqa: E731 (each group one row of scale)
            m = per_group(mask_w) if mask_w.numel() else mask_w
            grad_sw = weight_scale_grad(per_group(grad_what), per_group(q_w), m, per_group(weight), s_w.reshape(N, G, 1),
                                        w_qmin, w_qmax).reshape(sw_shape)
    if need_b and ctx.has_bias:
        grad_b = g.sum(dim=0)
    return grad_x, grad_w, grad_b, grad_sx, grad_zx, grad_sw


class GroupedStep(NamedTuple):
    """One int_linear_grouped call: its options (`op`) and the facts the backend table decides the step from (as
    int_linear.LinearStep): w_scale_given; learned: an LSQ scale or zero point requires grad; x_scale_float32;
    finite: the static activation scale and zero point are not NaN (read on eager CPU calls only)."""

    op: GroupedSpec
    w_scale_given: bool
    learned: bool
    x_scale_float32: bool
    finite: bool


def _python_step(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec: GroupedStep, s_x, z_x) -> Tensor:
    """The reference backend's `grouped_step`: the op's Python path (the custom op while a tracer watches)."""
    return GROUPED(x2d, weight, bias, x_scale, x_zero_point, w_scale, spec=spec.op)[0]


GROUPED = IntegerOp("intqat::int_linear_grouped",
                    tensors=("x", "weight", "bias?", "x_scale", "x_zero_point", "w_scale?"), spec=GroupedSpec,
                    outputs=8, forward=_forward, fake=_fake, save=_save, backward=_backward, eager_name="_GroupedEager")
_op = GROUPED.op  # the custom op (torch.ops.intqat.int_linear_grouped)
Reference.define("grouped_step", _python_step)


# ---------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------


def _check(x, weight, bias, x_scale, x_zero_point, w_scale, group_size, x_dynamic) -> None:
    def bad(msg):
        raise ValueError(f"int_linear_grouped: {msg}")

    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1:
        bad(f"x must be a floating-point tensor (..., K), got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        bad(f"weight must be a 2-D float (N, K) tensor, got {getattr(weight, 'dtype', type(weight))} "
            f"{tuple(getattr(weight, 'shape', ()))}")
    N, K = weight.shape
    if x.shape[-1] != K:
        bad(f"K mismatch: x is {tuple(x.shape)} (..., K) and weight is {tuple(weight.shape)} (N, K)")
    G = check_group_size(K, group_size)
    if bias is not None and tuple(bias.shape) != (N,):
        bad(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if w_scale is not None and tuple(w_scale.shape) != (N, G):
        bad(f"w_scale must have one scale per row and group, shape ({N}, {G}), got {tuple(w_scale.shape)}")
    if not x_dynamic:
        for name, t in (("x_scale", x_scale), ("x_zero_point", x_zero_point)):
            if t is None or t.numel() != 1:
                bad(f"static activations need a per-tensor {name} of shape (1,), got "
                    f"{None if t is None else tuple(t.shape)}")
    for name, t in (("weight", weight), ("bias", bias), ("w_scale", w_scale)):
        if t is not None and t.device != x.device:
            bad(f"{name} is on {t.device} but x is on {x.device}")


def int_linear_grouped(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    x_scale: Tensor | None,
    x_zero_point: Tensor | None,
    w_scale: Tensor | None,
    *,
    group_size: int,
    x_qmin: int = -127,
    x_qmax: int = 127,
    w_qmin: int = -7,
    w_qmax: int = 7,
    x_dynamic: bool = True,
    w_clip_mask: bool = True,
) -> Tensor:
    """y = x @ Wᵀ + b with per-group weight scales, through int8 codes and exact group sums; differentiable.

    x (..., K) float, weight (N, K), bias (N,) or None, group_size dividing K (<= 1024).
    w_scale (N, K // group_size) fp32 (learnable or not), or None for the min-max scale
    max|W[n, group]| / w_qmax computed inside (it never clips). Defaults: 8da4w (dynamic per-token
    int8 activations, int4 weights on [-7, 7]). Static activations: x_dynamic=False with x_scale (1,)
    and x_zero_point (1,) (learnable by LSQ / LSQ+). The backward GEMMs run in fp32 (grad_w on the
    int8 units on AMX CPUs, as int_linear's).
    """
    b, args = grouped_call(x, weight, bias, x_scale, x_zero_point, w_scale, group_size=group_size, x_qmin=x_qmin,
                           x_qmax=x_qmax, w_qmin=w_qmin, w_qmax=w_qmax, x_dynamic=x_dynamic, w_clip_mask=w_clip_mask)
    y = b.grouped_step(*args)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def grouped_call(x, weight, bias, x_scale, x_zero_point, w_scale, *, group_size, x_qmin, x_qmax, w_qmin, w_qmax,
                 x_dynamic, w_clip_mask, record: bool = True):
    """int_linear_grouped's checks and the table's choice: (backend, the arguments of its `grouped_step`).
    record=False: a question (intqat.nn.eager_step caches the answer per layer), not a call."""
    _check(x, weight, bias, x_scale, x_zero_point, w_scale, group_size, x_dynamic)
    check_qrange(x_qmin, x_qmax)
    check_qrange(w_qmin, w_qmax)
    if x_dynamic:
        x_scale = x_zero_point = x.new_zeros(1, dtype=torch.float32)
    elif not x_zero_point.is_floating_point():
        x_zero_point = x_zero_point.to(torch.float32)
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
    tensors = (x2d, weight, bias, x_scale, x_zero_point, w_scale)
    learned = (w_scale is not None and w_scale.requires_grad) or (
        not x_dynamic and (x_scale.requires_grad or x_zero_point.requires_grad))
    s_x = z = None
    eager = backends.eager_cpu(tensors)
    if eager:
        x2d = x2d.contiguous()  # (the C++ step takes row-major x; the Python path's passes make it so anyway)
        if not (x_dynamic or learned):  # what the C++ step takes as numbers
            s_x, z = float(x_scale), rounded_zero_point_int(x_zero_point, x_qmin, x_qmax)
    op = GroupedSpec(group_size, x_qmin, x_qmax, w_qmin, w_qmax, x_dynamic, w_clip_mask)
    spec = GroupedStep(op, w_scale is not None, learned, x_dynamic or x_scale.dtype == torch.float32,
                       s_x is None or (s_x == s_x and z is not None))
    b = backends.select("grouped_step", *tensors, shape=(x2d.shape[0], x2d.shape[1], weight.shape[0]), spec=spec,
                        eager=eager, record=record)
    return b, (x2d, weight, bias, x_scale, x_zero_point, w_scale, spec, s_x, z)
