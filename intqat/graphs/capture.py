"""extract(): the forward and backward FX graphs of one training step, through aot_autograd.

aot_function traces `loss_fn(model(*inputs))` with the model's parameters and buffers lifted
to graph inputs, and hands the partitioned forward and backward graphs to two recording
"compilers". No dynamo is involved, so there are no graph breaks and no cache to pollute:
one call gives exactly one forward and one backward graph. Custom ops (torch.library) stay
single opaque nodes because aot_autograd only ever calls their fake implementation.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from intqat.graphs.hashing import code_hash, readable_code
from intqat.graphs.step import LossFn, clone_inputs, compute_loss
from intqat.graphs.summary import INT_NAMESPACES, GraphSummary, summarize

FORWARD_FILE = "forward.py"
BACKWARD_FILE = "backward.py"
HASH_FILE = "graph_hash.txt"
SUMMARY_FILE = "summary.json"


@dataclass
class GraphCapture:
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    forward_code: str
    backward_code: str
    graph_hash: str  # sha256 of the normalized forward + backward code
    summary: GraphSummary
    input_labels: list[str]  # what each forward placeholder is: "param:fc.weight", "input:0", ...
    out_dir: Path | None = None

    def save(self, out_dir: str | Path) -> Path:
        """Write forward.py, backward.py, graph_hash.txt and summary.json into out_dir."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / FORWARD_FILE).write_text(self.forward_code)
        (out / BACKWARD_FILE).write_text(self.backward_code)
        (out / HASH_FILE).write_text(self.graph_hash + "\n")
        (out / SUMMARY_FILE).write_text(json.dumps(self.summary.to_dict(), indent=2) + "\n")
        self.out_dir = out
        return out


def extract(
    model: nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None = None,
    out_dir: str | Path | None = None,
    *,
    int_namespaces: tuple[str, ...] = INT_NAMESPACES,
) -> GraphCapture:
    """Capture the forward and backward graphs of one training step of `model`.

    The loss is ``loss_fn(model(*inputs))``, or the fp32 sum of the output when loss_fn is
    None. The model is deep-copied and put in eval mode, so BatchNorm reads its running
    statistics (buffers, never differentiated) and dropout is off; the caller's model and
    inputs are not touched. The partition is min-cut rematerialization, the one
    torch.compile's inductor uses, so the saved-for-backward report is what a compiled
    training step would hold. Ops in `int_namespaces` count as integer ops.
    """
    model = copy.deepcopy(model).eval()
    inputs = clone_inputs(example_inputs)
    grad_buffers = [name for name, b in model.named_buffers() if b.requires_grad]
    if grad_buffers:
        raise ValueError(f"buffers must not require grad in an eval capture: {grad_buffers}")

    # remove_duplicate=False like aot_module: a tied weight is reachable under every name.
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    names = list(params) + list(buffers)

    def step(param_list: list[torch.Tensor], buffer_list: list[torch.Tensor], *xs: Any) -> torch.Tensor:
        state = dict(zip(names, [*param_list, *buffer_list]))
        return compute_loss(torch.func.functional_call(model, state, xs), loss_fn)

    graphs: dict[str, torch.fx.GraphModule] = {}

    def recorder(kind: str):
        def compiler(gm: torch.fx.GraphModule, _example_inputs: Any):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    traced = aot_function(
        step,
        fw_compiler=recorder("forward"),
        bw_compiler=recorder("backward"),
        partition_fn=min_cut_rematerialization_partition,
        num_params_buffers=len(names),
    )
    loss = traced(list(params.values()), list(buffers.values()), *inputs)
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: no parameter or input is trainable")
    loss.backward()  # the backward graph is compiled on first use
    if "backward" not in graphs:
        raise RuntimeError("aot_autograd produced no backward graph")

    input_labels = (
        [f"param:{n}" for n in params] + [f"buffer:{n}" for n in buffers]
        + [f"input:{i}" for i in range(_num_placeholders(graphs["forward"]) - len(names))]
    )
    forward_code = readable_code(graphs["forward"])
    backward_code = readable_code(graphs["backward"])
    capture = GraphCapture(
        forward=graphs["forward"],
        backward=graphs["backward"],
        forward_code=forward_code,
        backward_code=backward_code,
        graph_hash=code_hash(forward_code, backward_code),
        summary=summarize(graphs["forward"], graphs["backward"], input_labels, int_namespaces),
        input_labels=input_labels,
    )
    if out_dir is not None:
        capture.save(out_dir)
    return capture


def _num_placeholders(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "placeholder" for n in gm.graph.nodes)
