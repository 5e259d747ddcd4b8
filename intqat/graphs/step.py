"""The one training step that both `extract` and `validate` look at: loss = loss_fn(model(*inputs))."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in a (possibly nested) output, in fp32.

    Integer leaves (codes, indices) carry no gradient, so they take no part in the loss.
    """
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("model output holds no floating tensor: pass a loss_fn")
    loss = leaves[0].float().sum()
    for t in leaves[1:]:
        loss = loss + t.float().sum()
    return loss


def compute_loss(output: Any, loss_fn: LossFn | None) -> torch.Tensor:
    return default_loss(output) if loss_fn is None else loss_fn(output)


def train_step(model: nn.Module, loss_fn: LossFn | None, *inputs: Any) -> tuple[Any, torch.Tensor]:
    # The model is an argument: dynamo guards its type and treats its parameters as inputs,
    # so a fresh deep copy per run reuses the compiled code instead of recompiling.
    output = model(*inputs)
    return output, compute_loss(output, loss_fn)


def clone_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """detach().clone() every tensor so in-place ops in the model cannot touch the caller's data.

    requires_grad is kept: an input the caller wants a gradient for stays differentiable.
    """
    return pytree.tree_map_only(
        torch.Tensor, lambda x: x.detach().clone().requires_grad_(x.requires_grad), tuple(inputs)
    )


def input_leaves(inputs: Sequence[Any]) -> list[tuple[str, Any]]:
    """[("[0][1]", leaf), ...]: every leaf of the inputs, in the order aot_autograd flattens them."""
    flat, _ = pytree.tree_flatten_with_path(tuple(inputs))
    return [(pytree.keystr(path), leaf) for path, leaf in flat]
