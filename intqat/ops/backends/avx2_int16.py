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
from intqat.ops.backends.reference import MAX_K_INT32, split_k

__all__ = ["Avx2Int16"]


class Avx2Int16(Backend):
    name = "avx2_int16"
    needs = "x86 AVX2 and the fused C kernels (chosen where the CPU has no int8 dot-product units)"
    primitives = frozenset({"int_mm", "linear", "linear_grouped"})

    def unavailable(self):
        if not cpu_kernels.available():
            return "the fused C kernels are not built (no C compiler, or INTQAT_CPU_KERNELS=0)"
        return None if cpu_kernels.int16_gemm_available() else "the kernels were built without AVX2"

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        if traced:
            return "not while tracing"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if not cpu_kernels.int16_gemm_available():
            return "no AVX2 build of the kernels"
        if primitive == "int_mm" and tensors and not (tensors[0].shape[0] and tensors[0].shape[1]
                                                      and tensors[1].shape[1]):
            return "an empty product (M, K or N is 0)"
        if primitive == "linear":  # (q_x, q_w, s_x, ...)
            if shape is not None and not (0 < shape[1] <= MAX_K_INT32 and shape[0] and shape[2]):
                return "an empty layer, or K past MAX_K_INT32"
            if tensors and not (tensors[0].is_contiguous() and tensors[1].is_contiguous()):
                return "needs row-major codes"
            if len(tensors) > 2 and tensors[2] is not None and tensors[2].numel() not in (1, tensors[0].shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        if primitive == "linear_grouped" and tensors:  # (q_x, q_w, s_w, s_x, ...)
            q_x, s_w, s_x = tensors[0], tensors[2], tensors[3]
            if (q_x.shape[1] // max(s_w.shape[1], 1)) % 2:
                return "an odd group size (vpmaddwd takes pairs of k): fp32_exact's kernel takes it"
            if s_x.numel() not in (1, q_x.shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        return None

    def int_mm(self, a, b):
        M, K = a.shape
        if K > MAX_K_INT32:
            return split_k(a, b, MAX_K_INT32, cpu_kernels.int16_gemm)
        return cpu_kernels.int16_gemm(a, b)

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        """The GEMM and the epilogue in one pass (intqat_int16_linear), as the AMX forward does."""
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.int16_linear(q_x, q_w, z, None if z_x is None else colsum, s_x, s_w, bias)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """Each group's exact int32 sum on vpmaddwd, scaled and added in the K loop (kernels/cpu/int16_gemm.c)."""
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.int16_linear_grouped(q_x, q_w, s_w, z, s_x, bias)
