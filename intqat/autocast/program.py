"""Rebuild an ExportedProgram around the rewritten graph.

Why not re-export program.module(): a second torch.export re-traces every op, which costs
seconds, renames nodes (the report would not match the graph) and re-derives the state
dict from an nn.Module. Instead the new graph keeps every placeholder in the same order, so
the input specs carry over by position: their names are taken from the new placeholders (a
fresh fx.Graph renames a placeholder that shadows a Python builtin, nn.Sequential's `input`
becomes `input_1`); the output specs are renamed to the nodes that now feed the outputs
(casts back to the original dtype), and the state dict / constants get the params stored in
low precision. The public ExportedProgram constructor validates the result (verifier,
signature) exactly as torch.export does; it is what ExportedProgram._update calls, without
depending on a private method. Tensors that are not cast are shared with the input
program, as run_decompositions() shares them.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
)

from .rules import Decision, consumers

_STORED_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _stored(program: ExportedProgram, target: str):
    return program.state_dict.get(target, program.constants.get(target))


def castable_params(program: ExportedProgram, decisions: dict[torch.fx.Node, Decision]) -> dict[str, str]:
    """Placeholder name -> state-dict/constant key of fp32 params, buffers and constants
    whose every consumer runs in low precision: storing them low saves the cast and half
    the bytes. Mutated buffers keep their dtype (their in-place op is never low)."""
    sig = program.graph_signature
    mutated = {s.target for s in sig.output_specs
               if s.kind in (OutputKind.BUFFER_MUTATION, OutputKind.PARAMETER_MUTATION)}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    # Tied weights (head.weight is emb.weight) are one tensor under several placeholders,
    # some maybe unused: cast all of them or none, so they stay one tensor.
    groups: dict[int, list[tuple[torch.fx.Node, str]]] = {}
    for node, spec in zip(placeholders, sig.input_specs):
        tensor = _stored(program, spec.target) if spec.kind in _STORED_KINDS else None
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
            groups.setdefault(id(tensor), []).append((node, spec.target))
    out = {}
    for entries in groups.values():
        used = [n for n, _ in entries if consumers(n)]
        ok = bool(used) and not any(t in mutated for _, t in entries) and all(
            u in decisions and decisions[u].low for n in used for u in consumers(n))
        if ok:
            out.update({n.name: t for n, t in entries})
    return out


def _cast_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    new = t.detach().to(dtype)
    if isinstance(t, torch.nn.Parameter):  # the verifier requires Parameters to stay Parameters
        return torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def cast_state(program: ExportedProgram, targets: set[str], dtype: torch.dtype):
    """(state_dict, constants) with `targets` stored in `dtype`; originals untouched.
    One cast per tensor, so tied weights stay tied."""
    state_dict, constants = dict(program.state_dict), dict(program.constants)
    done: dict[int, torch.Tensor] = {}
    for t in sorted(targets):
        store = state_dict if t in state_dict else constants  # constants: non-persistent buffers
        old = store[t]
        store[t] = done.setdefault(id(old), _cast_tensor(old, dtype))
    return state_dict, constants


def stored_bytes(state_dict: dict, constants: dict) -> int:
    return sum(v.numel() * v.element_size() for v in [*state_dict.values(), *constants.values()]
               if isinstance(v, torch.Tensor))


def _renamed(arg, name: str):
    """The spec argument `arg` (TensorArgument, SymIntArgument, ConstantArgument, ...) naming
    node `name`; arguments without a name are returned as they are."""
    if dataclasses.is_dataclass(arg) and isinstance(getattr(arg, "name", None), str) and arg.name != name:
        return dataclasses.replace(arg, name=name)
    return arg


def _rename_all(args: list, names: dict[str, str]) -> list:
    return [_renamed(a, names[a.name]) if getattr(a, "name", None) in names else a for a in args]


def rebuild(program: ExportedProgram, graph: torch.fx.Graph, state_dict: dict,
            constants: dict) -> ExportedProgram:
    """`program` around `graph`, a copy of program.graph with the same placeholders in the
    same order (their names may differ) and the same outputs in the same order."""
    gm = torch.fx.GraphModule(program.graph_module, graph)  # shares HOP submodules (read-only)
    gm.meta.update(program.graph_module.meta)
    old_sig = program.graph_signature
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(old_sig.input_specs):
        raise ValueError(f"rebuild: the graph has {len(placeholders)} placeholders, the program "
                         f"{len(old_sig.input_specs)} input specs; they must match one to one")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outputs = output.args[0]
    # Old name -> new name of every placeholder: what a module call signature may name.
    old_placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    names = {o.name: n.name for o, n in zip(old_placeholders, placeholders) if o.name != n.name}
    input_specs = [dataclasses.replace(s, arg=_renamed(s.arg, n.name))
                   for s, n in zip(copy.deepcopy(old_sig.input_specs), placeholders)]
    output_specs = [
        OutputSpec(s.kind, _renamed(s.arg, o.name) if isinstance(o, torch.fx.Node) else s.arg, s.target)
        for s, o in zip(old_sig.output_specs, outputs)
    ]
    sig = ExportGraphSignature(input_specs=input_specs, output_specs=output_specs)
    with warnings.catch_warnings():
        # torch 2.13's own TreeSpec.__deepcopy__ path warns about its deprecated LeafSpec.
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        module_call_graph = copy.deepcopy(program.module_call_graph)
    for entry in module_call_graph:  # preserve_module_call_signature boundaries name nodes too
        if entry.signature is not None:
            entry.signature.inputs = _rename_all(entry.signature.inputs, names)
            entry.signature.outputs = _rename_all(entry.signature.outputs, names)
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=sig,
        state_dict=state_dict,
        range_constraints=copy.deepcopy(program.range_constraints),
        module_call_graph=module_call_graph,
        example_inputs=program.example_inputs,
        constants=constants,
        verifiers=program.verifiers,
    )
