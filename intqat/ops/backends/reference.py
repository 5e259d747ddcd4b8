"""The plain-torch backend: the definition of every primitive (docs/numerics.md), and what tracers see.

Every other backend must return the same bits as this one, but for `depthwise_grad` (fp32 sums whose order is each
implementation's: equal within rounding, see its docstring). Two forms, chosen per call:
- the definition (eager calls: what tests/test_backends.py compares every backend with): its integer GEMMs
  are `exact.exact_int_mm`, an int64 matmul on the CPU that shares no kernel with the fast backends
  (docs/numerics.md, "The definition does not lean on the kernels it checks"). Slower; exact on any machine.
- what tracers see (torch.compile / torch.export / make_fx): the same formulas in portable aten ops, the
  integer GEMM as `aten._int_mm`, so exported programs stay small, portable and fast where they run. The
  one exception: torch.compile (not export) in a process whose torch._int_mm failed its self-check gets
  `exact.fp32_slices_mm` instead, since that graph runs here.
It is the only backend taken while tracing (with triton on GPUs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from intqat.ops.backends import self_check
from intqat.ops.backends.base import Backend, tracing
from intqat.ops.backends.formulas import (combine_digits, grouped_reference, pack_mask_torch, split_digits,
                                          unpack_mask_torch)
from intqat.ops.backends.exact import MAX_K_INT32, exact_int_mm, fp32_slices_mm, to_int32

__all__ = ["Reference", "MAX_K_INT32", "dense_layout", "is_dense", "split_k", "traced_int_mm"]


def is_dense(t: Tensor) -> bool:
    """Row-major, or column-major with no size-1 dim: layouts torch._int_mm handles (see dense_layout)."""
    rows, cols = t.shape
    st = t.stride()
    return (st[1] == 1 and st[0] == cols) or (st[0] == 1 and st[1] == rows and rows > 1 and cols > 1)


def dense_layout(t: Tensor) -> Tensor:
    """t itself if `is_dense`, else a row-major copy.

    torch._int_mm (CPU, torch 2.13) returns wrong numbers for some layouts that involve size-1
    dims, e.g. a (44, 1) view with strides (1, 44) times a (1, 56) view with strides (1, 1);
    tests/test_int_mm.py keeps the cases. Those layouts only arise for degenerate shapes, so the
    copy costs nothing that matters.
    """
    if is_dense(t):
        return t
    return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device).copy_(t)


def split_k(a: Tensor, b: Tensor, chunk: int, mm) -> Tensor:
    """int_mm for a contraction too long for one int32 sum: mm(a_k, b_k) of K chunks of at most
    `chunk`, each exact in int32, added in int64; the exact result must fit int32 (out_dtype's
    contract) or this raises OverflowError naming the shapes and the range."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int64, device=a.device)
    for k0 in range(0, a.shape[1], chunk):
        acc += mm(a[:, k0 : k0 + chunk], b[k0 : k0 + chunk])
    return to_int32(acc, a, b)


def traced_int_mm(a: Tensor, b: Tensor) -> Tensor:
    """int_mm as tracers should record it: aten._int_mm (portable; the consumer's int8 units run it).

    Under torch.compile (which runs its graph in this process, unlike export) when this process's
    torch._int_mm failed its self-check: exact fp32 K slices instead (`exact.fp32_slices_mm`)."""
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or K == 0:
        # torch._int_mm returns uninitialised memory for K = 0 on some builds; the sum of nothing is 0.
        return torch.zeros(M, N, dtype=torch.int32, device=a.device)
    if (torch.compiler.is_compiling() and not torch.compiler.is_exporting()
            and self_check.untrusted_while_compiling("torch._int_mm")):
        return fp32_slices_mm(a, b)
    if K > MAX_K_INT32:
        return split_k(a, b, MAX_K_INT32, lambda x, y: torch._int_mm(dense_layout(x), dense_layout(y)))
    return torch._int_mm(dense_layout(a), dense_layout(b))


def _row_scale(scale: Tensor, x: Tensor, per_row: bool) -> Tensor:
    s = scale.to(torch.float32)
    return s.reshape(-1, *([1] * (x.dim() - 1))) if per_row else s.reshape(())


