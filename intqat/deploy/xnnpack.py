"""What XNNPACK's partitioner needs of a Q/DQ program (intqat.deploy.qdq) beyond the Q/DQ form itself.

Two passes on the exported (ATen) program, run before `to_edge_transform_and_lower`:

`requantize_static_outputs`: XNNPACK's static int8 GEMM (qs8 input, qc8w / qc4w weights) writes int8: its
partitioner takes `dq -> linear / conv2d [-> relu / hardtanh] -> q` only (gemm_configs.py: "Expected output node
to have a dequantized node"). intqat's integer layers write fp32 (docs/numerics.md). Each static GEMM whose output is
not quantized already gets a quantize -> dequantize on its output:
  - on the next layer's own input grid when the output reaches static integer layers with one grid through ops
    that commute with quantization (relu, max_pool2d, views, permutes: q is monotone and works on each element
    alone): the next layer sees the codes it sees in the integer model, exactly; float ops that read the same
    output get a rounding of up to s/2 (the grid intqat observed on this very tensor);
  - otherwise (float ops only, or layers on different grids) on an int8 grid observed on the calibration data
    (min-max, asymmetric, torch.ao's rule): a rounding of up to s/2 the integer model does not have.
  Named, with the grid, in the census.
`model_output_layers` finds the static layers whose output is the model's output: intqat.deploy.executorch gives
those their weight dequantized at export instead (an fp32 GEMM in XNNPACK on the quantized input: the fp32 logits
of the integer model, to float rounding, where int8 logits could swap a near tie).

`mark_dynamic_convs`: intqat's dynamic conv quantizes the whole batch with one symmetric scale; XNNPACK quantizes
each image's activations itself at run time (asymmetric, per image) and recognises only XNNPACKQuantizer's
per-tensor marker `choose_qparams.tensor -> quantize_per_tensor.tensor -> dequantize_per_tensor.tensor` in front
of a conv (per-tensor affine ops fail its per-token check). The pass rewrites the marker; the runtime's codes are
its own either way.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

__all__ = ["OutputGrid", "requantize_static_outputs", "model_output_layers", "mark_dynamic_convs", "layer_of"]

aten = torch.ops.aten

# q(f(y)) = f(q(y)) on int8 codes for these (monotone elementwise, max over windows, pure data movement)
_TRANSPARENT = {
    aten.relu.default, aten.max_pool2d.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.flatten.using_ints, aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.alias.default, aten.detach.default,
}
_FUSED_ACTIVATIONS = {aten.relu.default, aten.hardtanh.default}  # XNNPACK fuses these between the GEMM and its q
_GEMMS = {aten.linear.default, aten.conv2d.default}


@dataclass
class OutputGrid:
    """The int8 grid a static layer's output was requantized to, and why."""

    layer: str
    scale: float
    zero_point: int
    exact: bool  # True: the consumer's own input grid (no added rounding)
    reason: str


def layer_of(node: torch.fx.Node, layers: Iterable[str]) -> str | None:
    """The innermost of `layers` (module paths) whose module computed node (nn_module_stack), or None."""
    names = set(layers)
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in reversed(list(stack.values())):
        path = path.removeprefix("L['self'].")
        if path in names:
            return path
    return None


def _ops():
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (torch.ops.quantized_decomposed)
    import torchao.quantization.quant_primitives  # noqa: F401  (torch.ops.torchao: the Q/DQ form's dynamic ops)

    return torch.ops.quantized_decomposed


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == target


def _static_gemms(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    qd = _ops()
    weight_dq = {qd.dequantize_per_channel.default, torch.ops.torchao.dequantize_affine.default}
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _GEMMS
            and _is(n.args[0], qd.dequantize_per_tensor.default)
            and isinstance(n.args[1], torch.fx.Node) and n.args[1].target in weight_dq]


