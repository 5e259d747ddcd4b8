"""Saved-for-backward bytes: what autograd keeps alive between a forward and its backward.

Every tensor autograd packs while `fn` runs (torch.autograd.graph.saved_tensors_hooks) is counted
once per storage (a view and its base, or one tensor saved by two nodes, cost one storage), and
parameters are left out: they live with the model whether or not a backward follows. Tensor
subclasses (e.g. torchao's weight wrappers) are counted through the plain tensors they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

__all__ = ["saved_bytes", "plain_tensors", "storage_key"]


def plain_tensors(t: Tensor) -> list[Tensor]:
    """The plain tensors holding t's data: t itself, or a wrapper subclass's inner tensors."""
    if type(t) in (Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[Tensor] = []
    for n in names:
        out.extend(plain_tensors(getattr(t, n)))
    return out


def storage_key(t: Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of t's storage; None for tensors without one (meta, empty)."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if st.nbytes() == 0:
        return None
    return st.data_ptr(), st.nbytes()


def saved_bytes(fn: Callable[[], object], exclude: Iterable[Tensor] = ()) -> tuple[int, object]:
    """-> (bytes saved for backward while fn() runs, fn's result). `exclude`: parameters."""
    excluded = {k[0] for p in exclude for t in plain_tensors(p) if (k := storage_key(t)) is not None}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        for leaf in plain_tensors(t):
            k = storage_key(leaf)
            if k is not None and k[0] not in excluded:
                seen[k[0]] = max(seen.get(k[0], 0), k[1])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(seen.values()), result
