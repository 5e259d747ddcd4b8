"""Rewrites of the exported (ATen) program that keep its values and let XNNPACK take more of it in fewer
delegate calls. Applied by intqat.deploy.executorch to the int8 program and to its fp32 baseline alike, before
`to_edge_transform_and_lower`.

Why (profiled with ExecuTorch's ETDump, encoder d128 seq32, batch 1, executorch 1.5.1): of the int8 .pte's time,
the int8 GEMMs were ~20%; ~40% was ExecuTorch's portable kernels between 13 XNNPACK delegate calls, and most of
that came from two sources, both the same in the fp32 .pte:

- `aten.scaled_dot_product_attention` without a mask decomposes (ExecuTorch's edge decomposition, torch's math
  form) into `mul.Scalar` x2, `expand_copy` x4 + views (a 4-D matmul), `bmm`, and `_safe_softmax`: softmax plus
  `eq` / `logical_not` / `any` / `full_like` / `where`, which zero a row whose scores are all -inf. None of those
  but bmm and softmax is XNNPACK's. `unmask_sdpa` writes it as views to 3-D, `mul` by sqrt(scale) (as torch's
  math form: both q and k), `bmm`, `_softmax`, `bmm`, a view back: all XNNPACK's. Without a mask a row of scores
  is all -inf only if q or k holds an infinity (then softmax gives NaN there instead of 0): the one difference,
  named in docs/deploy.md.
- views whose target shape names the dynamic batch symbolically (`view(x, [s0, 2, 32, 64])`): XNNPACK's static
  reshape refuses symbolic sizes and takes one inferred (-1) dimension. `static_reshapes` writes the one symbolic
  size as -1 (the same view: the other sizes are fixed, so the product fixes it; a -1 the model wrote for a
  fixed size is written as that size).

After the Q/DQ form and autocast, `rewrite_quantized_for_xnnpack` re-spells what was still left outside (the
same profile, after the two passes above: LayerNorm x2 ~14 µs, a 3-D mean ~5.5 µs, the packed q / k / v split
~3.6 µs, in 6 delegate calls): `decompose_layer_norms`, `means_as_4d`, `split_packed_projections` (each one's
docstring says how and why its values are the same). The encoder's .pte then makes 1-2 delegate calls.

Each pass returns how many nodes it rewrote (the report counts them). Shapes in comments: B batch (dynamic),
H heads, L / S query / key length, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.export import ExportedProgram

__all__ = ["unmask_sdpa", "static_reshapes", "rewrite_for_xnnpack", "decompose_layer_norms", "means_as_4d",
           "split_packed_projections", "rewrite_quantized_for_xnnpack"]

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _new(graph: torch.fx.Graph, target, args: tuple, like: torch.fx.Node, **kwargs) -> torch.fx.Node:
    """A call_function node with its fake value computed from its inputs' (as export would) and like's stack."""
    node = graph.call_function(target, args, kwargs)
    fake = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args)
    node.meta["val"] = target(*fake, **kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, new: torch.fx.Node) -> None:
    """Every use of node now reads new; node leaves the graph."""
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _recompiled(program: ExportedProgram, n: int) -> int:
    """A pass's epilogue: regenerate the module's code if the pass rewrote anything (n nodes); returns n."""
    if n:
        program.graph_module.recompile()
    return n


def _static(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def unmask_sdpa(program: ExportedProgram) -> int:
    """scaled_dot_product_attention(q, k, v) with no mask, no dropout, not causal, 4-D q / k / v whose heads,
    lengths and head dims are fixed -> views to (B*H, L, D), q * sqrt(scale), k * sqrt(scale), bmm(q, kᵀ),
    softmax, bmm(p, v), view back to (B, H, L, D) (module docstring); in place."""
    graph, n = program.graph, 0
    for node in [x for x in graph.nodes if x.op == "call_function" and x.target == aten.scaled_dot_product_attention.default]:
        q, k, v = node.args[:3]
        extra = dict(zip(("attn_mask", "dropout_p", "is_causal"), node.args[3:6]), **node.kwargs)
        if extra.get("attn_mask") is not None or extra.get("dropout_p", 0.0) != 0.0 or extra.get("is_causal", False) \
                or extra.get("enable_gqa", False):
            continue
        shapes = [tuple(t.meta["val"].shape) for t in (q, k, v)]
        if any(len(s) != 4 or not all(_static(d) for d in s[1:]) for s in shapes) or shapes[0][1] != shapes[1][1]:
            continue
        (_, h, lq, d), (_, _, s_len, _), (_, _, _, dv) = shapes
        scale = extra.get("scale")
        # torch's math form: sqrt(scale) on q and on k (scale default 1 / sqrt(D)), in double, then fp32
        sf = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(d))
        with graph.inserting_before(node):
            q3 = _new(graph, aten.view.default, (q, [-1, lq, d]), node)  # (B*H, L, D)
            k3 = _new(graph, aten.view.default, (k, [-1, s_len, d]), node)  # (B*H, S, D)
            v3 = _new(graph, aten.view.default, (v, [-1, s_len, dv]), node)  # (B*H, S, Dv)
            qs = _new(graph, aten.mul.Tensor, (q3, sf), node)
            ks = _new(graph, aten.mul.Tensor, (k3, sf), node)
            kt = _new(graph, aten.permute.default, (ks, [0, 2, 1]), node)  # (B*H, D, S)
            scores = _new(graph, aten.bmm.default, (qs, kt), node)  # (B*H, L, S)
            p = _new(graph, aten._softmax.default, (scores, -1, False), node)
            o = _new(graph, aten.bmm.default, (p, v3), node)  # (B*H, L, Dv)
            o4 = _new(graph, aten.view.default, (o, [-1, h, lq, dv]), node)  # (B, H, L, Dv)
            # in SDPA's own memory layout, (L, B, H, Dv): model code views its permuted output (attention's
            # permute(2, 0, 1, 3).reshape(L * B, E)), which the program's re-trace checks against the strides
            lbhd = _new(graph, aten.clone.default, (_new(graph, aten.permute.default, (o4, [2, 0, 1, 3]), node),), node,
                        memory_format=torch.contiguous_format)
            out = _new(graph, aten.permute.default, (lbhd, [1, 2, 0, 3]), node)  # (B, H, L, Dv), SDPA's strides
        _replace(graph, node, out)
        n += 1
    return _recompiled(program, n)


def static_reshapes(program: ExportedProgram) -> int:
    """view / reshape whose output has exactly one symbolic size -> the shape written with that size as -1 and
    every other as its fixed int (an inferred -1 the model wrote for a fixed size becomes that size); in place."""
    n = 0
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target not in _VIEWS or len(node.args) < 2:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            continue
        # the output's own sizes: fixed ones as ints (an inferred -1 among them too), the one symbolic size as -1
        shape = [d if _static(d) else -1 for d in out.shape]
        if shape.count(-1) != 1 or shape == list(node.args[1]):
            continue
        node.args = (node.args[0], shape, *node.args[2:])
        n += 1
    if n:
        program.graph.eliminate_dead_code()  # (the sym_size / mul nodes that computed the sizes)
        program.graph_module.recompile()
    return n


def rewrite_for_xnnpack(program: ExportedProgram) -> dict[str, int]:
    """Both passes, in place: {"unmasked_sdpa": n, "static_reshapes": n}."""
    return {"unmasked_sdpa": unmask_sdpa(program), "static_reshapes": static_reshapes(program)}


# -- after the Q/DQ pass and autocast (they see the model's own ops; these only re-spell fp32 ones) -------------
def _fp32(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


def _shape_arg(shape) -> list[int] | None:
    """A tensor's sizes as a view's target: fixed ones as ints, at most one symbolic one as -1 (else None)."""
    out = [d if _static(d) else -1 for d in shape]
    return out if out.count(-1) <= 1 else None


def _mean4(graph: torch.fx.Graph, x4: torch.fx.Node, like: torch.fx.Node) -> torch.fx.Node:
    """mean over dims 2, 3 of a 4-D tensor, keepdim: XNNPACK's one mean (global average pooling)."""
    return _new(graph, aten.mean.dim, (x4, [2, 3], True), like)