def _output_value(gemm: torch.fx.Node) -> torch.fx.Node:
    users = list(gemm.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _FUSED_ACTIVATIONS:
        return users[0]
    return gemm


def _terminals(value: torch.fx.Node) -> list[torch.fx.Node]:
    """The first users of value that are not transparent (through chains of transparent ones)."""
    out, seen, todo = [], set(), list(value.users)
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "call_function" and u.target in _TRANSPARENT:
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def _describe(node: torch.fx.Node) -> str:
    return "the model's output" if node.op == "output" else f"{node.target}" if node.op == "call_function" else node.name


class _Ranges(torch.fx.Interpreter):
    """Runs the program and keeps the min / max of the named nodes' values."""

    def __init__(self, module, names: set[str]):
        super().__init__(module)
        self.names, self.ranges = names, {}

    def call_function(self, target, args, kwargs):
        # a view of a permuted tensor is valid in the edge dialect (view_copy) but not always in eager, where the
        # strides decide: intqat.deploy.xnnpack_graph's attention leaves one. reshape gives the same values.
        if target is aten.view.default:
            target = aten.reshape.default
        return super().call_function(target, args, kwargs)

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor) and out.numel():
            lo, hi = (float(v) for v in torch.aminmax(out.detach().float()))
            old = self.ranges.get(n.name)
            self.ranges[n.name] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        return out


def _observe(program: ExportedProgram, names: set[str], batches: list[tuple]) -> dict[str, tuple[float, float]]:
    if not batches:
        raise ValueError("requantize_static_outputs: the calibration data yielded no batch")
    module = program.module()
    interp = _Ranges(module, names)
    with torch.no_grad():
        for args in batches:
            interp.run(*args)
    return interp.ranges


def model_output_layers(program: ExportedProgram, layers: Iterable[str]) -> list[str]:
    """The static layers whose output reaches only the model's output (through transparent ops): requantized for
    XNNPACK they would hand back int8-rounded logits, which can swap a near tie of the top two."""
    layers = list(layers)
    out = []
    for gemm in _static_gemms(program.graph):
        ends = _terminals(_output_value(gemm))
        if ends and all(t.op == "output" for t in ends):
            name = layer_of(gemm, layers)
            if name is not None:
                out.append(name)
    return out


def requantize_static_outputs(program: ExportedProgram, layers: Iterable[str],
                              calibration: list[tuple] | None) -> list[OutputGrid]:
    """Give every static GEMM of `program` an output quantize -> dequantize (module docstring); in place.
    layers: the Q/DQ layers' module paths (for the names); calibration: input tuples for the observed grids."""
    from intqat.ops.qparams import scale_zero_point_scalar

    qd = _ops()
    layers = list(layers)
    graph = program.graph
    plans = []  # (gemm, value, grid args or None, reason)
    for gemm in _static_gemms(graph):
        value = _output_value(gemm)
        users = list(value.users)
        if len(users) == 1 and _is(users[0], qd.quantize_per_tensor.default):
            # quantized already: the next layer's input, or a chained producer's own grid
            plans.append((gemm, value, tuple(users[0].args[1:5]), "the next layer's input grid, directly (exact)"))
            continue
        ends = _terminals(value)
        grids = {tuple(t.args[1:5]) for t in ends if _is(t, qd.quantize_per_tensor.default)}
        floats = sorted({_describe(t) for t in ends if not _is(t, qd.quantize_per_tensor.default)})
        if len(grids) == 1 and not floats:
            plans.append((gemm, value, next(iter(grids)), "the next layer's input grid (exact)"))
        elif len(grids) == 1:
            # The next layer's grid, observed by intqat on this very tensor, for every consumer: a float consumer
            # gets the rounding, the next layer its own codes. (A calibrated grid here would leave a requantization
            # from one grid to another behind a permute, which XNNPACK's static transpose refuses at load time:
            # "Failed to create static transpose node ... xnn_status_invalid_parameter", seen with attention.)
            plans.append((gemm, value, next(iter(grids)), f"the next layer's input grid, which also feeds "
                          f"{', '.join(floats)} (exact for the next layer; a rounding of up to s/2 for the rest)"))
        else:
            why = f"feeds {', '.join(floats)}" if floats else "feeds layers on different grids"
            plans.append((gemm, value, None, why))
    todo = {v.name for _, v, grid, _ in plans if grid is None}
    ranges = {}
    if todo:
        if not calibration:
            names = ", ".join(str(layer_of(g, layers)) for g, _, grid, _ in plans if grid is None)
            raise ValueError(f"the static layers {names} write float outputs into float ops: XNNPACK's static int8 "
                             "GEMM writes int8, so their outputs need an int8 grid observed on data; pass "
                             "calibration_data")
        ranges = _observe(program, todo, calibration)
    grids = []
    for gemm, value, grid, why in plans:
        name = layer_of(gemm, layers) or gemm.name
        if grid is None:
            lo, hi = ranges[value.name]
            s, z = scale_zero_point_scalar(lo, hi, -128, 127, symmetric=False)
            grid = (float(s), int(z), -128, 127)
            grids.append(OutputGrid(name, grid[0], grid[1], False,
                                    f"{why}: int8 grid observed on the calibration data, range [{lo:.4g}, {hi:.4g}]"))
        else:
            grids.append(OutputGrid(name, float(grid[0]), int(grid[1]), why.endswith("(exact)"), why))
            if "directly" in why:
                continue  # (its q is there already)
        _insert_qdq(graph, gemm, value, grid)
    program.graph_module.recompile()
    return grids


