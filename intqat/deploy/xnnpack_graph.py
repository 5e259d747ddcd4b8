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

Each pass returns how many nodes it rewrote (the report counts them). Shapes in comments: B batch (dynamic),
H heads, L / S query / key length, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch.export import ExportedProgram

__all__ = ["unmask_sdpa", "static_reshapes", "rewrite_for_xnnpack"]

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
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        n += 1
    if n:
        program.graph_module.recompile()
    return n


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
