"""convert(): rule-based mixed precision for an exported intqat program.

.. code-block:: python

    ep = torch.export.export(model.eval(), (x,))
    ep_bf16, report = intqat.autocast.convert(ep, calibration_data=[(x,)])
    print(report.to_markdown())
    torch.export.save(ep_bf16, "model_bf16.pt2")

Pipeline: check the arguments (AutocastConfig), optionally run the fp32 program on the
calibration data (data_max), classify every node (rules.py), decide which params can be
stored low, insert casts (casts.py), rebuild the ExportedProgram (program.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch.export import ExportedProgram

from .calibrate import collect_amax
from .casts import insert_casts
from .config import AutocastConfig
from .ops import target_name
from .program import castable_params, cast_state, rebuild, stored_bytes
from .report import AutocastReport, NodeDecision
from .rules import Decision, classify, is_structural


def _report_nodes(program: ExportedProgram, decisions: dict[torch.fx.Node, Decision]) -> list[NodeDecision]:
    rows = []
    for node, d in decisions.items():
        rows.append(NodeDecision(node.name, target_name(node.target), d.precision, d.rule))
        if isinstance(node.target, HigherOrderOperator):
            # The region's own ops are not rewritten; list them so the report shows them.
            for arg in node.args:
                sub = getattr(program.graph_module, arg.target, None) \
                    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" else None
                if isinstance(sub, torch.fx.GraphModule):
                    rows += [NodeDecision(f"{node.name}/{n.name}", target_name(n.target), d.precision, d.rule)
                             for n in sub.graph.nodes if n.op == "call_function" and not is_structural(n)]
    return rows


def convert(
    program: ExportedProgram,
    *,
    low_precision_type: torch.dtype = torch.bfloat16,
    calibration_data: Iterable | None = None,
    nodes_to_exclude: Iterable[str] = (),
    targets_to_exclude: Iterable[Any] = (),
    fp32_ops: Iterable[Any] | None = None,
    low_precision_ops: Iterable[Any] | None = None,
    conditional_fp32_ops: Iterable[tuple] = (),
    data_max: float = 512.0,
    max_depth_of_reduction: int | None = None,
    cast_optional_params: bool = True,
    integer_module_types: Iterable[str] = ("IntLinear", "IntConv2d"),
) -> tuple[ExportedProgram, AutocastReport]:
    """A new ExportedProgram whose float ops run in `low_precision_type` except where a
    rule keeps them in fp32, and the report of every decision. `program` is not modified.

    Ops are named as aten overloads (torch.ops.aten.softmax.int), packets (every overload:
    torch.ops.aten.softmax) or strings ("aten.softmax.int", "aten.softmax", "softmax").
    nodes_to_exclude are regexes searched in node names (anchor them: "^linear$").
    conditional_fp32_ops: [(op, argument_name, values)], e.g.
    [(torch.ops.aten.gelu.default, "approximate", ["tanh"])].
    calibration_data: a list of input tuples, or any iterable/dataloader of tensors,
    input tuples or (inputs, labels); data_max is only applied when it is given.

    Run it on the program torch.export.export returns: torch.autocast regions are visible
    there as wrap_with_autocast nodes. After run_decompositions() they are inlined and only
    node provenance (meta["from_node"], lost by torch.export.save) still marks them.
    """
    if not isinstance(program, ExportedProgram):
        raise TypeError(
            f"program must be a torch.export.ExportedProgram, got {type(program).__name__}; "
            "export first: convert(torch.export.export(model, (x,)))"
        )
    cfg = AutocastConfig(
        low_precision_type=low_precision_type, calibration_data=calibration_data,
        nodes_to_exclude=nodes_to_exclude, targets_to_exclude=targets_to_exclude,
        fp32_ops=fp32_ops, low_precision_ops=low_precision_ops,
        conditional_fp32_ops=conditional_fp32_ops, data_max=data_max,
        max_depth_of_reduction=max_depth_of_reduction, cast_optional_params=cast_optional_params,
        integer_module_types=integer_module_types,
    )
    amax = collect_amax(program, cfg.calibration_data) if cfg.calibration_data is not None else None
    decisions = classify(program, cfg, amax)

    to_cast = castable_params(program, decisions) if cfg.cast_optional_params else {}
    low = cfg.low_precision_type
    graph, n_casts = insert_casts(program.graph_module, decisions, low, set(to_cast))
    state_dict, constants = cast_state(program, set(to_cast.values()), low)
    converted = rebuild(program, graph, state_dict, constants)

    report = AutocastReport(
        low_precision_type=cfg.low_name,
        nodes=_report_nodes(program, decisions),
        cast_params=sorted(set(to_cast.values())),
        casts_inserted=n_casts,
        stored_bytes_before=stored_bytes(program.state_dict, program.constants),
        stored_bytes_after=stored_bytes(state_dict, constants),
    )
    return converted, report
