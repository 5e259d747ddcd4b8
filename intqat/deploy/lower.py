"""Lower a Q/DQ program to ExecuTorch with XNNPACK and take the delegation census: which integer layers XNNPACK
took, which it did not and why (its partitioner's own reasons), and which float ops stayed outside it.

Kept apart from executorch.py (files, runtime, report) because it is the one place that speaks to ExecuTorch's
partitioner API: `to_edge_transform_and_lower` with an `XnnpackPartitioner` whose `partition` is watched.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram

from intqat.deploy.xnnpack import layer_of

__all__ = ["LayerCensus", "Lowered", "lower_xnnpack", "GEMM_OPS"]

# the op that is a linear / conv layer's computation, in the edge dialect (aten.linear stays whole for XNNPACK;
# addmm / mm are what it decomposes to when XNNPACK does not take it). Embeddings are not XNNPACK's (no gather):
# ExecuTorch's quantized kernels run them (see executorch.py's census).
GEMM_OPS = ("aten.linear.default", "aten.convolution.default", "aten.addmm.default", "aten.mm.default")


@dataclass
class LayerCensus:
    """One integer layer of the model in the .pte."""

    name: str
    kind: str  # QDQIntLinear, QDQIntConv2d, ... (the Q/DQ module)
    scheme: str  # e.g. "static int8 / int8 per channel", "dynamic per-token int8 / int4 per group (32)"
    where: str  # "XNNPACK", "kept float (XNNPACK)", "ExecuTorch kernel", ...
    note: str = ""  # why it is where it is; the output grid of a static layer

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "scheme": self.scheme, "where": self.where, "note": self.note}


@dataclass
class Lowered:
    """The lowered program and what the partitioner did."""

    manager: Any  # executorch.exir.EdgeProgramManager
    taken: set[str]  # layers whose GEMM XNNPACK took
    refused: dict[str, str]  # layer -> the partitioner's reason
    float_ops_outside: Counter = field(default_factory=Counter)  # op -> count of float ops left to portable kernels
    layers: list[str] = field(default_factory=list)  # the Q/DQ layers' module paths
    present: set[str] = field(default_factory=set)  # those with a node in the program (forward calls them)
    final_ops: dict[str, set[str]] = field(default_factory=dict)  # layer -> ops outside XNNPACK after to_executorch
    rewrites: dict[str, int] = field(default_factory=dict)  # intqat.deploy.xnnpack_graph's passes: nodes rewritten
    delegate_calls: int = 0  # executorch_call_delegate nodes in the lowered program


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    name = getattr(t, "__name__", str(t))
    schema = getattr(t, "_schema", None)
    if schema is not None:
        ns, op = schema.name.split("::")
        name = f"{ns}.{op}.{schema.overload_name or 'default'}"
    return name


class _Watch(logging.Handler):
    """Collects the partitioner's WhyNoPartition records (message object: .node, .reason)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.why: list[tuple[torch.fx.Node, str]] = []

    def emit(self, record):
        msg = record.msg
        if hasattr(msg, "node") and hasattr(msg, "reason"):
            self.why.append((msg.node, str(msg.reason)))


@contextlib.contextmanager
def _watching():
    """The XNNPACK loggers at DEBUG into a collector, and not on to the root logger (no console noise)."""
    lg = logging.getLogger("executorch.backends.xnnpack")
    old = (lg.level, lg.propagate)
    watch = _Watch()
    lg.addHandler(watch)
    lg.setLevel(logging.DEBUG)
    lg.propagate = False
    try:
        yield watch
    finally:
        lg.removeHandler(watch)
        lg.setLevel(old[0])
        lg.propagate = old[1]


def _float_out(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)


def lower_xnnpack(program: ExportedProgram, layers: list[str]) -> Lowered:
    """to_edge_transform_and_lower(program, XnnpackPartitioner) with the census of `layers` (module paths)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    seen: dict[str, Any] = {}

    class Watched(XnnpackPartitioner):
        def partition(self, exported_program):
            result = super().partition(exported_program)
            seen["graph"] = list(exported_program.graph.nodes)
            return result

    with _watching() as watch:
        manager = to_edge_transform_and_lower(program, partitioner=[Watched()],
                                              compile_config=EdgeCompileConfig(_check_ir_validity=False))
    taken: set[str] = set()
    gemms: dict[str, list[torch.fx.Node]] = {}
    for node in seen.get("graph", []):
        if node.op != "call_function" or not _target_name(node).startswith(GEMM_OPS):
            continue
        layer = layer_of(node, layers)
        if layer is None:
            continue
        gemms.setdefault(layer, []).append(node)
        if "delegation_tag" in node.meta:
            taken.add(layer)
    refused: dict[str, str] = {}
    for node, reason in watch.why:  # (the GEMM's own reason; a refused cast or view inside a layer is not the layer)
        layer = layer_of(node, layers)
        if layer is not None and layer not in taken and _target_name(node).startswith(GEMM_OPS):
            refused.setdefault(layer, f"{reason} (XNNPACK partitioner, node {node.name})")
    for layer in gemms:
        if layer not in taken and layer not in refused:
            refused[layer] = "XNNPACK's partitioner did not take its GEMM and gave no reason"
    outside = Counter()
    for node in manager.exported_program().graph.nodes:
        if node.op == "call_function" and _target_name(node) != "executorch_call_delegate" and _float_out(node) \
                and layer_of(node, layers) is None and node.target.__name__ != "getitem":
            outside[_target_name(node)] += 1
    present = {layer_of(n, layers) for n in seen.get("graph", []) if n.op == "call_function"} - {None}
    calls = sum(n.op == "call_function" and _target_name(n) == "executorch_call_delegate"
                for n in manager.exported_program().graph.nodes)
    return Lowered(manager, taken, refused, outside, list(layers), present, delegate_calls=calls)
