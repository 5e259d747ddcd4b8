"""The AMX backend (Intel Xeon with AMX-INT8, Linux): the GEMMs on AMX tiles.

- linear: kernels/cpu/amx_linear.c, each 32x32 block of q_x @ q_wᵀ accumulated in tiles and put
  through the fused epilogue's row function: the int32 accumulator never reaches memory, same bits.
- digit_matmul: kernels/cpu/amx_digits.c, the three digit planes accumulated in tiles and combined
  before anything leaves L1.
- linear_grouped: kernels/cpu/amx_grouped.c, the per-group (8da4w) forward: one tile step per group, each
  group's int32 tile scaled and added in fp32 in group order, as the VNNI kernel does: same bits.
Everything else (the elementwise passes, int_mm) is cpu_fused's.
"""

from __future__ import annotations

from intqat.ops import cpu_kernels
from intqat.ops.backends.cpu_fused import CpuFused, digit_gemm_slow
from intqat.ops.cpu_features import cpu_has_int8_dot
from intqat.ops.backends.reference import MAX_K_INT32

__all__ = ["Amx", "amx_forward_pays", "AMX_FORWARD_MIN_MACS", "AMX_FORWARD_SMALL_MIN", "AMX_DIGITS_MIN_M",
           "AMX_DIGITS_MIN_MACS", "AMX_GROUPED_MIN_M"]

# The fused AMX forward against torch._int_mm + the epilogue, both on the AMX units. Measured on a 2-core AMX Xeon
# (4th gen), 2026-11-23: 0.66x-0.80x from M*N*K = 2^24 while M <= N (256x1024x1024: 0.19 vs 0.23 ms;
# 256x4096x4096: 2.5 vs 3.9 ms); 1.0x-1.5x when the activations outnumber the weights (each thread keeps its half
# of the packed weight in its L2 and reads all of q_x) or the layer is small (N = 10: 1.15x). Both sides run on
# the same units, so the ratio is a property of the kernels, not of one machine's clock.
AMX_FORWARD_MIN_MACS = 2**24
# Small layers (M*N*K <= 2^24: a BERT-tiny block's, whose operands sit in L2), measured 2026-11-28 on the same class
# (Xeon, AMX-INT8, 2 cores; the C++ step's whole forward, interleaved): the fused kernel skips the int32
# accumulator's write and read and oneDNN's per-call setup, 0.64x-0.91x of _int_mm + epilogue at 1 and 2 threads
# for 256x128x{128,384,512} and 256x512x128 (M > N included). Taken from M, N >= 128 (four 32-row / column
# blocks): a few tokens or a narrow head (8x128x10: 1.05x) keep _int_mm.
AMX_FORWARD_SMALL_MIN = 128
# The AMX digit GEMM (both backward GEMMs) against the fp32 GEMM, same Xeon: from M >= 128 and M*N*K >= 2^26
# (M = 256, K = N = 1024: grad_w 0.51x, grad_x 0.42x); a batch of 32 was 1.2x-2.3x slower (its output write dominates).
AMX_DIGITS_MIN_M = 128
AMX_DIGITS_MIN_MACS = 2**26
# The AMX per-group forward against the VNNI kernel (cpu_fused), same Xeon, group 32: 0.54x-0.60x at the Llama
# block's layers (1 thread; 128 x 256 x 768: 0.077 vs 0.136 ms; 0.59x-0.71x at 2 threads), 0.75x at M = 16 (a tile's
# rows); 1.2x-1.8x below (M = 4: 12 of a tile's 16 rows are padding).
AMX_GROUPED_MIN_M = 16


def amx_forward_pays(M: int, K: int, N: int) -> bool:
    """Is the fused AMX forward faster than torch._int_mm + the epilogue? Large layers: AMX_FORWARD_MIN_MACS, M <= N;
    small ones: M * N * K <= AMX_FORWARD_MIN_MACS with M, N >= AMX_FORWARD_SMALL_MIN."""
    macs = M * N * K
    return (M <= N and macs >= AMX_FORWARD_MIN_MACS) or (
        macs <= AMX_FORWARD_MIN_MACS and M >= AMX_FORWARD_SMALL_MIN and N >= AMX_FORWARD_SMALL_MIN)


class Amx(CpuFused):
    name = "amx"
    needs = "AMX-INT8 (Intel Xeon 4th gen+) under Linux, and the fused C kernels"
    primitives = frozenset({"linear", "digit_matmul", "linear_grouped"})
    on_int_mm = frozenset()  # its own tile kernels: torch._int_mm's self-check does not concern them

    def unavailable(self):
        if not cpu_has_int8_dot():
            return "no int8 dot-product units (or INTQAT_EMULATE_NO_INT8_DOT)"
        return super().unavailable() or (None if cpu_kernels.amx_available() else
                                         "this CPU (or kernel) has no AMX-INT8 tiles")

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        reason = super().refuse(primitive, tensors, shape, traced, spec)  # (with the layouts cpu_fused refuses)
        if reason is not None:
            return reason
        if not cpu_kernels.amx_available() or not cpu_has_int8_dot():
            return "no AMX-INT8 tiles"
        # (no tensors: a run-time question, `select(..., at_run_time=True)`, decided from the shape alone)
        if primitive == "linear":
            if shape is not None and not 0 < shape[1] <= MAX_K_INT32:
                return "K outside (0, MAX_K_INT32]"
            if tensors and not (tensors[0].is_contiguous() and tensors[1].is_contiguous()):
                return "needs row-major codes"
        if primitive == "linear_grouped" and not cpu_kernels.amx_grouped_available():
            return "the per-group AMX kernel is not in this build"
        return None

    def slow(self, primitive, shape, spec=None):
        if primitive == "linear" and shape is not None and not amx_forward_pays(*shape):
            return "layer outside the shapes where the fused AMX forward measured faster than _int_mm + epilogue"
        if primitive == "linear_grouped" and shape is not None and shape[0] < AMX_GROUPED_MIN_M:
            return "M < 16 (AMX_GROUPED_MIN_M): most of a tile's rows are padding; the VNNI kernel measured faster"
        if primitive == "digit_matmul" and shape is not None:
            M, K, N = shape
            reason = digit_gemm_slow(M, K, N)
            if reason is None and not (M >= AMX_DIGITS_MIN_M and M * N * K >= AMX_DIGITS_MIN_MACS):
                reason = "M < 128 or M*N*K < 2^26 (AMX_DIGITS_*: measured on a 4th-gen Xeon)"
            return reason
        return None

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.amx_linear(q_x, q_w, z, None if z_x is None else colsum, s_x, s_w, bias)

    def digit_matmul(self, a, col_scale, q, z, mask):
        return cpu_kernels.amx_digit_matmul(a, col_scale, q, z, mask)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.grouped_linear(q_x, q_w, s_w, z, s_x, bias, fp32_codes=False, amx=True)
