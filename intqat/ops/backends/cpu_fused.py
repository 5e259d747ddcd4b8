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
from intqat.ops.cpu_features import cpu_has_int8_dot, int8_gemm_outpaces_fp32_8x
from intqat.ops.backends import self_check
from intqat.ops.backends.base import Backend, plain_cpu
from intqat.ops.backends.reference import MAX_K_INT32, Reference, dense_layout, is_dense, split_k

__all__ = ["CpuFused", "digit_gemm_slow", "DIGITS_MIN_MACS", "DIGITS_8X_GRAD_W_MIN_M", "DIGITS_8X_GRAD_W_MAX_M_PER_NK",
           "DIGITS_4X_MIN_N", "DIGITS_4X_MIN_MACS"]

_GEMMS = frozenset({"int_mm", "linear", "digit_matmul", "linear_grouped"})

# --- When the backward GEMM pays as three int8 digit GEMMs (digit_gemm.py) against one fp32 GEMM -------------
# Each rule is a ratio of two kernels on the same CPU, measured on the class named; `slow("digit_matmul")` applies
# it by the CPU's capabilities (cpu_features), never by this machine's clock. Shapes are the layer's (M, K, N):
# grad_x = (M, N) @ (N, K), grad_w = (N, M) @ (M, K).
DIGITS_MIN_MACS = 2**21  # below M*N*K = 2^21 no backend's digit GEMM paid: the split and the combine dominate
# CPUs whose int8 GEMM runs ~8x torch's fp32 GEMM (int8_gemm_outpaces_fp32_8x: AMD Zen 5 with AVX-512 VNNI; MKL's
# fp32 GEMM takes its AVX2 path there). Measured on an EPYC Zen 5, 1 thread, the fp32 side with its dequantize
# pass: grad_x 0.42x-0.87x of fp32 from 128^3 up; grad_w likewise, for 64 <= M <= 2 max(N, K) only: its
# contraction is the batch, and a long one (M = 1024, N = K = 128: 1.19x) or a short one (M = 32: 1.08x) spent
# more on the split than it saved.
DIGITS_8X_GRAD_W_MIN_M = 64
DIGITS_8X_GRAD_W_MAX_M_PER_NK = 2
# Other CPUs with int8 dot units (int8 ~4x fp32: Intel AVX-512 VNNI / AVX-VNNI, AMD Zen 4, Arm dot product):
# grad_x only, from N >= 512 and M*N*K >= 2^24 (0.54x-0.78x of fp32 at M = 256), measured through torch._int_mm on
# a 2-core 4th-gen Xeon; grad_w's 3x larger int32 output made it slower than fp32 there.
DIGITS_4X_MIN_N = 512
DIGITS_4X_MIN_MACS = 2**24


def digit_gemm_slow(M: int, K: int, N: int) -> str | None:
    """Why no backend's digit GEMM pays for a layer (M, K, N) (None: it may): shared by the digit backends."""
    if max(M, K, N) > MAX_K_INT32:
        return "a dimension past MAX_K_INT32: the int32 digit sums could overflow"
    if M * N * K < DIGITS_MIN_MACS:
        return "M*N*K < 2^21 (DIGITS_MIN_MACS): the split and the combine cost more than they save"
    return None