def _insert_qdq(graph: torch.fx.Graph, gemm: torch.fx.Node, value: torch.fx.Node, grid: tuple) -> None:
    """value -> q -> dq, one dq per user (PT2E's duplicated dequantize): XNNPACK tags a dq quantized for the op that
    takes it, and a dq shared with an fp32 op made that op's input int8 (XNNAdd refused at load time, seen with a
    residual add and a transposed branch)."""
    qd = _ops()
    s, z, qmin, qmax = grid
    users = [u for u in value.users]
    with graph.inserting_after(value):
        q = graph.call_function(qd.quantize_per_tensor.default, (value, s, z, qmin, qmax, torch.int8))
    val = value.meta["val"]
    q.meta["val"] = torch.empty_like(val, dtype=torch.int8)
    q.meta["nn_module_stack"] = gemm.meta.get("nn_module_stack", {})
    for user in users:
        with graph.inserting_after(q):
            dq = graph.call_function(qd.dequantize_per_tensor.default, (q, s, z, qmin, qmax, torch.int8))
        dq.meta["val"] = torch.empty_like(val, dtype=torch.float32)
        dq.meta["nn_module_stack"] = gemm.meta.get("nn_module_stack", {})
        user.replace_input_with(value, dq)


def mark_dynamic_convs(program: ExportedProgram) -> int:
    """Rewrite the per-tensor dynamic Q/DQ in front of convs to XNNPACKQuantizer's marker (module docstring);
    in place. Returns how many."""
    qd, ao = _ops(), torch.ops.torchao
    graph, n = program.graph, 0
    for conv in [c for c in graph.nodes if _is(c, aten.conv2d.default)]:
        dq = conv.args[0]
        if not _is(dq, ao.dequantize_affine.default):
            continue
        q = dq.args[0]
        s_item, z_item = dq.args[2], dq.args[3]
        if not (_is(q, ao.quantize_affine.default) and _is(s_item, operator.getitem)):
            continue
        choose = s_item.args[0]
        x, qmin, qmax, eps = choose.args[0], choose.args[4], choose.args[5], choose.args[6]
        with graph.inserting_before(choose):
            choose2 = graph.call_function(qd.choose_qparams.tensor, (x, qmin, qmax, eps, torch.int8))
            s2 = graph.call_function(operator.getitem, (choose2, 0))
            z2 = graph.call_function(operator.getitem, (choose2, 1))
            q2 = graph.call_function(qd.quantize_per_tensor.tensor, (x, s2, z2, qmin, qmax, torch.int8))
            dq2 = graph.call_function(qd.dequantize_per_tensor.tensor, (q2, s2, z2, qmin, qmax, torch.int8))
        xv = x.meta["val"]  # (fake tensors: the ops compute the outputs' metadata)
        choose2.meta["val"] = sv = qd.choose_qparams.tensor(xv, qmin, qmax, eps, torch.int8)
        s2.meta["val"], z2.meta["val"] = sv
        q2.meta["val"] = qd.quantize_per_tensor.tensor(xv, sv[0], sv[1], qmin, qmax, torch.int8)
        dq2.meta["val"] = qd.dequantize_per_tensor.tensor(q2.meta["val"], sv[0], sv[1], qmin, qmax, torch.int8)
        for node in (choose2, s2, z2, q2, dq2):
            node.meta["nn_module_stack"] = conv.meta.get("nn_module_stack", {})
        dq.replace_all_uses_with(dq2)
        for dead in (dq, q, s_item, z_item, choose):
            if not dead.users:
                graph.erase_node(dead)
        n += 1
    if n:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return n
