"""Rewrites of an exported ONNX graph (an onnx_ir model, in place) that keep every value and spare onnxruntime a
kernel that is slower than the ops it fuses, or small nodes it runs one by one (each costs it ~1-2 us at batch 1
whatever its size). Applied to every ONNX file intqat writes (Q/DQ, integer, and the fp32
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

split_packed_heads: torch's MultiheadAttention (F._in_projection_packed, then the heads) turns the packed q / k / v
projection P (T, B, 3E) into the three (B, H, T, d) tensors with 17 small nodes: Reshape (T, B, 3, E), Unsqueeze,
Transpose, Squeeze, three Gather (onnxruntime: Split + three Squeeze), and per part Reshape (T, B*H, d), Transpose,
Reshape (B, H, T, d). The same tensors are Reshape(P, (T, B, 3H, d)), Split into three along axis 2, and per part
Transpose(perm=[1, 2, 0, 3]): 5 nodes, pure data movement (values unchanged element for element), and onnxruntime
folds the three transposes into the attention's FusedMatMul (its transBatch), leaving 2. The packed k / v
projection of cross-attention (2 parts) is the same pattern. Measured with the output rewrite below on the encoder
(d 128, 2 heads, seq 32; onnxruntime 1.32.0, one thread, AMX Xeon, 2026-11-28): onnxruntime runs 28 nodes of the
Q/DQ file instead of 44 and 22 of the fp32 file instead of 38 (docs/deploy.md, "Attention's heads"). Measured and
not taken: a Split of P along E then a Reshape per part (one node more); Gather per part (onnxruntime makes it a
Split + Squeeze each).

batch_first_out_projection: a batch_first MultiheadAttention ends with the heads (B, H, T, d) -> Transpose(perm=[2, 0,
1, 3]) -> Reshape (T*B, E) -> the out-projection (its Q / DQ, Gemm, bias, or the integer form's ops) -> Reshape
(T, B, E) -> Transpose(perm=[1, 0, 2]) -> (B, T, E). With the heads transposed to (B, T, H, d) instead, the rows
reach the projection in (b, t) order and Reshape (B, T, E) is the output: one Transpose fewer in every file. The
projection computes each row on its own (a GEMM's row depends on that row and the weight only), so the values
are the same element for element; only ops that act row by row (elementwise with scalars or per-column vectors,
Q / DQ per tensor, Gemm / MatMul / MatMulInteger on a constant weight) may sit between the two reshapes.
Not taken, measured: the same for the input's transpose (B, T, E) -> (T, B, E) before the in-projection: the
heads then come out as (B, T, H, d) -> (B, H, T, d), a transpose onnxruntime's FusedMatMul cannot absorb (its
transBatch is the (T, B, H, d) -> (B, H, T, d) one): onnxruntime ran one node more, not fewer.
"""

from __future__ import annotations

__all__ = ["residual_adds_as_sum", "float_translations", "split_packed_heads", "batch_first_out_projection"]


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


def _ints(value) -> list[int] | None:
    """The int64 / int32 constant behind value (an initializer or a Constant node), flattened; None otherwise."""
    if value is None:
        return None
    tensor = value.const_value
    node = value.producer()
    if tensor is None and node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].as_tensor()
    if tensor is None:
        return None
    array = tensor.numpy()
    return [int(v) for v in array.reshape(-1)] if array.dtype.kind in "iu" else None


