"""Which BatchNorm2d can be folded into which Conv2d, read from the model's data flow.

A BatchNorm2d folds into a Conv2d when the conv's output goes to that BN and nowhere else, and each
module is called once: then BN(conv(x)) is one affine conv (intqat.nn.conv). Where the modules sit does
not matter (ResNet's BasicBlock keeps conv1 / bn1 as attributes, not in an nn.Sequential): the pairs come
from a torch.fx symbolic trace. A module whose forward fx cannot trace (data-dependent control flow) is
split: each child is traced on its own, and conv -> BN pairs among the children of an nn.Sequential are
read from their order (a Sequential's data flow is its order). What stays unpaired is reported with why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx
from torch import nn

__all__ = ["ConvBnPairs", "find_conv_bn_pairs"]


@dataclass
class ConvBnPairs:
    """pairs: id(conv) -> (BN's parent module, BN's attribute name, the BN); untraced: fqn -> fx's error,
    for modules holding a Conv2d and a BatchNorm2d whose pairing fx could not read."""

    pairs: dict[int, tuple[nn.Module, str, nn.BatchNorm2d]] = field(default_factory=dict)
    untraced: dict[str, str] = field(default_factory=dict)


class _Tracer(torch.fx.Tracer):
    """torch.nn modules and anything intqat already quantized are leaves (call_module nodes)."""

    def __init__(self, leaves: tuple[type, ...]):
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, self.leaves) or super().is_leaf_module(m, qualname)


def _foldable(conv: nn.Module, bn: nn.Module) -> bool:
    return (type(conv) is nn.Conv2d and type(bn) is nn.BatchNorm2d and bn.num_features == conv.out_channels
            and bn.track_running_stats)


def _holds_conv_and_bn(m: nn.Module) -> bool:
    kinds = {type(x) for x in m.modules()}
    return nn.Conv2d in kinds and nn.BatchNorm2d in kinds


def _owner(root: nn.Module, qualname: str) -> tuple[nn.Module, str]:
    parent, _, name = qualname.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


def _from_graph(root: nn.Module, graph: torch.fx.Graph, found: ConvBnPairs) -> None:
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op != "call_module" or calls[user.target] != 1 or user.args[:1] != (node,) or len(user.args) != 1:
            continue
        conv, bn = root.get_submodule(node.target), root.get_submodule(user.target)
        if _foldable(conv, bn):
            parent, name = _owner(root, user.target)
            found.pairs[id(conv)] = (parent, name, bn)


def _from_sequential(seq: nn.Sequential, found: ConvBnPairs) -> None:
    mods = list(seq._modules.items())
    for (_, a), (name, b) in zip(mods, mods[1:]):
        if a is not None and b is not None and _foldable(a, b) and id(a) not in found.pairs:
            found.pairs[id(a)] = (seq, name, b)


def _visit(m: nn.Module, fqn: str, leaves: tuple[type, ...], found: ConvBnPairs) -> None:
    if not _holds_conv_and_bn(m) or isinstance(m, leaves):
        return
    try:
        graph = _Tracer(leaves).trace(m)
    except Exception as e:  # noqa: BLE001  (fx raises many types; the reason is reported, not swallowed)
        if isinstance(m, nn.Sequential):
            _from_sequential(m, found)
        elif any(type(c) in (nn.Conv2d, nn.BatchNorm2d) for c in m.children()):
            found.untraced[fqn or "<model>"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
        for name, child in m.named_children():
            _visit(child, f"{fqn}.{name}" if fqn else name, leaves, found)
        return
    _from_graph(m, graph, found)


def find_conv_bn_pairs(model: nn.Module, leaves: tuple[type, ...] = ()) -> ConvBnPairs:
    """conv -> BN pairs of `model` from its data flow (see the module docstring). `leaves`: module types
    not to trace into (already quantized ones)."""
    found = ConvBnPairs()
    _visit(model, "", tuple(leaves), found)
    return found
