"""What the forward/backward graphs of a step say about integer training, read from node.meta['val'].

Every judgement here is made from the dtypes and shapes aot_autograd recorded on the nodes,
not from op names we expect: a new integer op shows up without this file changing.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

# Dtypes that hold integer codes or accumulators. int64 and bool are left out on purpose:
# they are indices, masks and counters (BatchNorm's num_batches_tracked), not arithmetic.
INT_CODE_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32})
# Custom-op namespaces whose ops count as integer ops whatever their output dtype
# (intqat's fused ops return fp32 with the int8 arithmetic hidden inside).
INT_NAMESPACES = ("intqat",)
# fp32 kernels that can be the straight-through half of an integer op.
_MATMUL_OPS = frozenset({
    aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.matmul,
    aten.convolution, aten.convolution_backward,
})
# How far back from a matmul operand to look for the integer codes it was converted from
# (intqat's int_linear: codes -> _to_copy -> sub(zero point) -> mul(scale) -> mm is 4 steps).
_STE_SEARCH_DEPTH = 6

# (forward, backward or None, labels of the forward's placeholders): one compiled region.
Region = tuple[GraphModule, "GraphModule | None", list[str]]


@dataclass(frozen=True)
class IntegerOp:
    graph: str  # "forward" or "backward"
    node: str
    target: str
    dtypes: tuple[str, ...]  # integer dtypes it reads or writes
    reason: str  # "namespace", "_int_mm" or "dtype"
    region: int = 0  # which compiled region (more than one: dynamo graph breaks)


@dataclass(frozen=True)
class SteKernel:
    """A backward node computing an integer op's gradient in floating point."""

    node: str
    target: str
    codes: tuple[str, ...]  # the integer tensors it consumes (empty for an intqat *_backward op)
    region: int = 0


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the forward hands to the backward: memory held between the two."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int  # numel * element size: the logical size, not the storage behind a view
    source: str  # "param:fc.weight", "buffer:bn.running_var", "input[0]" or "activation:aten.relu"
    region: int = 0


@dataclass
class GraphSummary:
    regions: int  # compiled regions of the step; 1 unless dynamo broke the graph
    forward_nodes: int
    backward_nodes: int
    integer_ops: list[IntegerOp] = field(default_factory=list)
    ste_kernels: list[SteKernel] = field(default_factory=list)
    # Integer tensors that got a gradient or a tangent; must stay empty.
    integer_grads: list[str] = field(default_factory=list)
    saved: list[SavedTensor] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

    @property
    def activation_bytes(self) -> int:
        """Saved bytes the step adds: parameters, buffers and the step's inputs are held anyway."""
        return sum(s.bytes for s in self.saved if not s.source.startswith(("param:", "buffer:", "input")))

    @property
    def has_ste_backward(self) -> bool:
        return bool(self.ste_kernels)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(saved_bytes=self.saved_bytes, activation_bytes=self.activation_bytes,
                 has_ste_backward=self.has_ste_backward)
        return d

    def to_text(self) -> str:
        lines = [
            f"{self.regions} compiled region(s){', split by graph breaks' if self.regions > 1 else ''}; "
            f"forward nodes {self.forward_nodes}, backward nodes {self.backward_nodes}",
            f"integer ops: {len(self.integer_ops)}, STE backward kernels: {len(self.ste_kernels)}",
            f"integer tensors requiring grad: {', '.join(self.integer_grads) or 'none'}",
            f"saved for backward: {len(self.saved)} tensors, {self.saved_bytes} bytes "
            f"({self.activation_bytes} of them activations)",
        ]
        where = (lambda region: f"[{region}] ") if self.regions > 1 else (lambda region: "")
        lines += [f"  {where(s.region)}{s.name:<24} {s.dtype:<9} {str(list(s.shape)):<18} {s.bytes:>10}  {s.source}"
                  for s in self.saved]
        lines += [f"  {where(op.region)}{op.graph}: {op.node} = {op.target} [{', '.join(op.dtypes)}] ({op.reason})"
                  for op in self.integer_ops]
        return "\n".join(lines)


def summarize(regions: list[Region], int_namespaces: tuple[str, ...] = INT_NAMESPACES) -> GraphSummary:
    """One summary over every compiled region of the step, in execution order."""
    summary = GraphSummary(
        regions=len(regions),
        forward_nodes=sum(_count_ops(fw) for fw, _, _ in regions),
        backward_nodes=sum(_count_ops(bw) for _, bw, _ in regions if bw is not None),
    )
    for i, (fw, bw, labels) in enumerate(regions):
        summary.integer_ops += _integer_ops(fw, "forward", int_namespaces, i)
        if bw is None:  # nothing in this region needs a gradient
            continue
        summary.integer_ops += _integer_ops(bw, "backward", int_namespaces, i)
        summary.ste_kernels += _ste_kernels(bw, int_namespaces, i)
        summary.integer_grads += _integer_grads(fw, bw, labels)
        summary.saved += _saved_tensors(fw, bw, labels, i)
    return summary