def decompose_layer_norms(program: ExportedProgram) -> int:
    """layer_norm(x, [D], w, b, eps) on fp32 x (..., D) -> mu = linear(x, 1/D) (..., 1); xc = x - mu;
    var = linear(xc * xc, 1/D); y = xc * rsqrt(var + eps) * w + b: every op XNNPACK's, on x's own shape (no view),
    so the norm runs inside the delegate instead of between two calls. The two means are fully connected layers
    with one output row of 1/D each: XNNPACK's fp32 GEMM with N = 1 took < 1 µs here where its mean operator (a
    4-D global average pool) took ~5 µs per mean on a 32 x 128 tensor (ETDump, Intel Xeon AMX), slower than the
    portable LayerNorm it replaced. The same formula as torch's CPU kernel (biased variance of x - mean); the sums
    run in another order, and 1/D is rounded once unless D is a power of two."""
    graph, n = program.graph, 0
    for node in [x for x in graph.nodes if x.op == "call_function" and x.target == aten.layer_norm.default]:
        x, normalized = node.args[:2]
        weight, bias = (list(node.args[2:4]) + [None, None])[:2]
        weight, bias = node.kwargs.get("weight", weight), node.kwargs.get("bias", bias)
        eps = node.args[4] if len(node.args) > 4 else node.kwargs.get("eps", 1e-5)
        shape = tuple(x.meta["val"].shape)
        if len(normalized) != 1 or not _fp32(x) or not _static(shape[-1]):
            continue
        d = shape[-1]
        mean_w = _add_constant(program, f"{node.name}_mean_row", torch.full((1, d), 1.0 / d), x)  # (1, D)
        with graph.inserting_before(node):
            mu = _new(graph, aten.linear.default, (x, mean_w), node)  # (..., 1)
            xc = _new(graph, aten.sub.Tensor, (x, mu), node)
            var = _new(graph, aten.linear.default, (_new(graph, aten.mul.Tensor, (xc, xc), node), mean_w), node)
            r = _new(graph, aten.rsqrt.default, (_new(graph, aten.add.Tensor, (var, float(eps)), node),), node)
            y = _new(graph, aten.mul.Tensor, (xc, r), node)
            if weight is not None:
                y = _new(graph, aten.mul.Tensor, (y, weight), node)
            if bias is not None:
                y = _new(graph, aten.add.Tensor, (y, bias), node)
        _replace(graph, node, y)
        n += 1
    return _recompiled(program, n)


