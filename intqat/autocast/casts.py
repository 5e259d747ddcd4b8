"""Cast pass: copy the graph node by node and give each node its inputs in the dtype its
Decision asks for, through aten._to_copy casts.

- one cast per (value, dtype): every consumer wanting x in bf16 shares one cast node;
- a low node takes its fp32 inputs in the low type; every other node takes each input in
  the dtype it had before conversion, so fp32 and integer nodes compute what they did;
- graph outputs are cast back to their original dtype (the program's signature is kept);
- meta["val"] of a node whose input dtypes changed is recomputed by running the op on its
  fake inputs, so later passes, .module() and torch.export.save see the real dtypes.

The input graph is never modified: the pass builds a new one.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from .ops import arg_value, aten, node_dtype, tensors, with_arg
from .rules import Decision, is_structural

CAST_MARK = "intqat_autocast"  # meta key on the casts this pass inserts
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def set_val(node: torch.fx.Node, val) -> None:
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        node.meta.pop("tensor_meta", None)


def _dtypes(node: torch.fx.Node) -> list[torch.dtype]:
    return [t.dtype for t in tensors(node.meta.get("val"))]


def is_inserted_cast(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get(CAST_MARK) == "cast"


class _CastBuilder:
    def __init__(self, gm: torch.fx.GraphModule, decisions: dict[torch.fx.Node, Decision],
                 low: torch.dtype, cast_placeholders: set[str]):
        self.old = gm.graph
        self.decisions = decisions
        self.low = low
        self.cast_placeholders = cast_placeholders
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        # Old names not yet copied must stay free, so inserted casts never rename them.
        self.taken = {n.name for n in self.old.nodes}
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in self.old.nodes])

    def _free_name(self, base: str, bare: bool = True) -> str:
        """`base` (if bare) or the first `base_i` (i >= 1) that no old or new node has."""
        name, i = (base, 1) if bare else (f"{base}_1", 2)
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def _cast_name(self, src: torch.fx.Node, dtype: torch.dtype) -> str:
        return self._free_name(f"{src.name}_{SHORT.get(dtype, str(dtype).split('.')[-1])}")

    def _copy_placeholder(self, node: torch.fx.Node) -> torch.fx.Node:
        """A fresh fx.Graph renames a placeholder that shadows a builtin or keyword
        (nn.Sequential's `input`) to `input_1`, which may be a later input's name: pick a
        name no old node has, so every other node keeps its name. rebuild() renames the
        input specs to match, by position."""
        if torch.fx.Graph().placeholder(node.name).name == node.name:
            return self.graph.node_copy(node)
        new = self.graph.create_node("placeholder", node.target, node.args, node.kwargs,
                                     name=self._free_name(node.name, bare=False), type_expr=node.type)
        new.meta = copy.copy(node.meta)
        return new

    def value(self, old: torch.fx.Node, want: torch.dtype | None, consumer: torch.fx.Node) -> torch.fx.Node:
        """The new-graph value of `old`, in dtype `want` (None: as it is)."""
        new = self.env[old]
        cur = node_dtype(new)
        if want is None or cur is None or cur == want or not cur.is_floating_point:
            return new
        key = (old, want)
        if key not in self.casts:
            cast = self.graph.call_function(aten._to_copy.default, (new,), {"dtype": want},
                                            name=self._cast_name(old, want))
            with self.fake_mode:
                set_val(cast, aten._to_copy.default(new.meta["val"], dtype=want))
            stack = consumer.meta.get("nn_module_stack") or old.meta.get("nn_module_stack")
            if stack is not None:
                cast.meta["nn_module_stack"] = dict(stack)
            cast.meta[CAST_MARK] = "cast"
            self.casts[key] = cast
        return self.casts[key]

    def _want(self, node: torch.fx.Node) -> Callable[[torch.fx.Node], torch.dtype | None]:
        if node.op == "output":
            return node_dtype
        if node.op != "call_function" or is_structural(node):
            return lambda a: None
        d = self.decisions[node]
        if d.rule == "explicit_cast":
            return lambda a: None  # x.to(dtype) takes x as it comes
        if d.low:
            return lambda a: self.low if node_dtype(a) == torch.float32 else node_dtype(a)
        return node_dtype

    def _copy(self, node: torch.fx.Node) -> torch.fx.Node:
        if node.op == "placeholder":
            return self._copy_placeholder(node)
        want = self._want(node)
        changed = False

        def transform(a: torch.fx.Node) -> torch.fx.Node:
            nonlocal changed
            v = self.value(a, want(a), node)
            changed |= _dtypes(v) != _dtypes(a)  # all outputs: getitem of a low max.dim too
            return v

        new = self.graph.node_copy(node, transform)
        if node.op == "call_function" and changed:
            self._refresh(node, new)
        return new

    def _refresh(self, old: torch.fx.Node, new: torch.fx.Node) -> None:
        if old.target is aten._assert_tensor_metadata.default:
            # It asserts the dtype export saw; the input now legitimately has another one.
            if arg_value(new, "dtype") is not None:
                with_arg(new, "dtype", node_dtype(new.args[0]))
            return
        if not isinstance(old.meta.get("val"), (torch.Tensor, tuple, list)):
            return  # sym_size and friends: a SymInt does not depend on dtype
        args, kwargs = torch.fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta.get("val"))
        if new.target is operator.getitem:
            set_val(new, args[0][args[1]])
            return
        with self.fake_mode:
            set_val(new, new.target(*args, **kwargs))

    def build(self) -> torch.fx.Graph:
        for node in self.old.nodes:
            new = self._copy(node)
            if node.op == "placeholder" and node.name in self.cast_placeholders:
                with self.fake_mode:
                    set_val(new, aten._to_copy.default(node.meta["val"], dtype=self.low))
            self.env[node] = new
        return self.graph


def insert_casts(gm: torch.fx.GraphModule, decisions: dict[torch.fx.Node, Decision],
                 low: torch.dtype, cast_placeholders: set[str]) -> tuple[torch.fx.Graph, int]:
    """New graph with casts; cast_placeholders are params stored in `low` from now on."""
    builder = _CastBuilder(gm, decisions, low, cast_placeholders)
    graph = builder.build()
    remove_redundant_casts(graph)
    graph.lint()
    alive = set(graph.nodes)
    return graph, sum(1 for c in builder.casts.values() if c in alive)


_WIDER = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
          torch.float32: (torch.float64,)}


def _exact_widening(node: torch.fx.Node) -> bool:
    """A dtype-only cast to a type that holds every value of its input (bf16 -> fp32):
    narrowing its result back to the input type gives the input bit for bit."""
    if node.op != "call_function" or node.target not in (aten._to_copy.default, aten.to.dtype):
        return False
    if node.target is aten._to_copy.default and (len(node.args) != 1 or set(node.kwargs) != {"dtype"}):
        return False
    src = node.args[0]
    return isinstance(src, torch.fx.Node) and node_dtype(node) in _WIDER.get(node_dtype(src), ())


def remove_redundant_casts(graph: torch.fx.Graph) -> int:
    """Collapse chains of inserted casts and drop no-op ones; returns how many went.

    cast(cast(x, bf16), fp32) -> x and cast(cast(x, bf16), fp16) -> cast(x, fp16): the
    intermediate rounding was ours, not the model's. Through a user's cast only when it is
    exact: cast(x_bf16.to(fp32), bf16) -> x_bf16. A user's own x.to(bf16) is intent (it
    may simulate rounding) and is never removed.
    """
    removed = 0
    first: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
    for node in list(graph.nodes):
        if not is_inserted_cast(node):
            continue
        dtype = node.kwargs["dtype"]
        src = node.args[0]
        while is_inserted_cast(src) or (_exact_widening(src) and node_dtype(src.args[0]) == dtype):
            src = src.args[0]
        node.args = (src,)
        if node_dtype(src) == dtype:
            node.replace_all_uses_with(src)
        elif (src, dtype) in first:  # a collapsed chain can duplicate an existing cast
            node.replace_all_uses_with(first[(src, dtype)])
        else:
            first[(src, dtype)] = node
    for node in reversed(list(graph.nodes)):
        if is_inserted_cast(node) and not node.users:
            graph.erase_node(node)
            removed += 1
    return removed
