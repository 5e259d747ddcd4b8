"""The one training step that both `extract` and `validate` look at: loss = loss_fn(model(*inputs))."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

LossFn = Callable[[Any], torch.Tensor]


def default_loss(output: Any) -> torch.Tensor:
    """Sum of every floating tensor in a (possibly nested) output, in fp32.

    Integer leaves (codes, indices) carry no gradient, so they take no part in the loss.
    """
    leaves = [t for t in _tensor_leaves(output) if t.is_floating_point()]
    if not leaves:
        raise ValueError("model output holds no floating tensor: pass a loss_fn")
    loss = leaves[0].float().sum()
    for t in leaves[1:]:
        loss = loss + t.float().sum()
    return loss


def compute_loss(output: Any, loss_fn: LossFn | None) -> torch.Tensor:
    return default_loss(output) if loss_fn is None else loss_fn(output)


def train_step(model: nn.Module, loss_fn: LossFn | None, *inputs: Any) -> tuple[Any, torch.Tensor]:
    # Module-level (not a closure) so its code object is one dynamo cache key that
    # `validate` can clear; the model is an argument, guarded by type, not by identity.
    output = model(*inputs)
    return output, compute_loss(output, loss_fn)


def clone_inputs(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """detach().clone() every tensor so in-place ops in the model cannot touch the caller's data.

    requires_grad is kept: an input the caller wants a gradient for stays differentiable.
    """
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(one(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(one(v) for v in x)
        if isinstance(x, dict):
            return {k: one(v) for k, v in x.items()}
        return x

    return tuple(one(x) for x in inputs)


def _tensor_leaves(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensor_leaves(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensor_leaves(v)]
    return []