def means_as_4d(program: ExportedProgram) -> int:
    """mean(x, dims) on a fp32 3-D x, no dtype -> permute the kept dims first, view to 4-D (K1, K2, R, 1), mean
    over dims 2, 3 (keepdim), view to mean's own output shape. XNNPACK's mean takes only that 4-D form."""
    graph, n = program.graph, 0
    for node in [x for x in graph.nodes if x.op == "call_function" and x.target == aten.mean.dim]:
        x, dims = node.args[0], node.args[1]
        keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        if node.kwargs.get("dtype") is not None or not _fp32(x) or dims is None:
            continue
        shape = tuple(x.meta["val"].shape)
        if len(shape) != 3:
            continue
        red = sorted({d % 3 for d in dims})
        kept = [d for d in range(3) if d not in red]
        out = _shape_arg(node.meta["val"].shape)
        if not red or not kept or out is None or not all(_static(shape[d]) for d in red) \
                or (len(red) > 1 and kept + red != [0, 1, 2]):
            continue  # (a permuted x is viewed only by adding a unit dim: one reduced dim then)
        r = math.prod(shape[d] for d in red)
        k4 = [-1 if not _static(shape[d]) else shape[d] for d in kept] + [1] * (2 - len(kept))  # (K1, K2)
        if k4.count(-1) > 1:
            continue
        with graph.inserting_before(node):
            xp = x if kept + red == [0, 1, 2] else _new(graph, aten.permute.default, (x, kept + red), node)
            x4 = _new(graph, aten.view.default, (xp, k4 + [r, 1]), node)  # (K1, K2, R, 1)
            y = _new(graph, aten.view.default, (_mean4(graph, x4, node), out), node)
        _replace(graph, node, y)
        n += 1
    return _recompiled(program, n)


def rewrite_quantized_for_xnnpack(program: ExportedProgram) -> dict[str, int]:
    """The passes that follow the Q/DQ form and autocast (they re-spell fp32 ops only), in place."""
    return {"layer_norms": decompose_layer_norms(program), "means_4d": means_as_4d(program),
            "split_projections": split_packed_projections(program)}


def _input_spec(program: ExportedProgram, node: torch.fx.Node):
    return next((s for s in program.graph_signature.input_specs if s.arg.name == node.name), None)


def _constant(program: ExportedProgram, node: torch.fx.Node) -> Tensor | None:
    """The tensor a parameter / buffer / constant placeholder holds, or None (a user input, a computed node)."""
    spec = _input_spec(program, node) if node.op == "placeholder" else None
    if spec is None or spec.target is None:
        return None
    return program.state_dict.get(spec.target, program.constants.get(spec.target))


