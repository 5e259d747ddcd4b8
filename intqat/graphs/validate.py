"""validate(): does a torch.compile'd training step match eager, beyond eager's own noise?

Eager runs the step a few times first; how far those runs differ from each other is the
fluctuation the model has without any compiler. A compiled result outside rtol/atol but
within that fluctuation (times a margin) is reported as "fluctuation", not as a failure.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._inductor.config
from torch import nn

from intqat.graphs.compare import Diff, compare, leaves
from intqat.graphs.step import LossFn, clone_inputs, input_leaves, train_step

# Worst last: a trial's status is the worst status of its tensors.
_SEVERITY = {"pass": 0, "fluctuation": 1, "fail": 2, "error": 3}


@dataclass
class TensorReport:
    name: str  # "output[0]", "loss", "grad.fc.weight", "buffer.bn.running_mean", ...
    dtype: str
    shape: tuple[int, ...]
    # From the worst trial (highest status, then largest error):
    max_abs: float
    max_rel: float  # max_abs / max |eager|
    status: str
    eager_fluctuation: float  # largest difference between the eager runs
    note: str = ""  # why a structure, dtype or shape mismatch failed


@dataclass
class ValidationResult:
    backend: str
    rtol: float
    atol: float
    trial_status: list[str]  # "pass", "fluctuation", "fail" or "error", one per trial run
    tensors: list[TensorReport]
    errors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.trial_status) and all(s in ("pass", "fluctuation") for s in self.trial_status)

    @property
    def status(self) -> str:
        return max(self.trial_status, key=_SEVERITY.__getitem__, default="error")

    def to_table(self) -> str:
        counts = ", ".join(f"{s} {self.trial_status.count(s)}" for s in _SEVERITY if s in self.trial_status)
        lines = [
            f"backend={self.backend} trials={len(self.trial_status)} rtol={self.rtol:g} atol={self.atol:g}: "
            f"{'PASSED' if self.passed else 'FAILED'} ({counts or 'no trial ran'})",
            f"{'tensor':<36} {'dtype':<9} {'shape':<16} {'max_abs':>10} {'max_rel':>10} {'eager_fluct':>11}  status",
        ]
        for t in self.tensors:
            lines.append(
                f"{t.name:<36} {t.dtype:<9} {str(list(t.shape)):<16} {t.max_abs:>10.3e} {t.max_rel:>10.3e} "
                f"{t.eager_fluctuation:>11.3e}  {t.status}{'  ' + t.note if t.note else ''}"
            )
        lines += [f"error: {e}" for e in self.errors]
        return "\n".join(lines)


def validate(
    model: nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None = None,
    trials: int = 10,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    fluctuation_threshold: float | None = None,
    backend: str | Callable[..., Any] = "inductor",
    *,
    train: bool = False,
    eager_runs: int = 2,
    fluctuation_margin: float = 2.0,
    seed: int = 0,
    fullgraph: bool = False,
) -> ValidationResult:
    """Compare `trials` compiled training steps against eager, output and every gradient.

    Each run (eager or compiled) gets a fresh deep copy of the model, fresh clones of the
    inputs and ``torch.manual_seed(seed)``, so no state drifts between runs. A run compares
    the output (nested lists/tuples/dicts, every level), the loss, every parameter's grad,
    the grads of inputs that require grad, and every buffer after the step.

    A difference outside rtol/atol (integer tensors: exact) is "fluctuation" when it is at
    most ``max(fluctuation_margin * eager_fluctuation, fluctuation_threshold or 0)`` for that
    tensor, else "fail". eval mode by default, matching `extract`; train=True runs dropout
    and batch statistics (inductor then uses eager's RNG so dropout masks match).
    """
    if trials < 1 or eager_runs < 2:
        raise ValueError(f"need trials >= 1 and eager_runs >= 2, got trials={trials}, eager_runs={eager_runs}")

    def run(step: Callable[..., Any]) -> dict[str, Any]:
        return _run_step(step, model, example_inputs, loss_fn, train=train, seed=seed)

    eager = [run(train_step) for _ in range(eager_runs)]
    reference = eager[0]
    fluctuation: dict[str, float] = {}
    for other in eager[1:]:
        for path, d in _compare_parts(other, reference, 0.0, 0.0).items():
            fluctuation[path] = max(fluctuation.get(path, 0.0), d.max_abs)

    # Start from empty dynamo caches: entries left by earlier calls (other models, other
    # backends) could pile up to the recompile limit, where dynamo silently falls back to
    # eager and everything would pass. The config patch below turns any fallback to eager in
    # this call (recompile limit, a backend error swallowed by suppress_errors) into an error.
    torch.compiler.reset()
    # dynamic=False: static shapes, like extract's graphs.
    compiled = torch.compile(train_step, backend=backend, fullgraph=fullgraph, dynamic=False)
    trial_status: list[str] = []
    errors: list[str] = []
    worst: dict[str, tuple[Diff, str]] = {}
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, suppress_errors=False), \
            torch._inductor.config.patch(fallback_random=True):
        for trial in range(trials):
            try:
                result = run(compiled)
            except Exception as e:  # a compile or runtime error is a result, reported as such
                errors.append(f"trial {trial}: {type(e).__name__}: {e}")
                trial_status.append("error")
                break  # the same error would repeat on every trial
            statuses = []
            for path, d in _compare_parts(result, reference, rtol, atol).items():
                allowed = max(fluctuation_margin * fluctuation.get(path, 0.0), fluctuation_threshold or 0.0)
                status = _classify(d, allowed)
                statuses.append(status)
                prev = worst.get(path)
                if prev is None or (_SEVERITY[status], d.max_abs) > (_SEVERITY[prev[1]], prev[0].max_abs):
                    worst[path] = (d, status)
            trial_status.append(max(statuses, key=_SEVERITY.__getitem__, default="pass"))

    return ValidationResult(
        backend=getattr(backend, "__name__", str(backend)),
        rtol=rtol,
        atol=atol,
        trial_status=trial_status,
        tensors=_reports(reference, worst, fluctuation),
        errors=errors,
    )


def _run_step(
    step: Callable[..., Any],
    model: nn.Module,
    example_inputs: Sequence[Any],
    loss_fn: LossFn | None,
    *,
    train: bool,
    seed: int,
) -> dict[str, Any]:
    """One forward + backward on a fresh copy; returns {part name: value} to compare."""
    model = copy.deepcopy(model).train(train)
    for p in model.parameters():
        p.grad = None  # a deep copy carries the caller's .grad along; start from none
    inputs = clone_inputs(example_inputs)
    torch.manual_seed(seed)
    output, loss = step(model, loss_fn, *inputs)
    loss.backward()
    parts: dict[str, Any] = {"output": output, "loss": loss}
    parts.update({f"grad.{n}": p.grad for n, p in model.named_parameters() if p.requires_grad})
    parts.update({
        f"input_grad{key}": x.grad for key, x in input_leaves(inputs)
        if isinstance(x, torch.Tensor) and x.requires_grad
    })
    parts.update({f"buffer.{n}": b for n, b in model.named_buffers()})
    return parts


def _compare_parts(actual: dict[str, Any], expected: dict[str, Any], rtol: float, atol: float) -> dict[str, Diff]:
    diffs: dict[str, Diff] = {}
    for name in expected:
        diffs.update(compare(actual.get(name), expected[name], rtol, atol, path=name))
    return diffs


def _classify(d: Diff, allowed: float) -> str:
    if d.mismatch is not None:
        return "fail"
    if d.within_tol:
        return "pass"
    return "fluctuation" if d.max_abs <= allowed else "fail"


def _reports(
    reference: dict[str, Any],
    worst: dict[str, tuple[Diff, str]],
    fluctuation: dict[str, float],
) -> list[TensorReport]:
    flat_ref: dict[str, Any] = {}
    for name, value in reference.items():
        flat_ref.update(leaves(value, name))
    reports = []
    for path, (d, status) in worst.items():
        leaf = flat_ref.get(path)
        if path not in flat_ref and status == "pass":
            continue  # a container that matched: its leaves have their own rows
        if isinstance(leaf, torch.Tensor):
            dtype, shape = str(leaf.dtype).removeprefix("torch."), tuple(leaf.shape)
        else:
            dtype, shape = type(leaf).__name__, ()
        reports.append(TensorReport(
            name=path, dtype=dtype, shape=shape, max_abs=d.max_abs, max_rel=d.max_rel,
            status=status, eager_fluctuation=fluctuation.get(path, math.nan), note=d.mismatch or "",
        ))
    return reports
