"""The Q/DQ ONNX form (`export_onnx(..., form="qdq")`): intqat.deploy.to_qdq's program with the translations the
exporter needs for ONNX's QuantizeLinear / DequantizeLinear, and int4 weights stored as ONNX INT4.

What each op of the Q/DQ program becomes (opset 21):
  quantized_decomposed.quantize_per_tensor     QuantizeLinear(x, s, z); when [qmin, qmax] is narrower than int8's
                                               range (QuantizeLinear saturates to the type's range only), a Clip of x
                                               to [(qmin - z) s, (qmax - z) s] in fp32 before it (the same codes)
  quantized_decomposed.dequantize_per_tensor   DequantizeLinear(q, s, z)            (onnxscript's own translation)
  quantized_decomposed.dequantize_per_channel  DequantizeLinear(q_w, s_w, 0, axis=0) (onnxscript's own translation)
  torchao.dequantize_affine                    DequantizeLinear with block_size (opset 21's blocked form) along the
                                               one blocked axis: per-group weights (block [1, group_size], the codes
                                               stored as INT4 when they lie in [-8, 7]) and per-token activations
                                               (block [1, ..., K], the scale computed at run time); per tensor when
                                               the block is the whole tensor (a dynamic conv's input)
  torchao.choose_qparams_affine (symmetric)    s = Max(Max(ReduceMax(x), -ReduceMin(x)) / ((qmax - qmin) / 2), eps)
                                               over the block (the row: per token; the whole tensor: a dynamic
                                               conv), z = 0
  torchao.quantize_affine                      Cast<int8>(Clip(Round(x * Reciprocal(s)), qmin, qmax)): intqat's
                                               formula, the codes equal to the integer model's (max |x| is
                                               max(max x, -min x) exactly; Round is half to even, Reciprocal IEEE).
                                               ~12 small ops where torch.onnx's own decomposition of torchao's
                                               ops wrote ~30 (zeros_like, views, Expand). (DynamicQuantizeLinear
                                               would be asymmetric uint8 per tensor, another scheme.)

Shaped for onnxruntime's Q/DQ fusion (its QDQ selectors, onnxruntime 1.32), without leaving the standard ops:
  a Gemm whose output is not requantized (a head, an output projection): Gemm(DQ(x), DQ(w)) without its bias, then
  Add(b). onnxruntime's QGemm selector needs every input of the Gemm from a DequantizeLinear; it quantizes a float
  bias to int32 itself only when a QuantizeLinear follows the Gemm, so a head with its float bias stayed a float Gemm
  on weights dequantized at every call. Without the bias it becomes QGemm with a float output (float(acc) * s_x s_w,
  intqat's epilogue), then the float Add: the same value as the integer layer (the encoder's output equal bit for
  bit); the file keeps b in fp32, as TensorRT's explicit quantization reads a bias. (A MatMul + Add is no help:
  onnxruntime folds it back into a Gemm with its float bias before the Q/DQ fusion.)
  A requantized Gemm keeps its bias: onnxruntime rounds b to int32 on the grid s_x s_w and requantizes inside QGemm
  (uint8 output), its own arithmetic (digits MLP: 0.098 output steps from the integer model). Splitting its bias too
  (QGemm with a float output, the Add, the next QuantizeLinear) was measured: the digits MLP bit for bit (0 steps),
  the same time at batch 1, 13% slower at batch 32 (three more nodes; AMX Xeon, onnxruntime 1.32): not taken.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["qdq_translations", "store_int4_weights", "split_unrequantized_bias"]

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
        if (quant_min, quant_max) != (-128, 127):
            # a narrower range (w8a8_sym's [-127, 127]) clips x in float before the QuantizeLinear, at fp32((q - z) s):
            # round(fp32((q - z) s) / s) + z = q exactly, so the codes are those of a Clip after it, and the Q's output
            # feeds its DequantizeLinear alone (TensorRT's parser takes Clip on float types only, not int8)
            lo, hi = (float(np.float32(q - zero_point) * np.float32(scale)) for q in (quant_min, quant_max))
            input = op.Clip(input, op.Constant(value_float=lo), op.Constant(value_float=hi))
        return op.QuantizeLinear(input, op.Constant(value_float=float(scale)),
                                 op.Cast(op.Constant(value_int=int(zero_point)), to=_INT8))

    def dequantize_affine(input, block_size: Sequence[int], scale, zero_point, input_dtype: int,
                          quant_min: int | None = None, quant_max: int | None = None, output_dtype: int = 1):
        four = quant_min is not None and quant_max is not None and -8 <= quant_min and quant_max <= 7
        qtype = _INT4 if four else _INT8
        q = op.Cast(input, to=_INT4) if four else input  # (an initializer: folded into INT4 storage afterwards)
        zero = op.Cast(zero_point, to=qtype) if not _zero(zero_point) else None
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

    def block_shape(input, block_size: Sequence):
        """The scale's shape in the input's rank (the blocked axis divided by its block), or None: one scale."""
        blocked = _blocked_axis(block_size)
        if blocked is None:
            return None
        divisor = [1] * len(block_size)
        divisor[blocked[0]] = blocked[1]
        return op.Div(op.Shape(input), op.Constant(value_ints=divisor))

    def choose_qparams_affine(input, mapping_type: str, block_size: Sequence[int], target_dtype: int,
                              quant_min: int | None = None, quant_max: int | None = None, eps: float | None = None,
                              scale_dtype: int | None = None, zero_point_dtype: int | None = None,
                              keepdim: bool = False):
        if mapping_type != "SYMMETRIC" or quant_min is None or quant_max is None or eps is None:
            raise ValueError(f"intqat's ONNX Q/DQ form writes symmetric dynamic activations only (with their range and "
                             f"eps), got mapping {mapping_type!r}, [{quant_min}, {quant_max}], eps {eps}")
        blocked = _blocked_axis(block_size)
        # max |x| = max(max x, -min x), exactly (two reads of x; Abs would write a copy of it first)
        if blocked is None:  # the whole tensor: one scale (torch's: shape [1] without keepdim)
            amax = op.Reshape(op.Max(op.ReduceMax(input, keepdims=0), op.Neg(op.ReduceMin(input, keepdims=0))),
                              op.Constant(value_ints=[1]))
        else:  # torchao's shape (keepdim=False): the blocked axis dropped
            axes, keep = op.Constant(value_ints=[blocked[0]]), int(bool(keepdim))
            amax = op.Max(op.ReduceMax(input, axes, keepdims=keep), op.Neg(op.ReduceMin(input, axes, keepdims=keep)))
        scale = op.Max(op.Div(amax, op.Constant(value_float=float(quant_max - quant_min) / 2)),
                       op.Constant(value_float=float(eps)))
        zero = op.ConstantOfShape(op.Shape(scale), value=ir.tensor(np.zeros((1,), dtype=np.int32)))
        return scale, zero  # (the zero point is 0: symmetric; quantize_affine / dequantize_affine leave it out)

    def quantize_affine(input, block_size: Sequence[int], scale, zero_point, output_dtype: int,
                        quant_min: int | None = None, quant_max: int | None = None):
        shape = block_shape(input, block_size)
        s = op.Reshape(scale, shape) if shape is not None else op.Reshape(scale, op.Constant(value_ints=[]))
        q = op.Round(op.Mul(input, op.Reciprocal(s)))
        if not _zero(zero_point):
            z = op.Cast(zero_point, to=1)
            q = op.Add(q, op.Reshape(z, shape) if shape is not None else op.Reshape(z, op.Constant(value_ints=[])))
        lo, hi = (-128, 127) if quant_min is None or quant_max is None else (quant_min, quant_max)
        q = op.Clip(q, op.Constant(value_float=float(lo)), op.Constant(value_float=float(hi)))
        return op.Cast(q, to=_INT8 if output_dtype is None else output_dtype)  # (the ONNX type: the exporter maps it)

    return {torch.ops.quantized_decomposed.quantize_per_tensor.default: quantize_per_tensor,
            torch.ops.torchao.dequantize_affine.default: dequantize_affine,
            torch.ops.torchao.choose_qparams_affine.default: choose_qparams_affine,
            torch.ops.torchao.quantize_affine.default: quantize_affine}


def _zero(value) -> bool:
    """Whether value is choose_qparams_affine's symmetric zero point (a ConstantOfShape of 0, built above)."""
    node = value.producer() if value is not None else None
    if value is None or node is None or node.op_type != "ConstantOfShape":
        return value is None
    fill = node.attributes.get("value")
    return fill is not None and not fill.as_tensor().numpy().any()


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


