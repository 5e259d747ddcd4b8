"""Triton kernels of intqat: int8 GEMM forward, fp32 straight-through backward.

Each launcher is a ``torch.library.triton_op`` (namespace ``intqat``), so torch.compile and
torch.export see one node per call. On a machine without a GPU the kernels run on CPU tensors
in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before this package (and triton)
is first imported. torch cannot trace interpreted kernels, so there the launchers are opaque
custom ops with the same schema instead (int_gemm.kernel_op).
"""

from intqat.kernels.int_gemm import int_linear_accumulator, int_linear_forward, int_mm
from intqat.kernels.int_gemm_grouped import int_linear_grouped_forward, int_linear_grouped_sums
from intqat.kernels.ste_backward import ste_grad_input, ste_grad_weight

__all__ = [
    "int_mm",
    "int_linear_accumulator",
    "int_linear_forward",
    "int_linear_grouped_forward",
    "int_linear_grouped_sums",
    "ste_grad_input",
    "ste_grad_weight",
]
