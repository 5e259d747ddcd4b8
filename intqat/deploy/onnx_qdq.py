"""The Q/DQ ONNX form (`export_onnx(..., form="qdq")`): intqat.deploy.to_qdq's program with the translations the
exporter needs for ONNX's QuantizeLinear / DequantizeLinear, and int4 weights stored as ONNX INT4.

What each op of the Q/DQ program becomes (opset 21):
  quantized_decomposed.quantize_per_tensor     QuantizeLinear(x, s, z) (+ Clip when [qmin, qmax] is narrower than
                                               int8's range: QuantizeLinear saturates to the type's range only)
  quantized_decomposed.dequantize_per_tensor   DequantizeLinear(q, s, z)            (onnxscript's own translation)
  quantized_decomposed.dequantize_per_channel  DequantizeLinear(q_w, s_w, 0, axis=0) (onnxscript's own translation)
  torchao.dequantize_affine                    DequantizeLinear with block_size (opset 21's blocked form) along the
                                               one blocked axis: per-group weights (block [1, group_size], the codes
                                               stored as INT4 when they lie in [-8, 7]) and per-token activations
                                               (block [1, ..., K], the scale computed at run time); per tensor when
                                               the block is the whole tensor (a dynamic conv's input)
  torchao.choose_qparams_affine / quantize_affine   written out by torch.onnx's own decomposition: ReduceMax,
                                               ReduceMin, Max, Div, Clip (the scale), Reciprocal, Mul, Round, Clip,
                                               Cast (the codes): intqat's formula, codes equal to the integer
                                               model's. (DynamicQuantizeLinear would be asymmetric uint8 per tensor,
                                               another scheme.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["qdq_translations", "store_int4_weights"]

_INT4 = 22  # onnx.TensorProto.INT4
_INT8 = 3  # onnx.TensorProto.INT8


def _blocked_axis(block_size: Sequence) -> tuple[int, int] | None:
    """(axis, block) of the one axis whose block is a concrete int > 1; None: a per-tensor block (every axis
    blocked, or a symbolic block: the batch)."""
    axes = [(i, b) for i, b in enumerate(block_size) if not (isinstance(b, int) and b == 1)]
    if len(axes) == 1 and isinstance(axes[0][1], int):
        return axes[0]
    return None


def qdq_translations() -> dict:
    """torch op -> onnxscript function, for torch.onnx.export(custom_translation_table=...)."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (quantized_decomposed)
    import numpy as np
    import torchao.quantization.quant_primitives  # noqa: F401  (torchao's ops)
    from onnxscript import ir
    from onnxscript import opset21 as op

    def quantize_per_tensor(input, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: int):
        # (the dtype is int8 here: to_qdq quantizes every activation to int8 codes)
        q = op.QuantizeLinear(input, op.Constant(value_float=float(scale)),
                              op.Cast(op.Constant(value_int=int(zero_point)), to=_INT8))
        if (quant_min, quant_max) != (-128, 127):
            q = op.Clip(q, op.Cast(op.Constant(value_int=int(quant_min)), to=_INT8),
                        op.Cast(op.Constant(value_int=int(quant_max)), to=_INT8))
        return q

    def dequantize_affine(input, block_size: Sequence[int], scale, zero_point, input_dtype: int,
                          quant_min: int | None = None, quant_max: int | None = None, output_dtype: int = 1):
        four = quant_min is not None and quant_max is not None and -8 <= quant_min and quant_max <= 7
        qtype = _INT4 if four else _INT8
        q = op.Cast(input, to=_INT4) if four else input  # (an initializer: folded into INT4 storage afterwards)
        zero = op.Cast(zero_point, to=qtype) if zero_point is not None else None
        blocked = _blocked_axis(block_size)
        if blocked is None:  # one scale for the whole tensor: a scalar
            scalar = op.Constant(value=ir.tensor(np.zeros((0,), dtype=np.int64)))
            y = op.DequantizeLinear(q, op.Reshape(scale, scalar), None if zero is None else op.Reshape(zero, scalar))
        else:
            axis, block = blocked
            # the scale in the input's rank, the blocked axis divided by its block (opset 21's blocked layout)
            divisor = [1] * len(block_size)
            divisor[axis] = block
            shape = op.Div(op.Shape(input), op.Constant(value_ints=divisor))
            y = op.DequantizeLinear(q, op.Reshape(scale, shape), None if zero is None else op.Reshape(zero, shape),
                                    axis=axis, block_size=block)
        return y if output_dtype in (1, None) else op.Cast(y, to=output_dtype)

    return {torch.ops.quantized_decomposed.quantize_per_tensor.default: quantize_per_tensor,
            torch.ops.torchao.dequantize_affine.default: dequantize_affine}


def store_int4_weights(model) -> int:
    """Fold Cast(int8 initializer -> INT4) into an INT4 initializer (two codes a byte in the file) in an onnx_ir
    model, in place; -> how many. The exporter's constant folding leaves large initializers as they are."""
    import ml_dtypes
    import numpy as np
    from onnxscript import ir

    folded = 0
    graph = model.graph
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            continue
        to = node.attributes.get("to")
        src = node.inputs[0]
        if to is None or to.as_int() != _INT4 or src is None or src.const_value is None:
            continue
        codes = src.const_value.numpy()
        if codes.dtype != np.int8 or codes.size and (codes.min() < -8 or codes.max() > 7):
            continue
        out = node.outputs[0]
        value = ir.Value(name=f"{src.name}_int4", shape=ir.Shape(codes.shape), type=ir.TensorType(ir.DataType.INT4),
                         const_value=ir.tensor(codes.astype(ml_dtypes.int4), name=f"{src.name}_int4"))
        graph.register_initializer(value)
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        folded += 1
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del graph.initializers[name]
    return folded