def _requantized(value) -> bool:
    """Whether value reaches a QuantizeLinear alone, through Relu / Clip at most (onnxruntime's selectors fold those
    into the Q; a Clip only when it does not narrow the Q's range, so not the one a narrower [qmin, qmax] writes):
    then onnxruntime fuses the Gemm with its bias into QGemm itself."""
    clips = []
    while True:
        uses = list(value.uses())
        if len(uses) != 1 or value.is_graph_output():
            return False
        node = uses[0][0]
        if node.op_type == "QuantizeLinear":
            return all(_covers(clip, node) for clip in clips)
        if node.op_type not in ("Relu", "Clip"):
            return False
        if node.op_type == "Clip":
            clips.append(node)
        value = node.outputs[0]


def _const(value):
    """A constant input's numpy value (an initializer or a Constant node's), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().numpy()
    return None


def _covers(clip, q) -> bool:
    """Whether Clip's [min, max] holds the int8 QuantizeLinear's whole range [(-128 - z) s, (127 - z) s] (what
    onnxruntime's Clip + Q fusion asks before it drops the Clip). Unreadable bounds: taken as folded (as before)."""
    lo, hi = (_const(clip.inputs[i]) if len(clip.inputs) > i else None for i in (1, 2))
    s, z = _const(q.inputs[1]), _const(q.inputs[2]) if len(q.inputs) > 2 else 0
    if s is None or z is None or s.size != 1:
        return True
    s, z = float(s.reshape(-1)[0]), int(np.asarray(z).reshape(-1)[0])
    return (lo is None or float(lo) <= (-128 - z) * s) and (hi is None or float(hi) >= (127 - z) * s)


def _plain_dq(value) -> bool:
    """value comes from a per-tensor / per-channel DequantizeLinear (no block_size: what QGemm takes)."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "DequantizeLinear":
        return False
    block = node.attributes.get("block_size")
    return block is None or block.as_int() == 0


def split_unrequantized_bias(model) -> int:
    """Gemm(DQ(x), DQ(w), b) whose output is not requantized -> Gemm(DQ(x), DQ(w)) then Add(b), in an onnx_ir model,
    in place (module docstring); -> how many."""
    from onnxscript import ir

    graph, split = model.graph, 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
            continue
        x, w, b = node.inputs[:3]
        beta = node.attributes.get("beta")
        if b is None or beta is not None and beta.as_float() != 1.0 or _requantized(node.outputs[0]):
            continue
        if not all(_plain_dq(v) for v in (x, w)):  # (a blocked DQ: per-token or per-group, no QGemm to become)
            continue
        out = node.outputs[0]
        gemm = ir.node("Gemm", [x, w], {k: a.value for k, a in node.attributes.items() if k != "beta"},
                       name=f"{node.name}_nobias")
        add = ir.node("Add", [gemm.outputs[0], b], name=f"{node.name}_bias")
        gemm.outputs[0].name, gemm.outputs[0].shape, gemm.outputs[0].type = f"{out.name}_nobias", out.shape, out.type
        for new in (gemm, add):  # (the census reads the layer of each node from its name scopes)
            new.metadata_props.update(node.metadata_props)
        graph.insert_after(node, [gemm, add])
        name = out.name
        out.replace_all_uses_with(add.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        add.outputs[0].name, add.outputs[0].shape, add.outputs[0].type = name, out.shape, out.type
        split += 1
    return split
