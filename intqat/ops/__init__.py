"""Integer ops: quantize / dequantize, int_mm, and the differentiable int_linear."""

from intqat.ops.backends import explain
from intqat.ops.int_linear import (
    integer_epilogue,
    int_linear,
    quantize_activation,
    quantize_weight,
    rounded_zero_point,
)
from intqat.ops.int_linear_grouped import int_linear_grouped
from intqat.ops.int_mm import MAX_K_INT32, check_int_mm, int_mm
from intqat.ops.lsq import lsq_grad_factor, lsq_scale_grad_elem
from intqat.ops.qparams import choose_qparams, qrange
from intqat.ops.quant import dequantize, fake_quantize, quantize, quantize_with_mask

__all__ = [
    "quantize", "dequantize", "quantize_with_mask", "fake_quantize",
    "choose_qparams", "qrange",
    "int_mm", "MAX_K_INT32", "check_int_mm", "explain",
    "int_linear", "int_linear_grouped", "quantize_activation", "quantize_weight", "integer_epilogue",
    "rounded_zero_point", "lsq_grad_factor", "lsq_scale_grad_elem",
]
