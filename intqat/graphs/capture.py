"""extract(): the forward and backward FX graphs of one training step, as torch.compile sees them.

The step ``loss_fn(model(*inputs))`` runs once under torch.compile with a backend that is
aot_autograd with two recording "compilers": every graph the real inductor backend would
get is kept, none is compiled. Going through dynamo (not a bare aot_function trace) matters
for intqat: its modules branch on buffer values outside compiled regions
(`torch.compiler.is_compiling()`, observer flags), which only dynamo can trace; and custom
ops (torch.library) stay single opaque nodes, their fake implementation being all aot_autograd
calls. A graph break shows up as more than one region, each with its own forward/backward.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import GraphModule

from intqat.graphs.hashing import code_hash, readable_code
from intqat.graphs.step import LossFn, clone_inputs, train_step
from intqat.graphs.summary import INT_NAMESPACES, GraphSummary, summarize

FORWARD_FILE = "forward.py"
BACKWARD_FILE = "backward.py"
HASH_FILE = "graph_hash.txt"
SUMMARY_FILE = "summary.json"


@dataclass
class GraphPair:
    """One region dynamo compiled: its forward, and its backward if anything in it needs a grad."""

    forward: GraphModule
    backward: GraphModule | None
    input_labels: list[str]  # per forward placeholder: "param:fc.weight", "buffer:bn.running_var", "input[0]"


@dataclass
class GraphCapture:
    regions: list[GraphPair]  # in execution order; more than one means dynamo graph breaks
    forward_code: str  # every region's forward, annotated with dtypes and shapes
    backward_code: str
    graph_hash: str  # sha256 of the normalized forward + backward code
    summary: GraphSummary
    out_dir: Path | None = None

    @property
    def forward(self) -> GraphModule:
        return self._single().forward

    @property
    def backward(self) -> GraphModule | None:
        return self._single().backward

    def _single(self) -> GraphPair:
        if len(self.regions) != 1:
            raise ValueError(f"the step compiled to {len(self.regions)} regions (graph breaks): use .regions")
        return self.regions[0]

    def save(self, out_dir: str | Path) -> Path:
        """Write forward.py, backward.py, graph_hash.txt and summary.json into out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / FORWARD_FILE).write_text(self.forward_code)
        (out / BACKWARD_FILE).write_text(self.backward_code)
        (out / HASH_FILE).write_text(self.graph_hash + "\n")
        (out / SUMMARY_FILE).write_text(json.dumps(self.summary.to_dict(), indent=1) + "\n")
        self.out_dir = out
        return out