def _add_constant(program: ExportedProgram, name: str, tensor: Tensor, like: torch.fx.Node) -> torch.fx.Node:
    """A new lifted constant placeholder holding tensor, before the user inputs (the signature's order)."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    specs = program.graph_signature.input_specs
    at = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    with (program.graph.inserting_before(placeholders[at]) if at < len(placeholders)
          else program.graph.inserting_after(placeholders[-1]) if placeholders
          else program.graph.inserting_before(next(iter(program.graph.nodes)))):
        node = program.graph.placeholder(name)
    node.meta["val"] = like.meta["val"].fake_mode.from_tensor(tensor)
    specs.insert(at, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), target=node.name, persistent=None))
    program.constants[node.name] = tensor
    return node


def _drop_unused_constants(program: ExportedProgram, nodes) -> None:
    from torch.export.graph_signature import InputKind

    for node in nodes:
        if node.op != "placeholder" or node.users:
            continue
        spec = _input_spec(program, node)
        if spec is None or spec.kind == InputKind.USER_INPUT:
            continue
        program.graph_signature.input_specs.remove(spec)
        program.state_dict.pop(spec.target, None)
        program.constants.pop(spec.target, None)
        program.graph.erase_node(node)


def _packed_selects(value: torch.fx.Node, parts: int) -> list[torch.fx.Node] | None:
    """torch's _in_projection_packed after the projection: view (..., 3, E) -> unsqueeze(0) -> transpose(0, -2)
    -> squeeze(-2) -> clone -> select(0, i) for i < 3; the selects in order, or None when value is used otherwise."""
    def only(node, target):
        users = list(node.users)
        return users[0] if len(users) == 1 and users[0].op == "call_function" and users[0].target == target else None

    view = only(value, aten.view.default)
    if view is None or tuple(view.meta["val"].shape[-2:])[0] != parts:
        return None
    uns = only(view, aten.unsqueeze.default)
    tr = uns is not None and only(uns, aten.transpose.int)
    sq = tr and only(tr, aten.squeeze.dim)
    if not sq or list(uns.args[1:]) != [0] or list(tr.args[1:]) != [0, -2] or list(sq.args[1:]) != [-2]:
        return None
    src = only(sq, aten.clone.default) or sq
    selects = {}
    for u in src.users:
        if u.op != "call_function" or u.target != aten.select.int or u.args[1] != 0:
            return None
        selects.setdefault(u.args[2] % parts, []).append(u)
    if sorted(selects) != list(range(parts)) or any(len(v) != 1 for v in selects.values()):
        return None
    return [selects[i][0] for i in range(parts)]


def split_packed_projections(program: ExportedProgram) -> int:
    """A packed q / k / v projection (linear with 3E output rows, then torch's view / unsqueeze / transpose /
    squeeze / select into three) -> three linears on the same input, each with its rows of the weight (the codes,
    scales and zero points of a per-channel weight, or the fp32 rows) and of the bias, each with the packed
    output's own quantize -> dequantize if it has one: the same values element for element (a row's dot product
    and its requantization do not depend on the other rows). XNNPACK refuses the selects (its slice needs static
    shapes; the batch is dynamic), which cost two extra delegate calls and three copies."""
    qd = torch.ops.quantized_decomposed
    graph, n = program.graph, 0
    for lin in [x for x in graph.nodes if x.op == "call_function" and x.target == aten.linear.default]:
        x, w = lin.args[:2]
        b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
        rows = lin.meta["val"].shape[-1]
        if not _static(rows) or rows % 3:
            continue
        e = rows // 3
        # the output's own Q/DQ (a static layer's int8 output grid), single-user
        q = next(iter(lin.users)) if len(lin.users) == 1 else None
        qdq = None
        if q is not None and q.target == qd.quantize_per_tensor.default and len(q.users) == 1 \
                and next(iter(q.users)).target == qd.dequantize_per_tensor.default:
            qdq = (q, next(iter(q.users)))
        selects = _packed_selects(qdq[1] if qdq else lin, 3)
        if selects is None or tuple(selects[0].meta["val"].shape[-1:]) != (e,):
            continue
        # the weight: an fp32 constant, or dequantize_per_channel(codes, scales, zero points, axis 0, ...) of constants
        if w.op == "placeholder":
            w_parts, w_args = [w], None
        elif w.op == "call_function" and w.target == qd.dequantize_per_channel.default and w.args[3] == 0:
            w_parts, w_args = list(w.args[:3]), w.args[3:]
        else:
            continue
        tensors = [_constant(program, p) if isinstance(p, torch.fx.Node) else None for p in w_parts]
        bias = _constant(program, b) if isinstance(b, torch.fx.Node) else None
        if any(t is None or t.shape[0] != rows for t in tensors) \
                or (b is not None and (bias is None or bias.shape[0] != rows)):
            continue
        outs = []
        for i in range(3):
            def piece(t, tag, like):
                return _add_constant(program, f"{like.name}_{tag}{i}", t[i * e:(i + 1) * e].clone().contiguous(), like)

            with graph.inserting_before(lin):
                consts = [piece(t, "qkv", p) for t, p in zip(tensors, w_parts)]
                wi = consts[0] if w_args is None else _new(graph, w.target, (*consts, *w_args), w)
                bi = None if b is None else piece(bias, "qkv", b)
                yi = _new(graph, aten.linear.default, (x, wi, bi), lin)
                if qdq:
                    yi = _new(graph, qdq[0].target, (yi, *qdq[0].args[1:]), qdq[0])
                    yi = _new(graph, qdq[1].target, (yi, *qdq[1].args[1:]), qdq[1])
            outs.append(yi)
        for sel, yi in zip(selects, outs):
            sel.replace_all_uses_with(yi)
        graph.eliminate_dead_code()
        _drop_unused_constants(program, [*w_parts, *([b] if b is not None else [])])
        n += 1
    return _recompiled(program, n)