def _count_ops(gm: GraphModule) -> int:
    return sum(n.op == "call_function" for n in gm.graph.nodes)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _val_dtypes(node: Node) -> set[torch.dtype]:
    return {t.dtype for t in _tensors(node.meta.get("val"))}


def _op_overload(node: Node) -> torch._ops.OpOverload | None:
    """The op a call_function node runs, looking through auto_functionalized and friends."""
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target
    if isinstance(node.target, torch._ops.HigherOrderOperator) and node.args:
        inner = node.args[0]
        return inner if isinstance(inner, torch._ops.OpOverload) else None
    return None


def _integer_ops(gm: GraphModule, graph: str, int_namespaces: tuple[str, ...], region: int) -> list[IntegerOp]:
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        op = _op_overload(node)
        dtypes = _val_dtypes(node)
        for arg in node.all_input_nodes:
            dtypes |= _val_dtypes(arg)
        int_dtypes = tuple(sorted(str(d).removeprefix("torch.") for d in dtypes & INT_CODE_DTYPES))
        if op is not None and op.namespace in int_namespaces:
            reason = "namespace"
        elif op is aten._int_mm.default:
            reason = "_int_mm"
        elif int_dtypes:
            reason = "dtype"
        else:
            continue
        found.append(IntegerOp(graph, node.name, str(op or node.target), int_dtypes, reason, region))
    return found


def _ste_kernels(bw: GraphModule, int_namespaces: tuple[str, ...], region: int) -> list[SteKernel]:
    kernels = []
    for node in bw.graph.nodes:
        if node.op != "call_function":
            continue
        op = _op_overload(node)
        if op is None:
            continue
        if op.namespace in int_namespaces and "backward" in op.name():
            kernels.append(SteKernel(node.name, str(op), (), region))
            continue
        is_float = any(d.is_floating_point for d in _val_dtypes(node))
        if op.overloadpacket in _MATMUL_OPS and is_float:
            codes = _integer_ancestors(node)
            if codes:
                kernels.append(SteKernel(node.name, str(op), tuple(sorted(codes)), region))
    return kernels


def _integer_ancestors(node: Node) -> set[str]:
    """Integer-code tensors feeding `node` within a few steps, not crossing another matmul."""
    found: set[str] = set()
    frontier, seen = list(node.all_input_nodes), set()
    for _ in range(_STE_SEARCH_DEPTH):
        next_frontier = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if _val_dtypes(n) & INT_CODE_DTYPES:
                found.add(n.name)
                continue
            op = _op_overload(n)
            if n.op == "call_function" and not (op is not None and op.overloadpacket in _MATMUL_OPS):
                next_frontier += n.all_input_nodes
        frontier = next_frontier
    return found


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: GraphModule) -> list[Any]:
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return list(out.args[0])


def _differentiable(dtypes: set[torch.dtype]) -> bool:
    return all(d.is_floating_point or d.is_complex for d in dtypes)


def _integer_grads(fw: GraphModule, bw: GraphModule, input_labels: list[str]) -> list[str]:
    problems = [
        f"tangent {ph.name}"
        for ph in _placeholders(bw)
        if ph.name.startswith("tangents") and not _differentiable(_val_dtypes(ph))
    ]
    # aot_autograd's backward returns one gradient (or None) per forward input, in order.
    fw_inputs = _placeholders(fw)
    for i, grad in enumerate(_outputs(bw)):
        if not isinstance(grad, Node):
            continue
        source_dtypes = _val_dtypes(fw_inputs[i]) if i < len(fw_inputs) else set()
        if not _differentiable(source_dtypes | _val_dtypes(grad)):
            label = input_labels[i] if i < len(input_labels) else f"input {i}"
            problems.append(f"gradient {grad.name} for {label}")
    return problems


def _saved_tensors(fw: GraphModule, bw: GraphModule, input_labels: list[str], region: int) -> list[SavedTensor]:
    # The backward's placeholders are the saved values followed by the tangents, and the
    # forward returns those same saved values last: pair them by position.
    saved_phs = [ph for ph in _placeholders(bw) if not ph.name.startswith("tangents")]
    fw_saved = _outputs(fw)[len(_outputs(fw)) - len(saved_phs):]
    label_of = {ph.name: label for ph, label in zip(_placeholders(fw), input_labels)}
    saved = []
    for ph, src in zip(saved_phs, fw_saved):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor):  # a SymInt saved for dynamic shapes
            continue
        if src.op == "placeholder":
            source = label_of.get(src.name, "input")
        else:
            producer = src.args[0] if src.target is operator.getitem else src
            op = _op_overload(producer)
            source = f"activation:{op.overloadpacket if op is not None else producer.target}"
        saved.append(SavedTensor(
            name=ph.name,
            dtype=str(val.dtype).removeprefix("torch."),
            shape=tuple(int(s) for s in val.shape),
            bytes=val.numel() * val.element_size(),
            source=source,
            region=region,
        ))
    return saved
