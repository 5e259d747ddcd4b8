"""Rule-based node classifier: each float op gets a precision and the name of the rule
that chose it; the first rule that fires wins (order of RULES below).

Precisions: the low type ("bf16"/"fp16"), "fp32", or "unchanged" (the op keeps the
dtypes it had: integer ops, explicit casts, ops on non-fp32 floats). A node that is
neither low nor unchanged gets its inputs in their original dtype, so fp32 nodes compute
exactly what they computed before conversion.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
from torch._ops import HigherOrderOperator
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .config import AutocastConfig
from .ops import (CAST_OPS, INDEX_ARG_OPS, RECURRENT_OPS, WIDEST_TYPE_OPS, _MISSING, arg_value, is_elementwise,
                  packet_of, tensors)
from .reduction import too_deep

# First match wins, in this order.
RULES = (
    "higher_order_op",          # other HOP regions (set_grad, cond, ...) are opaque: fp32
    "autocast_region",          # under torch.autocast at export time: keep what it chose
    "in_place_op",              # x.add_() in training IR writes a buffer: keep its dtype
    "integer_op",               # int/bool inputs or outputs: never touched
    "explicit_cast",            # x.to(dtype) in user code: output dtype is fixed
    "non_fp32_dtype",           # fp64 or already-low values: not ours to change
    "constant",                 # no tensor inputs (zeros, arange, full): dtype fixed by op
    "integer_layer",            # quantize prologue / float epilogue of IntLinear & co: fp32
    "recurrent_op",             # aten.lstm / gru / rnn_*: state carried across steps, fp32 (ops.RECURRENT_OP_NAMES)
    "nodes_to_exclude",
    "targets_to_exclude",
    "fp32_ops",
    "conditional_fp32_ops",
    "max_depth_of_reduction",
    "data_max",
    "low_precision_ops",        # listed by the caller: low
    "widest_type",              # add/cat/view...: widest precision among computed inputs
    "follows_consumers",        # widest-type op on params/constants only: as its consumers
    "custom_op",                # non-aten op (a hand-written kernel may assume fp32): fp32
    "not_in_low_precision_ops",  # low_precision_ops given and op not in it: fp32
    "isolated_elementwise",     # elementwise op whose computed inputs and consumers all stay
                                # fp32 (relu between two integer layers): low would only add
                                # two casts and rounding, so fp32. Decided last: it looks at
                                # its neighbours' decisions.
    "default_low_precision",
)

FP32, UNCHANGED = "fp32", "unchanged"


@dataclass(frozen=True)
class Decision:
    precision: str  # low name ("bf16"/"fp16"), "fp32" or "unchanged"
    rule: str

    @property
    def low(self) -> bool:
        return self.precision not in (FP32, UNCHANGED)


def is_structural(node: torch.fx.Node) -> bool:
    """getitem, asserts, sym_size...: no computation of their own, never classified."""
    if node.target is operator.getitem:
        return True
    return not isinstance(node.target, HigherOrderOperator) and not tensors(node.meta.get("val"))


def producer(node: torch.fx.Node) -> torch.fx.Node:
    """Through getitem to the op that computed the value."""
    while node.op == "call_function" and is_structural(node) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def tensor_inputs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    out = []
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if isinstance(val, torch.Tensor):
            out.append((a, val))
    return out


def _in_integer_layer(node: torch.fx.Node, types: tuple[str, ...]) -> bool:
    # A suffix match on the qualified type name: "IntLinear" covers intqat.nn.IntLinear and
    # DeployedIntLinear (what export packages); "intqat.nn.linear.IntLinear" pins one class.
    for _path, cls in (node.meta.get("nn_module_stack") or {}).values():
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        if name.endswith(types):
            return True
    return False


def _from_autocast(node: torch.fx.Node) -> bool:
    # After run_decompositions() the wrap_with_autocast region is inlined; its nodes keep
    # provenance (meta["from_node"]) pointing at the HOP they came from.
    stack = list(node.meta.get("from_node") or [])
    while stack:
        src = stack.pop()
        if "wrap_with_autocast" in str(getattr(src, "target", "")):
            return True
        stack.extend(getattr(src, "from_node", None) or [])
    return False


def _autocast_hop(node: torch.fx.Node) -> Decision:
    # wrap_with_autocast(device_type, dtype, enabled, cache_enabled, submod, *operands)
    _device, dtype, enabled = node.args[:3]
    fp32 = not enabled or dtype == torch.float32
    return Decision(FP32 if fp32 else UNCHANGED, "autocast_region")


def _fixed_rule(node: torch.fx.Node, cfg: AutocastConfig, amax: dict | None) -> Decision | None:
    """Rules that depend on the node alone (everything but widest/default)."""
    target = node.target
    if isinstance(target, HigherOrderOperator):
        if target is torch.ops.higher_order.wrap_with_autocast:
            return _autocast_hop(node)
        return Decision(FP32, "higher_order_op")
    outs = tensors(node.meta.get("val"))
    fp32_outs = all(t.dtype == torch.float32 for t in outs if t.is_floating_point())
    if _from_autocast(node):
        return Decision(FP32 if fp32_outs else UNCHANGED, "autocast_region")
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        # A buffer updated in place (running stats, counters) must not lose bits to bf16.
        return Decision(FP32 if fp32_outs else UNCHANGED, "in_place_op")
    ins = tensor_inputs(node)
    index_op = packet_of(target) in INDEX_ARG_OPS
    if not any(t.is_floating_point() for t in outs) or any(
            not v.is_floating_point() and not index_op for _, v in ins):
        return Decision(UNCHANGED, "integer_op")
    if packet_of(target) in CAST_OPS:
        return Decision(UNCHANGED, "explicit_cast")
    floats = [t for t in outs if t.is_floating_point()] + [v for _, v in ins if v.is_floating_point()]
    if any(t.dtype != torch.float32 for t in floats):
        return Decision(UNCHANGED, "non_fp32_dtype")
    if not ins:
        return Decision(UNCHANGED, "constant")
    if _in_integer_layer(node, cfg.integer_module_types):
        return Decision(FP32, "integer_layer")
    if packet_of(target) in RECURRENT_OPS:
        return Decision(FP32, "recurrent_op")
    if any(p.search(node.name) for p in cfg.node_patterns):
        return Decision(FP32, "nodes_to_exclude")
    if target in cfg.excluded_targets:
        return Decision(FP32, "targets_to_exclude")
    if target in cfg.fp32_targets:
        return Decision(FP32, "fp32_ops")
    for cond in cfg.conditionals:
        if cond.matches(target):
            value = arg_value(node, cond.arg)
            if value is not _MISSING and value in cond.values:
                return Decision(FP32, "conditional_fp32_ops")
    if cfg.max_depth_of_reduction is not None and too_deep(node, cfg.max_depth_of_reduction):
        return Decision(FP32, "max_depth_of_reduction")
    if amax is not None and node.name in amax and not amax[node.name] <= cfg.data_max:
        return Decision(FP32, "data_max")
    if cfg.low_targets is not None and target in cfg.low_targets:
        return Decision(cfg.low_name, "low_precision_ops")
    return None


def _widest(node, cfg, decisions, free) -> Decision | None:
    """fp32 if any computed float input is fp32, else low; None if every input is free
    (a parameter, buffer, constant, or something made only from them)."""
    precisions = set()
    for a, val in tensor_inputs(node):
        src = producer(a)
        if src in free or not val.is_floating_point():
            continue
        d = decisions.get(src)
        precisions.add(cfg.low_name if d is not None and d.low else FP32)
    if not precisions:
        return None
    return Decision(FP32 if FP32 in precisions else cfg.low_name, "widest_type")


def consumers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Users that compute with the value: through getitem, skipping asserts/sym_size."""
    out = []
    for u in node.users:
        if u.op == "call_function" and is_structural(u):
            if u.target is operator.getitem:
                out.extend(consumers(u))
            continue
        out.append(u)
    return out


