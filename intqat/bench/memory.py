"""Peak memory of a training step, from torch's own CPU allocator accounting.

    peak = state + transient
    state     = bytes of the parameters, buffers and optimizer state alive when the step starts
                (gradients were just set to None), one count per storage
    transient = max over the step of the net bytes torch's CPU allocator handed out (allocations
                minus frees), read from the allocation events of torch.profiler(profile_memory=True)

Why this and not the alternatives: tracemalloc does not see torch's allocator; RSS (psutil,
ru_maxrss) measures glibc's arenas and caching, so it depends on what ran before and on heap
fragmentation, not on what the step needs. The allocator events are exact and deterministic. They
do not include memory a library allocates outside torch's allocator (oneDNN / MKL scratch and
packed-weight buffers); that is small next to activations and is the same for all candidates
that call the same kernels.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from intqat.bench.saved import plain_tensors, storage_key

__all__ = ["state_bytes", "peak_transient_bytes", "allocator_events_available", "quiet_profiler_stderr"]


def _tensors_of(obj) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_of(v)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Parameters, gradients (if any), buffers and optimizer state: one count per storage."""
    tensors: list[Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        tensors += list(_tensors_of(list(optimizer.state.values())))
    seen: dict[int, int] = {}
    for t in tensors:
        for leaf in plain_tensors(t):
            k = storage_key(leaf)
            if k is not None:
                seen[k[0]] = k[1]
    return sum(seen.values())


# What the profiler writes to fd 2 that says nothing about the measurement: kineto's start/stop
# markers, and c10's notice that the step freed a tensor made before profiling began (e.g. a
# quantizer replacing last step's scale): that free is not counted, which can only overstate the
# peak, by that tensor's size.
_NOISE = ("Memory block of unknown size was allocated before the profiling started", "profiler_start", "profiler_stop")


@contextlib.contextmanager
def quiet_profiler_stderr():
    """Drop the profiler's own notices from fd 2 (C++ writes there, not to sys.stderr); pass the rest."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
    other = [ln for ln in text.splitlines() if not any(n in ln for n in _NOISE)]
    if other:
        print("\n".join(other), file=sys.stderr)


def allocator_events_available() -> bool:
    try:
        from torch._C._profiler import _EventType  # noqa: F401
    except ImportError:
        return False
    return True


def peak_transient_bytes(fn: Callable[[], object]) -> int | None:
    """Peak net bytes allocated by torch's CPU allocator while fn() runs (None: no profiler events)."""
    if not allocator_events_available():
        return None
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []

    def walk(nodes):
        for e in nodes:
            if e.tag == _EventType.Allocation and str(e.extra_fields.device).startswith("cpu"):
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort(key=lambda ev: ev[0])  # stable: same-time events keep the tree's order
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak
