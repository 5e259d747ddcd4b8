"""Compare two nested results (tensors in lists, tuples and dicts) leaf by leaf.

Every container level is checked too: a tuple that became a list, a missing dict key or a
shorter list is a difference at that path, not something a flatten silently glosses over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# Low-precision floats get at least torch.testing's default tolerances for their dtype.
_MIN_TOLERANCE = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


@dataclass(frozen=True)
class _Container:
    kind: str  # "tuple", "list", "dict", or a namedtuple's class name
    keys: tuple[Any, ...]  # indices, or the dict's keys in order


@dataclass(frozen=True)
class Diff:
    max_abs: float
    # max |actual - expected| / max |expected|: the error relative to the tensor's scale,
    # which stays meaningful where single elements of a gradient are (near) zero.
    max_rel: float
    within_tol: bool
    mismatch: str | None = None  # structure, dtype or shape: never within tolerance

    @staticmethod
    def broken(reason: str) -> Diff:
        return Diff(math.inf, math.inf, False, reason)


def flatten(value: Any, path: str) -> dict[str, Any]:
    """{path: leaf} with a _Container entry for every list, tuple and dict on the way."""
    if isinstance(value, torch.Tensor):
        return {path: value.detach()}
    if isinstance(value, dict):
        keys = tuple(value)
        items = [(f"{path}[{k!r}]", value[k]) for k in keys]
        kind = "dict"
    elif isinstance(value, (list, tuple)):
        keys = tuple(range(len(value)))
        items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        kind = type(value).__name__
    else:
        return {path: value}
    flat: dict[str, Any] = {path: _Container(kind, keys)}
    for sub_path, v in items:
        flat.update(flatten(v, sub_path))
    return flat


def leaves(value: Any, path: str) -> dict[str, Any]:
    """{path: leaf} without the container entries."""
    return {p: v for p, v in flatten(value, path).items() if not isinstance(v, _Container)}


_MISSING = object()


def compare(actual: Any, expected: Any, rtol: float, atol: float, path: str = "") -> dict[str, Diff]:
    """{path: Diff} for every leaf and container of either side."""
    flat_a, flat_e = flatten(actual, path), flatten(expected, path)
    diffs = {}
    for p in [*flat_e, *(p for p in flat_a if p not in flat_e)]:
        a, e = flat_a.get(p, _MISSING), flat_e.get(p, _MISSING)
        if a is _MISSING or e is _MISSING:
            diffs[p] = Diff.broken("missing in " + ("actual" if a is _MISSING else "expected"))
        else:
            diffs[p] = compare_leaf(a, e, rtol, atol)
    return diffs


def compare_leaf(actual: Any, expected: Any, rtol: float, atol: float) -> Diff:
    if isinstance(expected, _Container) or isinstance(actual, _Container):
        if actual == expected:
            return Diff(0.0, 0.0, True)
        return Diff.broken(f"structure {_describe(actual)} != {_describe(expected)}")
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            return Diff.broken(f"{type(actual).__name__} != {type(expected).__name__}")
        return compare_tensors(actual, expected, rtol, atol)
    if isinstance(expected, float) and isinstance(actual, float):
        return compare_tensors(torch.tensor(actual), torch.tensor(expected), rtol, atol)
    return Diff(0.0, 0.0, True) if actual == expected else Diff.broken(f"{actual!r} != {expected!r}")


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> Diff:
    """Integer and bool tensors must match exactly; floating ones within rtol/atol."""
    if actual.dtype != expected.dtype:
        return Diff.broken(f"dtype {actual.dtype} != {expected.dtype}")
    if actual.shape != expected.shape:
        return Diff.broken(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    exact = not (expected.is_floating_point() or expected.is_complex())
    if exact:
        rtol = atol = 0.0
    else:
        min_rtol, min_atol = _MIN_TOLERANCE.get(expected.dtype, (0.0, 0.0))
        rtol, atol = max(rtol, min_rtol), max(atol, min_atol)
    if expected.numel() == 0:
        return Diff(0.0, 0.0, True)
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    # Equal infinities and NaN where eager has NaN are agreement; any other NaN is
    # infinitely wrong.
    err = (a - e).abs().nan_to_num(nan=math.inf)
    err = torch.where((a == e) | (a.isnan() & e.isnan()), torch.zeros_like(err), err)
    max_abs = err.max().item()
    scale = e.abs().nan_to_num(nan=0.0, posinf=0.0).max().item()
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    within = bool((err <= atol + rtol * e.abs().nan_to_num(nan=0.0)).all())
    return Diff(max_abs, max_rel, within)


def _describe(leaf: Any) -> str:
    if isinstance(leaf, _Container):
        return f"{leaf.kind}{list(leaf.keys)}"
    return type(leaf).__name__