def _follow_consumers(node, cfg, decisions) -> Decision:
    users = consumers(node)
    low = bool(users) and all(u in decisions and decisions[u].low for u in users)
    return Decision(cfg.low_name if low else FP32, "follows_consumers")


def _keeps_input_dtype(node: torch.fx.Node, decisions, kept: set) -> bool:
    """The consumer takes its inputs in their original (fp32) dtype after conversion: the
    output (cast back to the original dtype) and every node that is not low, except an
    explicit cast, which takes its input as it comes."""
    if node.op == "output":
        return True
    d = decisions.get(node)
    return d is not None and (not d.low or node in kept) and d.rule != "explicit_cast"


def _isolated_elementwise(decisions: dict[torch.fx.Node, Decision], free: set) -> None:
    """Send to fp32 (rule isolated_elementwise) the default_low_precision elementwise ops
    whose computed float inputs all come from fp32 nodes and whose consumers all take fp32:
    in low precision they would only add a cast in, a cast out and rounding.

    Greatest fixed point, so a chain (relu -> tanh) between fp32 nodes stays fp32 too:
    start with every candidate kept and drop any with a low producer or consumer outside
    the kept set; a drop re-checks the dropped node's candidate neighbours (a worklist, so
    a long chain costs O(n)). The result does not depend on the order; the order is graph
    order. Parameters/constants (`free`) are neutral: they are stored in whichever dtype
    their consumers take."""
    inputs = {n: [src for src in (producer(a) for a, val in tensor_inputs(n) if val.is_floating_point())
                  if src not in free]
              for n, d in decisions.items() if d.rule == "default_low_precision" and is_elementwise(n.target)}
    candidates = [n for n, srcs in inputs.items() if srcs]
    kept = set(candidates)

    def isolated(node):
        return not any(decisions[s].low and s not in kept for s in inputs[node] if s in decisions) \
            and all(_keeps_input_dtype(u, decisions, kept) for u in consumers(node))

    queue = deque(candidates)
    while queue:
        node = queue.popleft()
        if node in kept and not isolated(node):
            kept.discard(node)
            queue.extend(n for n in [*inputs[node], *consumers(node)] if n in kept)
    for node in candidates:
        if node in kept:
            decisions[node] = Decision(FP32, "isolated_elementwise")


