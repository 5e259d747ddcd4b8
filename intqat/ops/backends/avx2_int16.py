"""Exact int8 GEMMs through AVX2's int16 multiply-add (kernels/cpu/int16_gemm.c): the first choice
on x86 CPUs without int8 dot-product instructions (AVX2-only: AMD Zen 2 / Zen 3, Intel before
Cascade Lake / Ice Lake).

The linear forward runs GEMM and epilogue in one pass (each 6x16 block of sums goes through the fused
epilogue's row function before it leaves L1). vpmaddwd does 16 int16 multiply-adds per instruction against an fp32 FMA's 8, exactly (int8 codes
widened to int16; |a b| <= 2^14 and a pair sum <= 2^15 never saturate), with int32 accumulators:
the same sums as torch._int_mm, bit for bit. Codes are widened and packed per call (the weights
change every step). The elementwise passes stay cpu_fused's; fp32_exact is the fallback where the
library was built without AVX2.
"""

from __future__ import annotations

from intqat.ops import cpu_kernels
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.backends.reference import MAX_K_INT32, Reference, split_k

__all__ = ["Avx2Int16"]


class Avx2Int16(Backend):
    name = "avx2_int16"
    needs = "x86 AVX2 and the fused C kernels (chosen where the CPU has no int8 dot-product units)"
    primitives = frozenset({"int_mm", "linear", "linear_grouped"})

    def unavailable(self):
        if not cpu_kernels.available():
            return "the fused C kernels are not built (no C compiler, or INTQAT_CPU_KERNELS=0)"
        return None if cpu_kernels.int16_gemm_available() else "the kernels were built without AVX2"

    def refuse(self, primitive, tensors, shape, traced):
        if traced:
            return "not while tracing"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if not cpu_kernels.int16_gemm_available():
            return "no AVX2 build of the kernels"
        return None

    def int_mm(self, a, b):
        M, K = a.shape
        if K > MAX_K_INT32:
            return split_k(a, b, MAX_K_INT32, cpu_kernels.int16_gemm)
        return cpu_kernels.int16_gemm(a, b)

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        """The GEMM and the epilogue in one pass (intqat_int16_linear), as the AMX forward does."""
        K = q_x.shape[1]
        if not (0 < K <= MAX_K_INT32 and q_x.is_contiguous() and q_w.is_contiguous()
                and s_x.numel() in (1, q_x.shape[0])):
            return Reference.linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias)
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.int16_linear(q_x, q_w, z, None if z_x is None else colsum, s_x, s_w, bias)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """Each group's exact int32 sum on vpmaddwd, scaled and added in the K loop (kernels/cpu/int16_gemm.c);
        odd group sizes (not whole pairs of k): grouped_linear.c's exact fp32 multiply-adds of the codes."""
        if s_x.numel() not in (1, q_x.shape[0]):
            return Reference.linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias)
        z = 0 if z_x is None else int(z_x.reshape(()))
        if (q_x.shape[1] // s_w.shape[1]) % 2 == 0:
            return cpu_kernels.int16_linear_grouped(q_x, q_w, s_w, z, s_x, bias)
        return cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=True)
