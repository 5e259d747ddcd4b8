"""The Triton backend: intqat.kernels' GPU kernels (int8 GEMM with fused epilogue, STE backward).

Taken for CUDA tensors. On the CPU only when forced (`use_backend("triton")` or
INTQAT_BACKEND=triton), through Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported): that is how the tests check the kernels' arithmetic without a GPU. Its epilogue may
contract multiply and add into one FMA: y within 1 ulp of the reference, acc exact.
"""

from __future__ import annotations

import torch

from intqat.ops.backends.base import Backend
from intqat.ops.backends.formulas import weight_colsum
from intqat.ops.backends.reference import MAX_K_INT32, split_k

__all__ = ["Triton"]


class Triton(Backend):
    name = "triton"
    needs = "a CUDA GPU (or, forced, the Triton interpreter: TRITON_INTERPRET=1)"
    primitives = frozenset({"int_mm", "linear", "linear_grouped", "ste_grad_input", "ste_grad_weight"})
    traceable = True  # its kernels are torch.library ops: tracers see one node each

    def unavailable(self):
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return f"triton does not import: {e}"
        return None

    def refuse(self, primitive, tensors, shape, traced, spec=None):
        # (no tensors: select(..., at_run_time=True) asks for an eager run on plain CPU tensors)
        forced = self.table.state()[0] == self.name  # forced: the interpreter on CPU tensors too
        if not forced and (not tensors or not all(t is None or t.is_cuda for t in tensors)):
            return "CPU tensors (the Triton interpreter runs only when forced)"
        if primitive == "linear" and shape is not None and shape[1] > MAX_K_INT32:
            return "K past MAX_K_INT32 (the kernel's int32 sum could overflow; sm_80's IMMA saturates)"
        return None

    @staticmethod
    def _kernels():
        from intqat import kernels

        return kernels

    def int_mm(self, a, b):
        if a.shape[1] > MAX_K_INT32:  # the kernel's int32 sum could overflow (sm_80's IMMA saturates)
            return split_k(a, b, MAX_K_INT32, self._kernels().int_mm)
        return self._kernels().int_mm(a, b)

    def linear(self, q_x, q_w, z_x, colsum, s_x, s_w, bias):
        if z_x is None:  # symmetric activations; the kernel takes a zero point and colsum regardless
            z_x = torch.zeros(1, dtype=torch.int32, device=q_x.device)
        if colsum is None:
            colsum = weight_colsum(q_w)
        return self._kernels().int_linear_forward(q_x, q_w, s_x.reshape(-1), z_x, s_w, colsum, bias)

    def linear_grouped(self, q_x, q_w, s_w, z_x, s_x, bias):
        if z_x is None:
            z_x = torch.zeros(1, dtype=torch.int32, device=q_x.device)
        return self._kernels().int_linear_grouped_forward(q_x, q_w, s_x.reshape(-1), z_x, s_w, bias)

    def ste_grad_input(self, g, q_w, s_w, mask_x):
        return self._kernels().ste_grad_input(g, q_w, s_w, mask_x)

    def ste_grad_weight(self, g, q_x, s_x, z_x, mask_w, weight, w_scale, w_qmin, w_qmax, grad_factor):
        return self._kernels().ste_grad_weight(g, q_x, s_x, z_x, mask_w, weight, w_scale, w_qmin, w_qmax, grad_factor)