def extract(
    model: nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None = None,
    out_dir: str | Path | None = None,
    *,
    train: bool = False,
    int_namespaces: tuple[str, ...] = INT_NAMESPACES,
) -> GraphCapture:
    """Capture the forward and backward graphs of one training step of `model`.

    The loss is ``loss_fn(model(*inputs))``, or the fp32 sum of the output when loss_fn is
    None. The model is deep-copied and, by default, put in eval mode: BatchNorm reads its
    running statistics (buffers, never differentiated) and dropout is off. Modules that pick
    their path from ``self.training`` (intqat's IntLinear runs ``intqat::int_linear`` only in
    training) need ``train=True``. The caller's model and inputs are not touched.

    The partition is min-cut rematerialization, inductor's, so the saved-for-backward report
    is what a compiled training step holds. Ops in `int_namespaces` count as integer ops.
    Resets dynamo's caches (torch.compiler.reset()) so every region is really traced here.
    """
    model = copy.deepcopy(model).train(train)
    inputs = clone_inputs(example_inputs)
    grad_buffers = [name for name, b in model.named_buffers() if b.requires_grad]
    if grad_buffers:
        raise ValueError(f"buffers must not require grad: {grad_buffers}")

    recorded: list[dict[str, Any]] = []

    def backend(gm: GraphModule, example_inputs: list[Any]):
        region: dict[str, Any] = {"labels": _dynamo_input_labels(gm)}
        recorded.append(region)

        def recorder(kind: str):
            def compiler(graph: GraphModule, _example_inputs: Any):
                region[kind] = graph
                return make_boxed_func(graph.forward)
            return compiler

        return aot_autograd(
            fw_compiler=recorder("forward"),
            bw_compiler=recorder("backward"),
            partition_fn=min_cut_rematerialization_partition,
            # as inductor and aot_eager do: BN's running-stat updates stay in the graph
            keep_inference_input_mutations=True,
        )(gm, example_inputs)

    # A region served from an earlier call's cache would never reach `backend`.
    torch.compiler.reset()
    with torch._dynamo.config.patch(suppress_errors=False):
        _, loss = torch.compile(train_step, backend=backend, dynamic=False)(model, loss_fn, *inputs)
        if not loss.requires_grad:
            raise ValueError(
                "the loss does not require grad: no parameter or input is trainable"
                + ("" if train else " in eval mode (intqat's integer layers train only with train=True)")
            )
        loss.backward()  # backward graphs are compiled on first use
    torch.compiler.reset()  # drop the recording backend's cache entries
    if not recorded:
        raise RuntimeError("torch.compile produced no graph: the step ran entirely in eager")

    regions = [
        GraphPair(r["forward"], r.get("backward"), _aot_input_labels(r["forward"], r["labels"]))
        for r in recorded
    ]
    forward_code, backward_code = _joined_code(regions)
    capture = GraphCapture(
        regions=regions,
        forward_code=forward_code,
        backward_code=backward_code,
        graph_hash=code_hash(forward_code, backward_code),
        summary=summarize([(r.forward, r.backward, r.input_labels) for r in regions], int_namespaces),
    )
    if out_dir is not None:
        capture.save(out_dir)
    return capture


def _joined_code(regions: list[GraphPair]) -> tuple[str, str]:
    """One file per direction; region headers are comments, so they do not change the hash."""
    no_backward = "# no backward: nothing in this region needs a gradient\n"
    fw, bw = [], []
    for i, r in enumerate(regions):
        header = f"# region {i} of {len(regions)}\n" if len(regions) > 1 else ""
        fw.append(header + readable_code(r.forward))
        bw.append(header + (no_backward if r.backward is None else readable_code(r.backward)))
    return "\n".join(fw), "\n".join(bw)


# dynamo's source names: L['model']._modules['fc']._parameters['weight'], L['inputs'][0], ...
_ATTR = re.compile(r"\._(modules|parameters|buffers)\['([^']+)'\]")
_ROOT = re.compile(r"L\['([^']+)'\]")


def _source_label(source: str) -> str:
    """param:fc.weight, buffer:bn.running_var, input[0]; else dynamo's own source name."""
    root = _ROOT.match(source)
    if root is None:
        return source
    rest = source[root.end():]
    if root.group(1) == "inputs":
        return "input" + rest
    attrs = _ATTR.findall(rest)
    kinds = [kind for kind, _ in attrs]
    if "".join(m.group(0) for m in _ATTR.finditer(rest)) == rest and kinds and kinds[-1] != "modules" \
            and all(k == "modules" for k in kinds[:-1]):
        path = ".".join(name for _, name in attrs)
        # A region starting inside a submodule (after a graph break) names it `self`.
        prefix = "" if root.group(1) == "model" else root.group(1) + "."
        return f"{'param' if kinds[-1] == 'parameters' else 'buffer'}:{prefix}{path}"
    return source


def _dynamo_input_labels(gm: GraphModule) -> list[str]:
    labels = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        labels.append(_source_label(grapharg.source.name) if grapharg is not None else node.name)
    # aot_autograd lifts the dynamo graph's own parameters and buffers in front of its inputs.
    lifted = [f"param:{n}" for n, _ in gm.named_parameters()] + [f"buffer:{n}" for n, _ in gm.named_buffers()]
    return lifted + labels


def _aot_input_labels(forward: GraphModule, labels: list[str]) -> list[str]:
    placeholders = [n.name for n in forward.graph.nodes if n.op == "placeholder"]
    # Anything aot_autograd adds (effect tokens, ...) breaks the pairing: name them plainly.
    return labels if len(labels) == len(placeholders) else placeholders
