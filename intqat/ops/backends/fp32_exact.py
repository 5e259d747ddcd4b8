"""Exact int8 GEMMs on fp32 units: the backend for CPUs without int8 dot-product instructions.

Why it is exact (docs/numerics.md, "Exact int8 products on fp32 units"): each product of int8 codes is an integer with
|q_a q_b| <= 128 * 128 = 2^14, so a partial sum of n products is an integer of magnitude <= n 2^14.
Every integer of magnitude <= 2^24 is an fp32 value, and adding two fp32 integers whose exact sum is
an integer of magnitude <= 2^24 rounds to that integer. So an fp32 GEMM over a K-slice of length
<= 2^24 / 2^14 = 1024 returns the exact integer sum, whatever its blocking, summation order or FMA
use. Longer K is cut into slices of 1024 whose exact results are added in int32 (int64 past int32's
own bound, MAX_K_INT32). The result equals the reference's exact sums bit for bit (tests/test_backends.py);
the fp32 GEMM it runs on is checked once per process before it is used (self_check.py, "fp32 mm").

Where torch._int_mm is a scalar loop (AVX2-only x86, e.g. AMD Zen 2/3; measured ~50x slower than
torch.mm there) this runs the integer GEMMs at the speed of the fp32 GEMM plus the int8 -> fp32
conversion passes. It needs nothing but fp32, so it runs, and is tested, on every CPU.
"""

from __future__ import annotations

import torch

from intqat.ops import cpu_kernels
from intqat.ops.backends import self_check
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.backends.exact import EXACT_K, MAX_K_INT32, fp32_slice, fp32_slices_mm, int_mm_via_fp32
from intqat.ops.backends.reference import Reference

__all__ = ["Fp32Exact", "EXACT_K", "int_mm_via_fp32"]

_GEMMS = frozenset({"int_mm", "linear", "digit_matmul"})  # through torch.mm in fp32 (linear_grouped: its C kernel)


class Fp32Exact(Backend):
    name = "fp32_exact"
    needs = "fp32 only (the fallback without int8 dot products and without the AVX2 kernel)"
    # digit_matmul: exact (three fp32 GEMMs of the digit planes) but three times an fp32 GEMM's work:
    # `slow` says so at every shape, so on this class the STE backward keeps its fp32 GEMMs
    primitives = frozenset({"int_mm", "linear", "digit_matmul", "linear_grouped"})

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        if traced:
            return "not while tracing (exported programs keep aten._int_mm; see intqat.export for AOTInductor)"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if primitive in _GEMMS:
            return self_check.untrusted("fp32 mm")
        if primitive == "linear_grouped":  # (q_x, q_w, s_w, s_x, ...): grouped_linear.c's fp32 kernel
            if not cpu_kernels.available():
                return "the fused C kernels are off (its per-group kernel is one of them)"
            if tensors and tensors[3].numel() not in (1, tensors[0].shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        return None

    def slow(self, primitive, shape, spec=None):
        if primitive == "digit_matmul" and shape is not None:
            return "three fp32 GEMMs of the digit planes: never faster than the one fp32 backward GEMM"
        return None

    def int_mm(self, a, b):
        M, K = a.shape
        N = b.shape[1]
        if M == 0 or N == 0 or K == 0:
            return torch.zeros(M, N, dtype=torch.int32)
        if K > MAX_K_INT32:
            return fp32_slices_mm(a, b)  # (the slices added in int64, the result checked to fit int32)
        acc = fp32_slice(a[:, :EXACT_K], b[:EXACT_K])
        for k0 in range(EXACT_K, K, EXACT_K):  # each slice exact; their int32 sum cannot overflow (K <= MAX_K_INT32)
            acc += fp32_slice(a[:, k0 : k0 + EXACT_K], b[k0 : k0 + EXACT_K])
        return acc
    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        return Reference.linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias)

    def digit_matmul(self, a, col_scale, q, z, mask):
        return Reference.digit_matmul(self, a, col_scale, q, z, mask)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """kernels/cpu/grouped_linear.c's exact fp32 multiply-adds of the codes (each group's sum an integer
        <= group_size * 2^14 <= 2^24), scaled in the K loop."""
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=True)
