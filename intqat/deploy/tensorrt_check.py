"""check_tensorrt: whether an ONNX file is one TensorRT's explicit quantization takes, read from TensorRT's documented
rules (no TensorRT needed: it does not run without an NVIDIA GPU), each refusal named with its node.

.. code-block:: python

    from intqat.deploy.tensorrt_check import check_tensorrt
    r = check_tensorrt("export/model.onnx")      # a path, the file's bytes or an onnx.ModelProto
    print("\\n".join(r.lines()))                  # "TensorRT explicit quantization: ready", or each reason
    r.ready, r.reasons                            # bool, ["QuantizeLinear 'x_q' zero point 3 != 0: ...", ...]

The rules, and where TensorRT documents them:
  [ops]    ONNX-TensorRT's operator support matrix, TensorRT 10.15 (onnx/onnx-tensorrt, docs/operators.md): opsets 9 to
           24; the ops marked supported (SUPPORTED below; MatMulInteger, ConvInteger, QLinearMatMul, QLinearConv and
           DynamicQuantizeLinear are not); standard ONNX ops only (another domain, e.g. onnxruntime's com.microsoft
           contrib ops, needs a TensorRT plugin); QuantizeLinear's y_zero_point and DequantizeLinear's x_zero_point
           must be 0; "INT8, INT4, FP8 and FP4 are treated as Quantized Types ... support is available only through
           quantization from a floating-point type": Clip, Cast, Reshape, ... take float (and int32 / int64) types, so
           an int8 tensor is read by DequantizeLinear alone (a Clip between QuantizeLinear and DequantizeLinear, or a
           Cast to int8, is refused).
  [qdq]    TensorRT's Quantize / Dequantize operators
           (https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/operators/Quantize.html, Dequantize.html) and
           IQuantizeLayer (C++ API): the scale is a build-time constant, "all scale coefficients must have strictly
           positive values"; a scalar scale quantizes per tensor, a 1-D one per channel along `axis`, one of the
           input's rank per block (the blocked dimension the last or the second to last); the zero point only zeros.
  [scheme] "Working with Quantized Types" and "Explicit Quantization"
           (https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/work-with-quantized-types.html,
           quantized-types-explicit-quantization.html): symmetric quantization only; INT8 activations and weights,
           INT4 weight-only (block-quantized); pre-quantized weights pass through a DequantizeLayer before the linear
           op. Checked here: activations per tensor, weights per tensor or per output channel (Conv's axis 0,
           ConvTranspose's 1, Gemm's B axis 0 with transB else 1, MatMul's B last axis, through Transposes), a blocked
           DequantizeLinear only on INT4 weights (TensorRT 10; later releases also block INT8).
What it cannot see: whether TensorRT's fusions pick an int8 kernel for each layer (that needs a GPU and trtexec), and
restrictions beyond these (shapes, plugins). intqat's w8a8_sym preset writes a file this check passes (docs/deploy.md,
"TensorRT").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["check_tensorrt", "TensorRTReadiness", "TENSORRT_OPSETS", "SUPPORTED", "TENSORRT_RULES_VERSION"]

TENSORRT_RULES_VERSION = "10.15"  # the ONNX-TensorRT support matrix these rules were read from
TENSORRT_OPSETS = (9, 24)  # "TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24"
# the matrix's rows marked "Y" (TensorRT 10.15)
SUPPORTED = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization BlackmanWindow Cast
CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv DepthToSpace
DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu
Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU
HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageScaler InstanceNormalization IsInf IsNaN
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool
Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow
PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2
ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize
ReverseSequence RMSNormalization RNN RoiAlign RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements
ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze
Sub Sum Tan Tanh TensorScatter ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())
_WHY_NOT = {  # the unsupported ops intqat's files (or onnxruntime's tools) write, and what to do instead
    "MatMulInteger": "the integer form (onnx-int) is for onnxruntime; TensorRT takes the Q/DQ form (--format onnx)",
    "ConvInteger": "the integer form (onnx-int) is for onnxruntime; TensorRT takes the Q/DQ form (--format onnx)",
    "DynamicQuantizeLinear": "TensorRT takes static (build-time) scales; train with preset w8a8_sym",
}
_QUANTIZED = {3: "INT8", 22: "INT4", 2: "UINT8", 21: "UINT4", 17: "FLOAT8E4M3FN", 23: "FLOAT4E2M1"}  # TensorProto
_INT8, _INT4 = 3, 22
_HINT_SYM = "TensorRT takes symmetric activations; train with preset w8a8_sym"
_HINT_STATIC = "TensorRT takes a build-time constant scale (static activations); train with preset w8a8_sym"
MAX_LINES = 12  # reasons printed by lines(); to_dict() has them all


@dataclass
class TensorRTReadiness:
    """reasons: one line per refusal, "<op> '<node>' <what>: <why / what to do>" (empty: ready)."""

    reasons: list[str] = field(default_factory=list)
    opset: int | None = None

    @property
    def ready(self) -> bool:
        return not self.reasons

    def lines(self) -> list[str]:
        if self.ready:
            return [f"TensorRT explicit quantization: ready (TensorRT {TENSORRT_RULES_VERSION}'s documented rules; not "
                    "built: no GPU here)"]
        out = [f"TensorRT explicit quantization: not ready, {len(self.reasons)} reason(s):"]
        out += [f"  - {r}" for r in self.reasons[:MAX_LINES]]
        if len(self.reasons) > MAX_LINES:
            out.append(f"  - ... and {len(self.reasons) - MAX_LINES} more (the report's JSON lists them all)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ready": self.ready, "reasons": list(self.reasons), "opset": self.opset,
                "rules": f"TensorRT {TENSORRT_RULES_VERSION} (intqat.deploy.tensorrt_check)"}


def _load(model):
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise FileNotFoundError(f"check_tensorrt: no ONNX file at {path}")
        return onnx.load(str(path))
    raise TypeError("check_tensorrt takes an ONNX file's path, its bytes or an onnx.ModelProto, not "
                    f"{type(model).__name__}")


class _Graph:
    """The constants (initializers and Constant nodes), the producer and consumers of each value."""

    def __init__(self, graph):
        from onnx import numpy_helper

        self.const = {t.name: t for t in graph.initializer}
        self.producer, self.consumers = {}, {}
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.const[node.output[0]] = value
            for out in node.output:
                self.producer[out] = node
            for i, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((node, i))
        self._np = numpy_helper.to_array

    def array(self, name: str):
        t = self.const.get(name)
        return None if t is None else self._np(t)

    def elem_type(self, name: str) -> int | None:
        """A value's element type where the graph states it: a constant's, a QuantizeLinear output's (its zero
        point's type, else output_dtype), a Cast's `to`; None otherwise (a QuantizeLinear without either is UINT8 by
        ONNX's rule, but TensorRT's parser may read it as INT8: not judged)."""
        if name in self.const:
            return self.const[name].data_type
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "QuantizeLinear":
            if len(node.input) > 2 and node.input[2] in self.const:
                return self.const[node.input[2]].data_type
            return _attr(node, "output_dtype", 0) or None
        if node.op_type == "Cast":
            return _attr(node, "to", None)
        return None


def _attr(node, name: str, default):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _label(node) -> str:
    return f"{node.op_type} '{node.name or node.output[0]}'"


def _weight_axis(g: _Graph, value: str, axis: int, rank: int, seen: int = 0) -> list[tuple[Any, int, int]]:
    """(consumer, its input index, the weight's axis there) for each linear op the dequantized weight reaches, through
    Transposes (the axis follows the permutation)."""
    out = []
    for node, index in g.consumers.get(value, []):
        if node.op_type == "Transpose" and seen < 4:
            perm = _attr(node, "perm", None) or list(reversed(range(rank)))
            out += _weight_axis(g, node.output[0], list(perm).index(axis), rank, seen + 1)
        elif node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
            out.append((node, index, axis))
    return out


def _output_channel(node, index: int, rank: int) -> int | None:
    """The axis of a linear op's weight input that indexes its outputs (None: not a weight input)."""
    if node.op_type == "Conv" and index == 1:
        return 0
    if node.op_type == "ConvTranspose" and index == 1:
        return 1
    if node.op_type == "Gemm" and index == 1:
        return 0 if _attr(node, "transB", 0) else 1
    if node.op_type == "MatMul" and index == 1:
        return rank - 1
    return None


def _check_qdq(node, g: _Graph, reasons: list[str]) -> None:
    """QuantizeLinear / DequantizeLinear: zero point, scale, granularity, type ([qdq], [scheme])."""
    import numpy as np

    label, q = _label(node), node.op_type == "QuantizeLinear"
    data, scale_name = node.input[0], node.input[1]
    zero_name = node.input[2] if len(node.input) > 2 else ""
    weight = not q and data in g.const  # pre-quantized weights: codes stored in the file
    qtype = g.elem_type(node.output[0]) if q else g.elem_type(data)
    if zero_name:
        z = g.array(zero_name)
        if z is None:
            reasons.append(f"{label} zero point is computed at run time: TensorRT's zero point is 0 "
                           f"(a constant); {_HINT_SYM}")
        elif z.any():
            shown = int(z[z != 0].reshape(-1)[0])  # (the first non-zero one)
            reasons.append(f"{label} zero point {shown} != 0: "
                           + (_HINT_SYM if not weight else "TensorRT takes symmetric weights (zero point 0)"))
    if qtype is not None and qtype not in (_INT8, _INT4):
        kind = _QUANTIZED.get(qtype, f"type {qtype}")
        reasons.append(f"{label} {'quantizes to' if q else 'reads'} {kind}: TensorRT's integer explicit quantization "
                       "is INT8 (and INT4 weights)")
    elif qtype == _INT4 and not weight:
        reasons.append(f"{label} INT4 activations: TensorRT quantizes INT4 weights only (weight-only)")
    s = g.array(scale_name)
    if s is None:
        reasons.append(f"{label} scale is computed at run time (dynamic quantization): {_HINT_STATIC}")
        return
    if not (np.isfinite(s).all() and (s > 0).all()):
        reasons.append(f"{label} scale has values <= 0 or not finite (min {float(s.min()):.3g}): TensorRT's scales "
                       "are strictly positive")
    block = _attr(node, "block_size", 0)
    rank = len(g.const[data].dims) if weight else None
    per_tensor = s.size == 1 and s.ndim <= 1 and not block
    if not weight:
        if not per_tensor:
            reasons.append(f"{label} quantizes an activation per {'block' if block else 'channel'} (scale shape "
                           f"{list(s.shape)}): TensorRT takes activations per tensor")
        return
    axis = _attr(node, "axis", 1)
    axis = axis + rank if axis < 0 else axis
    if block:
        if qtype != _INT4:
            gather = any(n.op_type == "Gather" for n, _ in g.consumers.get(node.output[0], []))
            hint = "; a quantized embedding: keep it float for TensorRT (QuantConfig(embedding=None))" if gather else ""
            reasons.append(f"{label} block-quantized {_QUANTIZED.get(qtype, qtype)} weights (block_size {block}): "
                           f"TensorRT 10 blocks INT4 weights only{hint}")
        elif axis not in (rank - 1, rank - 2):
            reasons.append(f"{label} blocks axis {axis} of a rank-{rank} weight: TensorRT blocks the last or the "
                           "second to last dimension")
        return
    if per_tensor:
        return
    if s.ndim != 1 or s.shape[0] != g.const[data].dims[axis]:
        reasons.append(f"{label} scale shape {list(s.shape)} is neither a scalar nor one per channel of axis {axis}: "
                       "TensorRT quantizes weights per tensor or per output channel")
        return
    for consumer, index, at in _weight_axis(g, node.output[0], axis, rank):
        want = _output_channel(consumer, index, rank)
        if want is not None and at != want:
            reasons.append(f"{label} per-channel axis {axis} is axis {at} of {_label(consumer)}'s weight: TensorRT "
                           f"quantizes weights per output channel (axis {want} there)")


def check_tensorrt(model: Any) -> TensorRTReadiness:
    """Whether `model` (a path, the file's bytes or an onnx.ModelProto) is an ONNX file TensorRT's explicit
    quantization takes, by the rules in the module docstring; -> TensorRTReadiness (ready, reasons naming each node)."""
    proto = _load(model)
    result = TensorRTReadiness()
    opsets = {o.domain: o.version for o in proto.opset_import}
    result.opset = opsets.get("", opsets.get("ai.onnx"))
    lo, hi = TENSORRT_OPSETS
    if result.opset is not None and not lo <= result.opset <= hi:
        result.reasons.append(f"model opset {result.opset} is outside TensorRT {TENSORRT_RULES_VERSION}'s parser range "
                              f"{lo} to {hi}")
    local = {(f.domain, f.name) for f in proto.functions}  # model-local functions: their bodies are checked too
    reasons = result.reasons
    for graph in [proto.graph] + [_as_graph(f) for f in proto.functions]:
        g = _Graph(graph)
        quantized = {n for n, p in g.producer.items() if p.op_type == "QuantizeLinear" or g.elem_type(n) in _QUANTIZED}
        quantized |= {n for n, t in g.const.items() if t.data_type in _QUANTIZED}
        for node in graph.node:
            label = _label(node)
            if node.domain not in ("", "ai.onnx"):
                if (node.domain, node.op_type) not in local:
                    reasons.append(f"{label} is a {node.domain} op, not standard ONNX: TensorRT's ONNX parser needs a "
                                   "plugin for it (export without onnxruntime's contrib ops)")
                continue
            if node.op_type not in SUPPORTED:
                why = _WHY_NOT.get(node.op_type,
                                   f"not in TensorRT {TENSORRT_RULES_VERSION}'s ONNX operator support matrix")
                reasons.append(f"{label} is not supported by TensorRT's ONNX parser: {why}")
                continue
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                _check_qdq(node, g, reasons)
                continue
            to = _attr(node, "to", None) if node.op_type == "Cast" else None
            if to in _QUANTIZED and to != 2:  # (UINT8 is a Cast type TensorRT takes, at the network's edges)
                reasons.append(f"{label} casts to {_QUANTIZED[to]}: TensorRT makes quantized tensors with "
                               "QuantizeLinear only (its Cast takes float, int32, int64, uint8 and bool)")
                continue
            read = [n for n in node.input if n in quantized]
            if read and node.op_type != "Constant":
                reasons.append(f"{label} reads the quantized tensor '{read[0]}': TensorRT reads INT8 / INT4 tensors "
                               f"with DequantizeLinear only (its support matrix lists no quantized type for "
                               f"{node.op_type})")
    return result


def _as_graph(function):
    """A FunctionProto's nodes as a GraphProto (no initializers: a function's constants are Constant nodes)."""
    from onnx import helper

    return helper.make_graph(list(function.node), function.name, [], [])
