"""The AMX backend (Intel Xeon with AMX-INT8, Linux): the GEMMs on AMX tiles.

- linear: kernels/cpu/amx_linear.c, each 32x32 block of q_x @ q_wᵀ accumulated in tiles and put
  through the fused epilogue's row function: the int32 accumulator never reaches memory, same bits.
- digit_matmul: kernels/cpu/amx_digits.c, the three digit planes accumulated in tiles and combined
  before anything leaves L1.
Everything else (the elementwise passes, int_mm) is cpu_fused's.
"""

from __future__ import annotations

from intqat.ops import cpu_kernels
from intqat.ops.backends.cpu_fused import CpuFused
from intqat.ops.cpu_features import cpu_has_int8_dot
from intqat.ops.backends.reference import MAX_K_INT32

__all__ = ["Amx", "amx_forward_pays"]


def amx_forward_pays(M: int, K: int, N: int) -> bool:
    """Is the fused AMX forward faster than torch._int_mm + the epilogue (both on the AMX units)?

    Measured on a 2-core AMX Xeon, 2026-11-23: 0.66x-0.80x of _int_mm + epilogue from M*N*K = 2^24
    while M <= N (256x1024x1024: 0.19 vs 0.23 ms; 256x4096x4096: 2.5 vs 3.9 ms), 1.0x-1.5x when
    the activations outnumber the weights (each thread keeps its half of the packed weight in its
    L2 and reads all of q_x) or the layer is small (N = 10: 1.15x). Both sides run on the same
    units, so the ratio is a property of the kernels, not of one machine's clock.
    """
    return M <= N and M * N * K >= 2**24


class Amx(CpuFused):
    name = "amx"
    needs = "AMX-INT8 (Intel Xeon 4th gen+) under Linux, and the fused C kernels"
    primitives = frozenset({"linear", "digit_matmul"})
    on_int_mm = frozenset()  # its own tile kernels: torch._int_mm's self-check does not concern them

    def unavailable(self):
        if not cpu_has_int8_dot():
            return "no int8 dot-product units (or INTQAT_EMULATE_NO_INT8_DOT)"
        return super().unavailable() or (None if cpu_kernels.amx_available() else
                                         "this CPU (or kernel) has no AMX-INT8 tiles")

    def refuse(self, primitive, tensors, shape, traced):
        reason = super().refuse(primitive, tensors, shape, traced)
        if reason is not None:
            return reason
        if not cpu_kernels.amx_available() or not cpu_has_int8_dot():
            return "no AMX-INT8 tiles"
        # (no tensors: a run-time question, `select(..., at_run_time=True)`, decided from the shape alone)
        if primitive == "linear":
            if shape is not None and not 0 < shape[1] <= MAX_K_INT32:
                return "K outside (0, MAX_K_INT32]"
            if not tensors:
                return None
            q_x, q_w = tensors[0], tensors[1]
            if not (q_x.is_contiguous() and q_w.is_contiguous()):
                return "needs row-major codes"
            s_x = tensors[2] if len(tensors) > 2 else None  # (integer_linear passes q_x, q_w, s_x, ...)
            if s_x is not None and s_x.numel() not in (1, q_x.shape[0]):
                return "s_x is neither per tensor nor per row of q_x"
        elif primitive == "digit_matmul" and len(tensors) > 2 and not tensors[2].is_contiguous():
            return "needs row-major codes"
        return None

    def slow(self, primitive, shape):
        if primitive == "linear" and not amx_forward_pays(*shape):
            return "layer outside the shapes where the fused AMX forward measured faster than _int_mm + epilogue"
        return None

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        if s_x.numel() not in (1, q_x.shape[0]):
            return super().linear(q_x, q_w, z_x, colsum, s_x, s_w, bias)
        z = 0 if z_x is None else int(z_x.reshape(()))
        return cpu_kernels.amx_linear(q_x, q_w, z, None if z_x is None else colsum, s_x, s_w, bias)

    def digit_matmul(self, a, col_scale, q, z, mask):
        return cpu_kernels.amx_digit_matmul(a, col_scale, q, z, mask)
