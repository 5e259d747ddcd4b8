"""Rebuild an ExportedProgram around the rewritten graph.

Why not re-export program.module(): a second torch.export re-traces every op, which costs
seconds, renames nodes (the report would not match the graph) and re-derives the state
dict from an nn.Module. Instead the new graph keeps every placeholder (same names, same
order), so the input specs carry over unchanged; only the output specs are renamed to the
casts that now feed the outputs, and the state dict / constants get the params stored in
low precision. The public ExportedProgram constructor validates the result (verifier,
signature) exactly as torch.export does.
"""

from __future__ import annotations

import copy

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from .rules import Decision, consumers

_STORED_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def castable_params(program: ExportedProgram, decisions: dict[torch.fx.Node, Decision]) -> dict[str, str]:
    """Placeholder name -> state-dict/constant key of fp32 params, buffers and constants
    whose every consumer runs in low precision: storing them low saves the cast and half
    the bytes. Mutated buffers keep their dtype (the program writes them back)."""
    sig = program.graph_signature
    mutated = {s.target for s in sig.output_specs
               if s.kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    by_target: dict[str, list[tuple[torch.fx.Node, bool]]] = {}
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind not in _STORED_KINDS or spec.target in mutated:
            continue
        val = node.meta.get("val")
        users = consumers(node)
        ok = (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and bool(users)
              and all(u in decisions and decisions[u].low for u in users))
        by_target.setdefault(spec.target, []).append((node, ok))
    # A tied weight appears under several placeholders: all of them must agree.
    return {n.name: t for t, entries in by_target.items() if all(ok for _, ok in entries)
            for n, _ in entries}


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    new = t.detach().to(dtype)
    if isinstance(t, torch.nn.Parameter):  # the verifier requires Parameters to stay Parameters
        return torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def cast_state(program: ExportedProgram, targets: set[str], dtype: torch.dtype):
    """(state_dict, constants) with `targets` stored in `dtype`; originals untouched."""
    state_dict, constants = dict(program.state_dict), dict(program.constants)
    for t in targets:
        if t in state_dict:
            state_dict[t] = _cast_tensor(state_dict[t], dtype)
        elif t in constants:  # non-persistent buffers and lifted tensor constants
            constants[t] = _cast_tensor(constants[t], dtype)
    return state_dict, constants


def stored_bytes(state_dict: dict, constants: dict) -> int:
    return sum(v.numel() * v.element_size() for v in [*state_dict.values(), *constants.values()]
               if isinstance(v, torch.Tensor))


def rebuild(program: ExportedProgram, graph: torch.fx.Graph, state_dict: dict,
            constants: dict) -> ExportedProgram:
    gm = torch.fx.GraphModule(program.graph_module, graph)  # shares HOP submodules (read-only)
    gm.meta.update(program.graph_module.meta)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = output.args[0]
    old_sig = program.graph_signature
    output_specs = [
        OutputSpec(s.kind, TensorArgument(name=o.name) if isinstance(s.arg, TensorArgument) else s.arg,
                   s.target)
        for s, o in zip(old_sig.output_specs, outputs)
    ]
    sig = ExportGraphSignature(input_specs=copy.deepcopy(old_sig.input_specs), output_specs=output_specs)
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=sig,
        state_dict=state_dict,
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )
