"""data_max calibration: run the fp32 program on example inputs and record, per node, the
largest |value| it produced. A node whose range exceeds data_max stays fp32 (fp16
overflows at 65504; bf16 keeps the range but has ulp 4 at 512)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.export import ExportedProgram

from .ops import tensors


class _AmaxInterpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, amax: dict[str, float]):
        super().__init__(gm)
        self.amax = amax

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        for t in tensors(out):
            if t.is_floating_point() and t.numel() > 0:
                # Finite values only: -inf attention masks are meant to be inf and stay inf
                # in bf16/fp16; what data_max guards is a finite value growing past it.
                finite = t.detach()[torch.isfinite(t)]
                m = finite.abs().max().item() if finite.numel() else 0.0
                self.amax[n.name] = max(self.amax.get(n.name, 0.0), m)
        return out


def _positional_names(program: ExportedProgram) -> list[str]:
    """Names of forward()'s positional parameters, as exported."""
    in_spec = program.call_spec.in_spec  # TreeSpec of (args, kwargs)
    n_args = in_spec.child(0).num_children if in_spec is not None else 1
    root = next((e for e in program.module_call_graph if e.fqn == ""), None)
    names = list(getattr(root.signature, "forward_arg_names", None) or []) if root and root.signature else []
    return names[:n_args] if len(names) >= n_args else [f"arg{i}" for i in range(n_args)]


def _as_call(item: Any, names: list[str], index: int) -> tuple[tuple, dict]:
    """One calibration item as (args, kwargs): a tensor, an input tuple, an
    (inputs, labels) pair from a dataloader, or a dict of forward()'s arguments by name."""
    n_args = len(names)
    if isinstance(item, torch.Tensor):
        return (item,), {}
    if isinstance(item, dict):
        kwargs = dict(item)
        return tuple(kwargs.pop(n) for n in names if n in kwargs), kwargs
    if isinstance(item, (tuple, list)):
        if len(item) == n_args:
            return tuple(item), {}
        if item and isinstance(item[0], (tuple, list)) and len(item[0]) == n_args:
            return tuple(item[0]), {}  # (inputs, labels)
        if len(item) > n_args:
            return tuple(item[:n_args]), {}  # x, y from a TensorDataset
    raise TypeError(
        f"calibration_data item {index}: expected a tensor, a tuple of {n_args} inputs, an "
        f"(inputs, labels) pair or a dict of {names}, got {type(item).__name__}"
    )


@torch.no_grad()
def collect_amax(program: ExportedProgram, calibration_data: Iterable) -> dict[str, float]:
    """Node name -> max |value| over every calibration batch (float outputs only)."""
    names = _positional_names(program)
    amax: dict[str, float] = {}
    seen = 0
    for i, item in enumerate(calibration_data):
        args, kwargs = _as_call(item, names, i)
        # The lifted graph takes params/buffers/constants first, then the flat user inputs;
        # ExportedProgram knows that order, so ask it rather than rebuild it here.
        flat = program._graph_module_flat_inputs(args, kwargs)
        _AmaxInterpreter(program.graph_module, amax).run(*flat)
        seen += 1
    if seen == 0:
        raise ValueError("calibration_data is empty: give at least one batch, or None to skip data_max")
    return amax