class CpuFused(Backend):
    name = "cpu_fused"
    needs = "a C compiler (kernels built on first use); integer GEMMs: int8 dot-product units (torch._int_mm)"
    # every primitive of the reference but the whole training steps: the GEMMs through torch._int_mm (the
    # per-group one through its VNNI kernel), the passes in C
    primitives = Reference.primitives - {"linear_step", "conv_step", "grouped_step"}
    on_int_mm = frozenset({"int_mm", "linear", "digit_matmul"})  # the primitives it runs on torch._int_mm

    def unavailable(self):
        if not cpu_kernels.available():
            return "the fused C kernels are not built (no C compiler, or INTQAT_CPU_KERNELS=0)"
        return None

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        if traced:
            return "not while tracing"
        if not cpu_kernels.available():
            return "the fused C kernels are off"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        if primitive in self.on_int_mm:
            reason = self_check.untrusted("torch._int_mm")
            if reason is not None:
                return reason
        if tensors:
            return self._layout_refusal(primitive, tensors)
        return None

    def _layout_refusal(self, primitive, tensors) -> str | None:
        """What the kernels cannot take, from the call's tensors (as each primitive's caller passes them)."""
        if primitive == "linear" and len(tensors) > 2:  # (q_x, q_w, s_x, ...): its fused epilogue's s_x
            q_x, s_x = tensors[0], tensors[2]
            if s_x is not None and s_x.numel() not in (1, q_x.shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        elif primitive == "epilogue":  # (acc, s_x, s_w, bias)
            acc, s_x = tensors[0], tensors[1]
            if acc.dim() != 2 or s_x.numel() not in (1, acc.shape[0]):
                return "acc is not (M, N) with s_x per tensor or per row"
        elif primitive == "digit_matmul":  # (a, col_scale, q, mask)
            a, q = tensors[0], tensors[2]
            if not q.is_contiguous():
                return "needs row-major codes q"
            if a.shape[1] > MAX_K_INT32 or not (a.shape[0] and a.shape[1] and q.shape[1]):
                return "an empty product, or a contraction past MAX_K_INT32 (the definition's fp32 GEMM)"
        elif primitive == "linear_grouped":  # (q_x, q_w, s_w, s_x, ...)
            q_x, s_w, s_x = tensors[0], tensors[2], tensors[3]
            if not cpu_kernels.grouped_vnni_available():
                return "the kernels were built without AVX512-VNNI (the per-group kernel's)"
            if (q_x.shape[1] // max(s_w.shape[1], 1)) % 4:
                return "a group size not a multiple of 4 (VNNI sums 4 codes at a time)"
            if s_x.numel() not in (1, q_x.shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        return None

    def slow(self, primitive, shape, spec=None):
        if primitive in _GEMMS and not cpu_has_int8_dot():
            return "no int8 dot-product units: torch._int_mm is a scalar loop on this CPU (~50x an fp32 GEMM)"
        if primitive == "digit_matmul" and shape is not None:
            return self._digits_slow(*shape, spec)
        return None

    @staticmethod
    def _digits_slow(M: int, K: int, N: int, grad: str) -> str | None:
        """The digit backward through torch._int_mm, by CPU class (the constants above)."""
        reason = digit_gemm_slow(M, K, N)
        if reason is not None:
            return reason
        if int8_gemm_outpaces_fp32_8x():
            if grad == "x" or DIGITS_8X_GRAD_W_MIN_M <= M <= DIGITS_8X_GRAD_W_MAX_M_PER_NK * max(N, K):
                return None
            return "grad_w with M outside [64, 2 max(N, K)] (int8 ~8x fp32 class: AMD Zen 5)"
        if grad == "x" and N >= DIGITS_4X_MIN_N and M * N * K >= DIGITS_4X_MIN_MACS:
            return None
        return ("int8 ~4x fp32 class: only grad_x from N >= 512 and M*N*K >= 2^24 (measured on a 4th-gen Xeon "
                "through torch._int_mm)")

    # --- integer GEMMs: torch._int_mm (its own preparation: a row-major copy of a layout it multiplies wrongly,
    # int64 sums of K chunks past int32's bound, zeros for an empty product) ----------------------------------

    def int_mm(self, a, b):
        M, K = a.shape
        N = b.shape[1]
        if not (M and K and N):
            return torch.zeros(M, N, dtype=torch.int32)  # (torch._int_mm leaves K = 0 uninitialised on some builds)
        if K > MAX_K_INT32:
            return split_k(a, b, MAX_K_INT32, lambda x, y: torch._int_mm(dense_layout(x), dense_layout(y)))
        return torch._int_mm(dense_layout(a), dense_layout(b))

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        M, K = q_x.shape
        N = q_w.shape[0]
        if 0 < K <= MAX_K_INT32 and M and N and is_dense(q_x) and is_dense(q_w.t()):
            # the int32 accumulator dies in the epilogue: this thread's scratch buffer, no page faults.
            # (q_wᵀ of a K = 1 layer is a (1, N) view with strides (1, 1), which torch._int_mm gets wrong:
            # is_dense sends it through int_mm's row-major copy)
            acc = torch._int_mm(q_x, q_w.t(), out=cpu_kernels.scratch("acc", (M, N), torch.int32))
        else:
            acc = self.int_mm(q_x, q_w.t())
        return self.epilogue(acc, z_x, colsum, s_x, s_w, bias)

    def digit_matmul(self, a, col_scale, q, z, mask):
        """Split and combine in C; the three planes stacked into one torch._int_mm call."""
        R, C = a.shape
        K = q.shape[1]
        digits = cpu_kernels.scratch("digits", (3, R, C), torch.int8)
        digits, shift, rowsum = cpu_kernels.split_digits(a, col_scale, need_rowsum=bool(z), digits=digits)
        acc = torch._int_mm(digits.view(3 * R, C), q, out=cpu_kernels.scratch("digit_acc", (3 * R, K), torch.int32))
        return cpu_kernels.combine_digits(acc, shift, rowsum, z, mask)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        """kernels/cpu/grouped_linear.c: each group's int32 sum in VNNI registers, scaled in the K loop."""
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=False)

    # --- elementwise passes --------------------------------------------------------------------

    def epilogue(self, acc, z_x, colsum, s_x, s_w, bias):
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

    # --- the depthwise conv's STE backward: channel blocks in C (depthwise_backward.c), fp32 sums in a fixed order --

    def depthwise_grad(self, g, q_x, z_x, s_x, q_w, s_w, stride, padding, dilation, need_x, need_w, need_b):
        return cpu_kernels.depthwise_backward(g, q_x, int(z_x.reshape(())), float(s_x.reshape(())), q_w, s_w, stride,
                                              padding, dilation, need_x, need_w, need_b)
