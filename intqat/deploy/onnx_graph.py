"""Rewrites of an exported ONNX graph (an onnx_ir model, in place) that keep every value and spare onnxruntime a
kernel that is slower than the ops it fuses. Applied to every ONNX file intqat writes (Q/DQ, integer, and the fp32
baseline the bench compares against), so a ratio between them measures the quantized layers, not this.

residual_adds_as_sum: onnxruntime's level-2 optimizer (ORT_ENABLE_ALL, the default) fuses `Add -> LayerNormalization`
(a transformer's residual connection and the norm after it) into its contrib `SkipLayerNormalization`, whose CPU
kernel measured 3x-6.6x slower than the two ops it replaces (onnxruntime 1.32.0, one thread, D = 128, 32 tokens:
batch 1 23.5 against 7.6 us, batch 8 149 against 22.5 us, batch 32 600 against 91 us; Intel Xeon, AMX-INT8 +
AVX512-VNNI, 2026-11-28). The fusion matches `Add` only; `Sum` of the same two inputs is the same sum (ONNX's
multidirectional broadcasting, one fp32 addition per element) and is left unfused. TensorRT reads `Sum` like `Add`.

float_translations (torch.onnx custom translations, every file): a maskless, non-causal 4-D
`scaled_dot_product_attention` (torch's MultiheadAttention / TransformerEncoderLayer, most Hugging Face encoders)
with k transposed by one static `Transpose(perm=[0, 1, 3, 2])`. torch.onnx's own translation (onnxscript's
torchlib) supports any rank, so it transposes k through a 3-D reshape whose shapes it computes at run time: `Shape`,
three `Slice`, two `Concat`, two `Reshape` around the transpose, ~12 us per attention at batch 1 in onnxruntime.
The same ops otherwise, in torchlib's order: q and k^T each times sqrt(scale), MatMul, Softmax, MatMul. Anything
else (a mask, is_causal, dropout, grouped-query heads, another rank) goes to torchlib's translation as before.
"""

from __future__ import annotations

__all__ = ["residual_adds_as_sum", "float_translations"]


def float_translations() -> dict:
    """torch op -> onnxscript function, for torch.onnx.export(custom_translation_table=...) (module docstring)."""
    import numpy as np
    import torch
    from onnxscript import opset21 as op
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention as torchlib_sdpa

    def sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: float | None = None, enable_gqa: bool = False):
        shapes = [getattr(t, "shape", None) for t in (query, key, value)]
        plain = attn_mask is None and not is_causal and dropout_p == 0.0 and not enable_gqa \
            and all(s is not None and len(s) == 4 for s in shapes) and isinstance(shapes[0][-1], int)
        if not plain:
            return torchlib_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        # torchlib's scale, in float32 as it computes it: 1 / sqrt(E), then each side times its square root
        s = np.float32(1.0) / np.sqrt(np.float32(shapes[0][-1])) if scale is None else np.float32(scale)
        root = op.Constant(value_float=float(np.sqrt(s)))
        key_t = op.Transpose(key, perm=[0, 1, 3, 2])
        weights = op.Softmax(op.MatMul(op.Mul(query, root), op.Mul(key_t, root)), axis=-1)
        return op.MatMul(weights, value)

    return {torch.ops.aten.scaled_dot_product_attention.default: sdpa}


def _feeds_layer_norm_only(value) -> bool:
    """value's only consumers are LayerNormalization nodes (as their input X)."""
    uses = list(value.uses())
    if not uses or value.is_graph_output():
        return False
    return all(node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and index == 0
               for node, index in uses)


def residual_adds_as_sum(model) -> int:
    """Every two-input `Add` whose output only feeds LayerNormalization becomes `Sum` (module docstring); -> how many."""
    changed = 0
    for node in model.graph:
        if node.op_type == "Add" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2 \
                and _feeds_layer_norm_only(node.outputs[0]):
            node.op_type = "Sum"
            changed += 1
    return changed