def _attr(node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _only_use(value, op_type: str):
    """The one node that reads value (as its first input), if it is an op_type of the default domain; else None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node, index = uses[0]
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") and index == 0 else None


def _heads_of(view) -> tuple[list, int, int] | None:
    """From torch's Reshape (T, B, parts, E) of a packed projection to its parts' Reshape (B, H, T, d):
    ([the last Reshape of each part, in order], H, d), or None when the graph is not exactly that chain."""
    c1 = _ints(view.inputs[1])
    if not c1 or len(c1) != 4 or c1[2] not in (2, 3) or 0 in c1 or c1[3] < 1:
        return None
    parts, e = c1[2], c1[3]
    unsqueeze = _only_use(view.outputs[0], "Unsqueeze")
    if unsqueeze is None or _ints(unsqueeze.inputs[1]) != [0]:
        return None
    transpose = _only_use(unsqueeze.outputs[0], "Transpose")
    if transpose is None or list(_attr(transpose, "perm", [])) != [3, 1, 2, 0, 4]:
        return None
    squeeze = _only_use(transpose.outputs[0], "Squeeze")
    if squeeze is None or _ints(squeeze.inputs[1]) not in ([-2], [3]) or squeeze.outputs[0].is_graph_output():
        return None
    gathers: dict[int, list] = {}
    for node, index in squeeze.outputs[0].uses():  # (P viewed (parts, T, B, E)) -> select(0, i)
        i = _ints(node.inputs[1]) if node.op_type == "Gather" and index == 0 else None
        shape = node.inputs[1].shape if i is not None else None
        if i is None or len(i) != 1 or _attr(node, "axis", 0) != 0 or shape is None or len(shape) != 0:
            return None
        gathers.setdefault(i[0] % parts, []).append(node)
    if sorted(gathers) != list(range(parts)) or any(len(g) != 1 for g in gathers.values()):
        return None
    ends, heads, d = [], None, None
    for i in range(parts):
        flat = _only_use(gathers[i][0].outputs[0], "Reshape")  # (T, B*H, d)
        c2 = _ints(flat.inputs[1]) if flat is not None else None
        swap = _only_use(flat.outputs[0], "Transpose") if c2 else None  # (B*H, T, d)
        unflat = _only_use(swap.outputs[0], "Reshape") if swap is not None else None  # (B, H, T, d)
        c3 = _ints(unflat.inputs[1]) if unflat is not None else None
        if not c2 or len(c2) != 3 or list(_attr(swap, "perm", [])) != [1, 0, 2] or not c3 or len(c3) != 4 \
                or c2[0] != c1[0] or c3[2] != c1[0] or c2[2] != c3[3] or c3[1] < 1 or c3[1] * c3[3] != e \
                or heads not in (None, c3[1]):
            return None
        heads, d = c3[1], c3[3]
        ends.append(unflat)
    return ends, heads, d


def _int64(graph, name: str, values: list[int]):
    import numpy as np
    from onnxscript import ir

    tensor = ir.tensor(np.array(values, dtype=np.int64), name=name)
    value = ir.Value(name=name, shape=ir.Shape(tensor.shape), type=ir.TensorType(ir.DataType.INT64),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def _drop_dead(graph) -> None:
    """Nodes whose outputs nobody reads, then initializers nobody reads (what a rewrite left behind)."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if node.outputs and all(not o.uses() and not o.is_graph_output() for o in node.outputs):
                graph.remove(node, safe=True)
                changed = True
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        del graph.initializers[name]


def split_packed_heads(model) -> int:
    """torch's packed q / k / v heads chain -> Reshape (T, B, parts*H, d), Split, a Transpose per part, in an onnx_ir
    model, in place (module docstring); -> how many packed projections."""
    from onnxscript import ir

    graph, done, outputs = model.graph, 0, []
    for view in list(graph):
        if view.op_type != "Reshape" or view.domain not in ("", "ai.onnx") or view.graph is None:
            continue
        found = _heads_of(view)
        if found is None:
            continue
        ends, heads, d = found
        c1 = _ints(view.inputs[1])
        parts, name = c1[2], view.name or f"heads_{done}"
        # P (T, B, parts*E) -> (T, B, parts*H, d) -> parts x (T, B, H, d) -> (B, H, T, d)
        reshape = ir.node("Reshape", [view.inputs[0], _int64(graph, f"{name}_heads_shape", [c1[0], c1[1], parts * heads,
                                                                                            d])], name=f"{name}_heads")
        split = ir.node("Split", [reshape.outputs[0], _int64(graph, f"{name}_split_sizes", [heads] * parts)],
                        {"axis": 2}, num_outputs=parts, name=f"{name}_split")
        new = [reshape, split]
        for i, end in enumerate(ends):
            transpose = ir.node("Transpose", [split.outputs[i]], {"perm": [1, 2, 0, 3]}, name=f"{name}_heads_t{i}")
            out = end.outputs[0]
            transpose.outputs[0].shape, transpose.outputs[0].type = out.shape, out.type
            new.append(transpose)
        for node in new:  # (the census reads a node's layer from its name scopes)
            node.metadata_props.update(view.metadata_props)
        graph.insert_before(view, new)
        for i, end in enumerate(ends):
            old, value = end.outputs[0], new[2 + i].outputs[0]
            value.name = f"{old.name}_heads"
            if old.is_graph_output():  # (its name back once the old node is gone)
                outputs.append((value, old.name))
            old.replace_all_uses_with(value, replace_graph_outputs=True)
        done += 1
    if done:
        _drop_dead(graph)
    for value, name in outputs:
        value.name = name
    return done


_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Round", "Clip", "Cast", "Relu", "QuantizeLinear", "DequantizeLinear")


def _static(value, depth: int = 4) -> bool:
    """value is a constant, or computed from constants only (a weight's DequantizeLinear / Transpose)."""
    if value is None or value.const_value is not None:
        return True
    node = value.producer()
    if node is None or value.is_graph_input() or depth == 0:
        return False
    return node.op_type == "Constant" or all(_static(v, depth - 1) for v in node.inputs)


def _rank(value) -> int | None:
    shape = value.shape if value is not None else None
    if shape is None and value is not None and value.const_value is not None:
        shape = value.const_value.shape
    return None if shape is None else len(shape)


def _row_wise(node, index: int) -> bool:
    """node, reading the rows of a 2-D (rows, E) tensor at input `index`, computes each output row from that row
    alone (its other inputs constants that do not index rows)."""
    if node.domain not in ("", "ai.onnx") or index != 0 and node.op_type not in ("Add", "Mul"):
        return False
    others = [v for i, v in enumerate(node.inputs) if i != index and v is not None]
    if not all(_static(v) for v in others):
        return False
    if node.op_type in _ELEMENTWISE:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):  # per tensor only (a scalar scale / zero point)
            return all(_rank(v) == 0 or v.const_value is not None and v.const_value.size == 1 for v in others)
        return all(_rank(v) is not None and _rank(v) <= 1 for v in others)
    if node.op_type == "Gemm":
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        return not _attr(node, "transA", 0) and _rank(node.inputs[1]) == 2 \
            and (bias is None or _rank(bias) is not None and _rank(bias) <= 1)
    if node.op_type in ("MatMul", "MatMulInteger"):  # B 2-D; MatMulInteger's zero points per tensor / per column
        return _rank(node.inputs[1]) == 2 and all(_rank(v) is not None and _rank(v) <= 1 for v in node.inputs[2:]
                                                   if v is not None)
    return False