class Reference(Backend):
    name = "reference"
    needs = "torch only (the definition; what tracers and exported programs see)"
    primitives = frozenset({
        "int_mm", "linear", "epilogue", "digit_matmul", "quantize_rows", "quantize_rows_dynamic",
        "fake_quantize_rows", "dequantize_rows", "mask_zero_packed_", "pack_mask", "unpack_mask", "linear_grouped",
        "minmax", "linear_step", "conv_step", "grouped_step", "depthwise_grad",
    })
    traceable = True
    _steps: dict = {}  # "linear_step" / "conv_step" -> the op's Python path (`define`)

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        return None

    def slow(self, primitive, shape, spec=None):
        if primitive == "digit_matmul" and shape is not None:
            return "the digit GEMM's torch twin (the definition): never faster than the fp32 backward GEMM"
        return None

    # --- whole training steps: the ops' Python paths ---------------------------------------------

    @classmethod
    def define(cls, primitive: str, step) -> None:
        """Register an op's Python path as this backend's `primitive` (int_linear.py: "linear_step",
        int_linear_grouped.py: "grouped_step", int_conv2d.py: "conv_step"): its autograd.Function eagerly, its custom op while traced. The op modules
        register it so that backends import no op file."""
        cls._steps[primitive] = step

    def linear_step(self, *args):
        return self._steps["linear_step"](*args)

    def conv_step(self, *args):
        return self._steps["conv_step"](*args)

    def grouped_step(self, *args):
        return self._steps["grouped_step"](*args)

    # --- integer GEMMs -------------------------------------------------------------------------

    def int_mm(self, a: Tensor, b: Tensor) -> Tensor:
        """a (M, K) int8 @ b (K, N) int8 -> (M, N) int32: the exact sums (`exact_int_mm`, int64 on the CPU),
        or, while a tracer records the call, `traced_int_mm` (aten._int_mm)."""
        if tracing(a, b):
            return traced_int_mm(a, b)
        return exact_int_mm(a, b)

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        """y = epilogue(int_mm(q_x, q_wᵀ), ...): q_x (M, K), q_w (N, K) int8 -> (M, N) fp32."""
        acc = self.int_mm(q_x, q_w.t())
        return self.table.select("epilogue", acc, s_x, s_w, bias).epilogue(acc, z_x, colsum, s_x, s_w, bias)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """The per-group integer linear (int_linear_grouped.py's formulas): one exact fp32 batched GEMM of
        the codes, the groups added in increasing order."""
        return grouped_reference(q_x, q_w, s_w, z_x, s_x, bias)

    def epilogue(self, acc, z_x, colsum, s_x, s_w, bias):
        """acc (M, N) int32 -> float32(acc - z_x * colsum[n]) * (s_x[m] * s_w[n]) + b[n], one rounding a step.

        z_x: int32 (1,) or None (symmetric activations: no correction); s_x (M, 1) or (1, 1)."""
        if z_x is not None:
            acc = acc - z_x * colsum
        y = acc.to(torch.float32) * (s_x * s_w.reshape(1, -1))
        return y + bias.to(torch.float32) if bias is not None else y  # (a float64 bias: float32 y, as every backend)

    def digit_matmul(self, a, col_scale, q, z, mask):
        """where(mask, (a * col_scale) @ (q - z), 0) through three int8 digit planes (digit_gemm.py).

        Its edges: an empty product is zeros; a contraction past MAX_K_INT32 (whose int32 digit sums could
        overflow) is the plain fp32 GEMM."""

        R, C = a.shape
        K = q.shape[1]
        if C > MAX_K_INT32:
            out = (a.to(torch.float32) * col_scale.to(torch.float32).reshape(1, -1)) @ (q.to(torch.float32) - z)
            return out if mask is None else torch.where(mask, out, 0.0)
        if R == 0 or K == 0 or C == 0:
            out = a.new_zeros((R, K), dtype=torch.float32)
            return out if mask is None else torch.where(mask, out, 0.0)
        digits, shift, rowsum = split_digits(a, col_scale, need_rowsum=isinstance(z, Tensor) or bool(z))
        acc = self.int_mm(digits.reshape(3 * R, C), q)
        return combine_digits(acc, shift, rowsum, z, mask)

    # --- elementwise passes (quant.py's formulas, rows along dim 0) ----------------------------

    def quantize_rows(self, x, scale, zero_point, qmin, qmax, per_row, need_mask=False, need_rowsum=False):
        """x float -> (int8 codes like x, clip mask or None, per-row code sums int32 (rows,) or None).

        r = nearbyint(x * float32(1/s)) + z; q = clamp(r, qmin, qmax); mask = (qmin <= r <= qmax)."""
        r = x.to(torch.float32) * torch.reciprocal(_row_scale(scale, x, per_row))
        r.round_()  # round half to even, like nearbyint
        if isinstance(zero_point, Tensor):  # traced: the zero point is data, not a constant
            r.add_(zero_point.to(torch.float32))
        elif zero_point:
            r.add_(float(zero_point))
        clamped = r.clamp(qmin, qmax)
        q = clamped.to(torch.int8)
        mask = clamped == r if need_mask else None
        rowsum = None
        if need_rowsum:  # exact in fp32: every partial sum is an integer below 128 K <= 2^24
            rowsum = q.flatten(1).to(torch.float32).sum(dim=1).to(torch.int32)  # (flatten: 0 rows too)
        return q, mask, rowsum

    def quantize_rows_dynamic(self, x, qmin, qmax, eps, need_rowsum=False):
        """x (M, K) -> (codes, s (M, 1) = max(max|x[m]| / qmax, eps), rowsum or None); z = 0."""
        from intqat.ops.qparams import row_absmax

        s = torch.clamp(row_absmax(x, keepdim=True) / qmax, min=eps)
        q, _, rowsum = self.quantize_rows(x, s.reshape(-1), 0.0, qmin, qmax, True, need_rowsum=need_rowsum)
        return q, s, rowsum

    def fake_quantize_rows(self, x, scale, zero_point, qmin, qmax, per_row, need_mask=False):
        q, mask, _ = self.quantize_rows(x, scale, zero_point, qmin, qmax, per_row, need_mask=need_mask)
        # a NaN goes on to the output, as the fused pass gives (an int8 code cannot hold it: its cast is 0, a
        # finite -z*s that would hide a diverged batch from the loss under torch.compile)
        x_hat = self.dequantize_rows(q, scale, zero_point, per_row)
        return torch.where(torch.isnan(x), x.to(torch.float32), x_hat), mask

    def dequantize_rows(self, q, scale, zero_point, per_row, out=None, scratch=None):
        """(float(q) - z) * s; scale None: float(q) - z. (q - z) is an exact small integer: one rounding.

        out: a tensor to write into; scratch: a role name under which an eager backend may reuse a
        buffer for a result that dies within the op (the reference makes a fresh tensor)."""
        y = q.to(torch.float32)
        if isinstance(zero_point, Tensor):
            y = y - zero_point.to(torch.float32)
        elif zero_point:
            y = y - float(zero_point)
        if scale is not None:
            y = y * _row_scale(scale, q, per_row)
        return y if out is None else out.copy_(y)

    def mask_zero_packed_(self, g, packed):
        """where(unpack_mask(packed, g.shape), g, 0): the mask from its bits (masks.py), a new tensor."""

        return torch.where(unpack_mask_torch(packed, g.shape), g, 0.0)

    def minmax(self, x):
        """(min, max) of a non-empty tensor as Python floats (NaN if it holds a NaN): the observer's reduction."""
        lo, hi = torch.aminmax(x)
        return float(lo), float(hi)

    def pack_mask(self, mask):

        return pack_mask_torch(mask)

    def unpack_mask(self, packed, shape):

        return unpack_mask_torch(packed, shape)

    # --- the depthwise conv's STE backward ------------------------------------------------------

    def depthwise_grad(self, g, q_x, z_x, s_x, q_w, s_w, stride, padding, dilation, need_x, need_w, need_b):
        """(grad of x_hat, grad of w_hat, grad_b) of a depthwise conv (groups == C == O), unmasked, each None where not
        asked: aten.convolution_backward on x_hat = (q_x - z_x) s_x and w_hat = q_w s_w[c]. g (B, C, Ho, Wo) fp32,
        q_x (B, C, H, W) and q_w (C, 1, kh, kw) int8, z_x and s_x one value each (tensors), s_w (C,).

        The one primitive whose backends agree within fp32 rounding, not bit for bit: its sums are fp32 and their
        order is each implementation's (oneDNN's here, which also differs between CPUs; cpu_fused's a fixed order:
        kernels/cpu/depthwise_backward.c). tests/test_depthwise_backward.py bounds both against a float64 sum."""
        C = q_w.shape[0]
        x_hat = self.dequantize_rows(q_x, s_x.reshape(()), z_x.reshape(()), False)
        w_hat = q_w.to(torch.float32) * s_w.reshape(-1, 1, 1, 1).to(torch.float32)  # dequantize's (q - 0) * s
        gx, gw, gb = torch.ops.aten.convolution_backward(g, x_hat, w_hat, [C] if need_b else None, stride, padding,
                                                         dilation, False, [0, 0], C, [need_x, need_w, need_b])
        return gx if need_x else None, gw if need_w else None, gb if need_b else None
