"""Reduction extent of a node: how many products or terms each output element accumulates.

Read from node.meta["val"] fake tensors, so no data is needed. A symbolic size uses its
hint (the example input's size); an unbacked size has none and gives UNKNOWN, which the
classifier treats as too deep (fp32 is the safe side).
"""

from __future__ import annotations

import math

import torch

from .ops import arg_value, aten, packet_of

UNKNOWN = -1

# (M, K) @ (K, N): the operand whose last dim is K, by argument position.
_MATMUL_K_ARG = {
    aten.mm: 0, aten.bmm: 0, aten.matmul: 0, aten.mv: 0, aten.dot: 0, aten.vdot: 0,
    aten.addmm: 1, aten.baddbmm: 1, aten.addbmm: 1, aten.addmv: 1, aten._addmm_activation: 1,
}
_CONV = {aten.convolution, aten._convolution, aten.conv1d, aten.conv2d, aten.conv3d,
         aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d}
_CONV_TRANSPOSED = {aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d}
# numel(input) / numel(output) terms per output element.
_REDUCTIONS = {aten.sum, aten.nansum, aten.mean, aten.var, aten.std, aten.var_mean,
               aten.std_mean, aten.prod, aten.logsumexp, aten.norm, aten.linalg_vector_norm}


def _size(s) -> int:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    return int(hint) if hint is not None else UNKNOWN


def _numel(t: torch.Tensor) -> int:
    sizes = [_size(s) for s in t.shape]
    return UNKNOWN if UNKNOWN in sizes else math.prod(sizes)


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def reduction_extent(node: torch.fx.Node) -> int | None:
    """K for matmul/linear, Cin/groups*kh*kw for conv, terms per output for sum/mean/...;
    None when the node is not a reduction."""
    packet = packet_of(node.target)
    args = node.args
    if packet in _MATMUL_K_ARG:
        a = _val(args[_MATMUL_K_ARG[packet]])
        return _size(a.shape[-1]) if isinstance(a, torch.Tensor) else UNKNOWN
    if packet is aten.linear:  # weight (N, K)
        w = _val(args[1])
        return _size(w.shape[-1]) if isinstance(w, torch.Tensor) else UNKNOWN
    if packet in _CONV:
        w = _val(args[1])
        sizes = [_size(s) for s in w.shape] if isinstance(w, torch.Tensor) else [UNKNOWN]
        if UNKNOWN in sizes:
            return UNKNOWN
        kernel = math.prod(sizes[2:])
        transposed = packet in _CONV_TRANSPOSED or arg_value(node, "transposed") is True
        if not transposed:  # weight (Cout, Cin/groups, kh, kw)
            return sizes[1] * kernel
        # weight (Cin, Cout/groups, kh, kw): each output sums Cin/groups channels.
        groups = arg_value(node, "groups")
        groups = groups if isinstance(groups, int) else 1
        return sizes[0] // groups * kernel
    if packet is aten.scaled_dot_product_attention:  # q (.., L, E) k (.., S, E)
        q, k = _val(args[0]), _val(args[1])
        return max(_size(q.shape[-1]), _size(k.shape[-2]))
    if packet in _REDUCTIONS:
        x = _val(args[0])
        outs = node.meta.get("val")
        out = outs[0] if isinstance(outs, (tuple, list)) else outs
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
            return UNKNOWN
        n_in, n_out = _numel(x), _numel(out)
        return UNKNOWN if UNKNOWN in (n_in, n_out) else n_in // max(n_out, 1)
    return None


def too_deep(node: torch.fx.Node, limit: int) -> bool:
    extent = reduction_extent(node)
    return extent is not None and (extent == UNKNOWN or extent > limit)