def _out_projection(transpose):
    """From the heads' Transpose(perm=[2, 0, 1, 3]) to the output's Transpose(perm=[1, 0, 2]) (module docstring):
    (the last Reshape (T, B, E), the Transpose after it, T, E), or None when the graph is not exactly that."""
    x = transpose.inputs[0]
    if list(_attr(transpose, "perm", [])) != [2, 0, 1, 3] or x.shape is None or len(x.shape) != 4:
        return None
    heads, t, d = x.shape[1], x.shape[2], x.shape[3]
    if not all(isinstance(v, int) for v in (heads, t, d)):
        return None
    e = heads * d
    flat = _only_use(transpose.outputs[0], "Reshape")
    if flat is None or _ints(flat.inputs[1]) != [-1, e]:
        return None
    value = flat.outputs[0]
    for _ in range(32):  # the projection's ops, one by one, each the only reader of the one before
        uses = list(value.uses())
        if len(uses) != 1 or value.is_graph_output():
            return None
        node, index = uses[0]
        if node.op_type == "Reshape" and index == 0:
            c = _ints(node.inputs[1])
            after = _only_use(node.outputs[0], "Transpose")
            if c is None or len(c) != 3 or c[0] != t or c[1] != -1 or after is None \
                    or list(_attr(after, "perm", [])) != [1, 0, 2]:
                return None
            return node, after, t, c[2]
        if not _row_wise(node, index) or len(node.outputs) != 1:
            return None
        value = node.outputs[0]
    return None


def batch_first_out_projection(model) -> int:
    """The batch_first attention's output transposes (module docstring), in an onnx_ir model, in place; -> how many."""
    from onnxscript import ir

    graph, done = model.graph, 0
    for transpose in list(graph):
        if transpose.op_type != "Transpose" or transpose.domain not in ("", "ai.onnx") or transpose.graph is None:
            continue
        found = _out_projection(transpose)
        if found is None:
            continue
        reshape, last, t, e = found
        b, heads, _, d = transpose.inputs[0].shape
        transpose.attributes["perm"] = ir.AttrInt64s("perm", [0, 2, 1, 3])  # (B, T, H, d): rows in (b, t) order
        transpose.outputs[0].shape = ir.Shape([b, t, heads, d])
        reshape.replace_input_with(1, _int64(graph, f"{reshape.name or 'out'}_batch_first", [-1, t, e]))
        out = last.outputs[0]
        reshape.outputs[0].shape = out.shape
        name = out.name
        out.replace_all_uses_with(reshape.outputs[0], replace_graph_outputs=True)
        graph.remove(last, safe=True)
        if reshape.outputs[0].is_graph_output():
            reshape.outputs[0].name = name
        done += 1
    if done:
        _drop_dead(graph)
    return done
