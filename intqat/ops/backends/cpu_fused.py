"""The CPU backend for CPUs with int8 dot-product units: torch._int_mm for the integer GEMMs, the
fused C kernels (kernels/cpu/fused.c, `intqat.ops.cpu_kernels`) for every elementwise pass.

The C kernels do the reference's float32 operations in the same order (no FMA contraction, round
half to even), so they return the same bits; they run on plain CPU tensors outside of tracing.
torch._int_mm is fast only where the CPU has int8 dot products (AMX, AVX512-VNNI, AVX-VNNI, Arm
SDOT / I8MM): elsewhere it is a scalar loop (~50x slower than an fp32 GEMM), so this backend
calls itself slow for the integer GEMMs there and `avx2_int16` / `fp32_exact` take them. Where torch._int_mm
failed its self-check (self_check.py: e.g. ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU) it refuses them, with that reason.
"""

from __future__ import annotations

import torch

from intqat.ops import cpu_kernels
from intqat.ops.cpu_features import cpu_has_int8_dot
from intqat.ops.backends import self_check
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.backends.reference import MAX_K_INT32, Reference, is_dense

__all__ = ["CpuFused"]

_GEMMS = frozenset({"int_mm", "linear", "digit_matmul", "linear_grouped"})


class CpuFused(Backend):
    name = "cpu_fused"
    needs = "a C compiler (kernels built on first use); integer GEMMs: int8 dot-product units (torch._int_mm)"
    primitives = Reference.primitives  # every one: the GEMMs through torch._int_mm, the passes in C
    on_int_mm = frozenset({"int_mm", "linear", "digit_matmul"})  # the primitives it runs on torch._int_mm

    def unavailable(self):
        if not cpu_kernels.available():
            return "the fused C kernels are not built (no C compiler, or INTQAT_CPU_KERNELS=0)"
        return None

    def refuse(self, primitive, tensors, shape, traced):
        if traced:
            return "not while tracing"
        if not cpu_kernels.available():
            return "the fused C kernels are off"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if primitive in self.on_int_mm:
            return self_check.untrusted("torch._int_mm")
        return None

    def slow(self, primitive, shape):
        if primitive in _GEMMS and not cpu_has_int8_dot():
            return "no int8 dot-product units: torch._int_mm is a scalar loop on this CPU (~50x an fp32 GEMM)"
        return None

    # --- integer GEMMs -------------------------------------------------------------------------

    def int_mm(self, a, b):
        if 0 < a.shape[1] <= MAX_K_INT32 and a.shape[0] and b.shape[1] and is_dense(a) and is_dense(b):
            return torch._int_mm(a, b)
        return Reference.int_mm(self, a, b)

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        M, K = q_x.shape
        N = q_w.shape[0]
        if 0 < K <= MAX_K_INT32 and M and N and is_dense(q_x) and is_dense(q_w.t()):
            # the int32 accumulator dies in the epilogue: this thread's scratch buffer, no page faults.
            # (q_wᵀ of a K = 1 layer is a (1, N) view with strides (1, 1), which torch._int_mm gets wrong:
            # is_dense sends it to the reference's row-major copy)
            acc = torch._int_mm(q_x, q_w.t(), out=cpu_kernels.scratch("acc", (M, N), torch.int32))
        else:
            acc = Reference.int_mm(self, q_x, q_w.t())
        return self.epilogue(acc, z_x, colsum, s_x, s_w, bias)

    def digit_matmul(self, a, col_scale, q, z, mask):
        """Split and combine in C; the three planes stacked into one torch._int_mm call."""
        R, C = a.shape
        K = q.shape[1]
        if not q.is_contiguous():
            return Reference.digit_matmul(self, a, col_scale, q, z, mask)
        digits = cpu_kernels.scratch("digits", (3, R, C), torch.int8)
        digits, shift, rowsum = cpu_kernels.split_digits(a, col_scale, need_rowsum=bool(z), digits=digits)
        acc = torch._int_mm(digits.view(3 * R, C), q, out=cpu_kernels.scratch("digit_acc", (3 * R, K), torch.int32))
        return cpu_kernels.combine_digits(acc, shift, rowsum, z, mask)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """kernels/cpu/grouped_linear.c: each group's int32 sum in VNNI registers, scaled in the K loop."""
        gs = q_x.shape[1] // s_w.shape[1]
        if not cpu_kernels.grouped_vnni_available() or gs % 4 or s_x.numel() not in (1, q_x.shape[0]):
            return Reference.linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias)
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=False)

    # --- elementwise passes --------------------------------------------------------------------

    def epilogue(self, acc, z_x, colsum, s_x, s_w, bias):
        if acc.dim() != 2 or s_x.numel() not in (1, acc.shape[0]):
            return Reference.epilogue(self, acc, z_x, colsum, s_x, s_w, bias)
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.epilogue(acc, z, None if z_x is None else colsum, s_x, s_w, bias)

    def quantize_rows(self, x, scale, zero_point, qmin, qmax, per_row, need_mask=False, need_rowsum=False):
        return cpu_kernels.quantize_rows(x, scale, float(zero_point), qmin, qmax, per_row, need_mask=need_mask,
                                         need_rowsum=need_rowsum)

    def quantize_rows_dynamic(self, x, qmin, qmax, eps, need_rowsum=False):
        return cpu_kernels.quantize_rows_dynamic(x, qmin, qmax, eps, need_rowsum=need_rowsum)

    def fake_quantize_rows(self, x, scale, zero_point, qmin, qmax, per_row, need_mask=False):
        return cpu_kernels.fake_quantize_rows(x, scale, float(zero_point), qmin, qmax, per_row, need_mask=need_mask)

    def dequantize_rows(self, q, scale, zero_point, per_row, out=None, scratch=None):
        if out is None and scratch is not None:  # reused per role: no page faults on a fresh multi-MB tensor
            out = cpu_kernels.scratch(scratch, tuple(q.shape), torch.float32)
        return cpu_kernels.dequantize_rows(q, scale, float(zero_point), per_row, out=out)

    def mask_zero_packed_(self, g, packed):
        return cpu_kernels.mask_zero_bits_(g, packed)

    def minmax(self, x):
        return cpu_kernels.minmax(x)

    def pack_mask(self, mask):
        return cpu_kernels.pack_bits(mask)

    def unpack_mask(self, packed, shape):
        return cpu_kernels.unpack_bits(packed, shape)