def _last_rule(node: torch.fx.Node, cfg: AutocastConfig) -> Decision:
    if getattr(node.target, "namespace", "aten") not in ("aten", "prims"):
        return Decision(FP32, "custom_op")
    if cfg.low_targets is not None:
        return Decision(FP32, "not_in_low_precision_ops")
    return Decision(cfg.low_name, "default_low_precision")


def classify(program: ExportedProgram, cfg: AutocastConfig,
             amax: dict[str, float] | None = None) -> dict[torch.fx.Node, Decision]:
    """Decision for every computing call_function node of program.graph."""
    graph = program.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    specs = program.graph_signature.input_specs
    free = {n for n, s in zip(placeholders, specs) if s.kind != InputKind.USER_INPUT}
    decisions: dict[torch.fx.Node, Decision] = {}
    pending: list[torch.fx.Node] = []
    for node in graph.nodes:
        if node.op == "get_attr":
            free.add(node)
        if node.op != "call_function" or is_structural(node):
            continue
        d = _fixed_rule(node, cfg, amax)
        if d is not None and d.rule == "constant":
            free.add(node)
        widest = packet_of(node.target) in WIDEST_TYPE_OPS
        if d is None and widest:
            d = _widest(node, cfg, decisions, free)
            if d is None:
                free.add(node)
                pending.append(node)
                continue
        if d is None:
            d = _last_rule(node, cfg)
        decisions[node] = d
    # Before follows_consumers: pending nodes are free (neutral as inputs) and never consume
    # a candidate (they read only free values), and they then follow the final decisions.
    _isolated_elementwise(decisions, free)
    # Consumers come later in topological order, so resolve free nodes back to front.
    for node in reversed(pending):
        decisions[node] = _follow_consumers(node, cfg, decisions)
    return {n: decisions[n] for n in graph.nodes if n in decisions}  # graph order
