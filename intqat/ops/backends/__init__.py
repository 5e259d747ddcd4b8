"""The backend table: which implementation runs each integer primitive, chosen per call.

    TABLE (priority order)   needs                                        implements
    triton                   CUDA tensors (or forced: the interpreter)    int_mm, linear, STE backward GEMMs
    amx                      AMX-INT8 tiles                               linear (large layers), digit_matmul
    cpu_fused                the C kernels; GEMMs: int8 dot-product units GEMMs via torch._int_mm, every elementwise pass
    avx2_int16               AVX2 (x86)                                   int_mm, linear (exact int16 multiply-adds)
    fp32_exact               fp32 only                                    int_mm, linear, digit_matmul (exact fp32 GEMMs of the codes)
    reference                torch                                        everything: the definition

`select(primitive, *tensors)` returns the first backend that implements the primitive, can take the
call (`Backend.refuse`: device, tracing, layout) and is not slow for it on this CPU (`Backend.slow`:
CPU features, the shapes where a kernel measured faster). So on a CPU without int8
dot products the GEMMs fall to avx2_int16 (or fp32_exact without AVX2: torch._int_mm is a scalar
loop there) while the
elementwise passes stay on cpu_fused; under torch.compile / torch.export only the traceable
reference (and triton) remain, so programs hold portable aten ops.

Trust: a backend that calls a library GEMM (torch._int_mm: cpu_fused and the C++ training ops; the fp32
GEMM: fp32_exact) refuses it where that GEMM failed its self-check (`self_check.untrusted`: run once per
process on worst-case operands against exact int64 sums; e.g. ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU makes
torch._int_mm wrong), and the next backend runs. The reference's own GEMMs use none of them (`exact.py`).

`use_backend(name)` forces one backend for the primitives it implements (tests, benchmarks), slow
or not: a call it cannot take (say, under tracing) still falls through the table, and `choices()` /
`recording()` tell which backend ran each primitive. INTQAT_BACKEND=<name>, read once at import,
forces one for the whole process.
"""

from __future__ import annotations

import collections
import contextlib
import os

from torch import Tensor

from intqat.ops import cpu_kernels
from intqat.ops.backends import self_check
from intqat.ops.backends.amx import Amx, amx_forward_pays
from intqat.ops.backends.avx2_int16 import Avx2Int16
from intqat.ops.backends.base import Backend, eager_cpu, plain_cpu, tracing
from intqat.ops.backends.cpu_fused import CpuFused
from intqat.ops.backends.fp32_exact import EXACT_K, Fp32Exact
from intqat.ops.backends.reference import MAX_K_INT32, Reference
from intqat.ops.backends.triton import Triton

__all__ = [
    "Backend", "TABLE", "MAX_K_INT32", "EXACT_K", "select", "use_backend", "forced", "get", "names",
    "unavailable", "note_ran", "choices", "recording", "summary", "tracing", "plain_cpu", "amx_forward_pays",
    "self_check",
]

TABLE: tuple[Backend, ...] = (Triton(), Amx(), CpuFused(), Avx2Int16(), Fp32Exact(), Reference())
_BY_NAME = {b.name: b for b in TABLE}
_forced: list[str] = []
_last: dict[str, str] = {}
_recorders: list[collections.Counter] = []


def names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def get(name: str) -> Backend:
    """The backend called `name`; a clear error listing the names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown intqat backend {name!r}; choose one of {names()}") from None


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run on this machine (None: it can)."""
    return get(name).unavailable()


def forced() -> str | None:
    """The backend `use_backend` / INTQAT_BACKEND forces now, if any."""
    return _forced[-1] if _forced else None


@contextlib.contextmanager
def use_backend(name: str):
    """Force backend `name` for the primitives it implements, inside the block.

    Raises if it cannot run on this machine at all (the reason says why), so a test that forces a
    backend never silently tests another one."""
    reason = unavailable(name)
    if reason is not None:
        raise RuntimeError(f"intqat backend {name!r} cannot run here: {reason}")
    _forced.append(name)
    try:
        yield get(name)
    finally:
        _forced.pop()


def select(primitive: str, *tensors: Tensor | None, shape: tuple[int, ...] | None = None,
           record: bool = True, at_run_time: bool = False) -> Backend | None:
    """The backend that runs `primitive` on these tensors (shape: the GEMM's (M, K, N) where a
    backend's choice depends on it). None only for primitives the reference does not implement
    (the Triton-only fused STE backward). record=False: a question, not a call (not counted).
    at_run_time: the backend an eager run on plain CPU tensors would take, even while tracing (a
    traced graph that holds an opaque op choosing its kernels when it runs asks this)."""
    if at_run_time:
        tensors = ()
    key = None
    if at_run_time or eager_cpu(tensors):
        # eager CPU calls (the hot path: ~10 per layer and step) decide from what the key holds:
        # the forced backend, whether the C kernels are switched off, and for the GEMMs (whose
        # backends look at them) the shape and the layout
        key = (primitive, _forced[-1] if _forced else None, cpu_kernels.disabled_depth(), shape,
               shape is not None and all(t is None or t.is_contiguous() for t in tensors))
        chosen = _decided.get(key)
        if chosen is not None:
            return _note(primitive, chosen, record)
        traced = False
    else:
        traced = tracing(*tensors)
    chosen = _choose(primitive, tensors, shape, traced)
    if chosen is not None and key is not None and len(_decided) < 4096:
        _decided[key] = chosen
    return _note(primitive, chosen, record and not traced)  # a traced call runs later, as its graph


_decided: dict[tuple, Backend] = {}


def _choose(primitive, tensors, shape, traced) -> Backend | None:
    if _forced:
        b = _BY_NAME[_forced[-1]]
        if primitive in b.primitives and b.refuse(primitive, tensors, shape, traced) is None:
            return b
    for b in TABLE:
        if (primitive in b.primitives and b.refuse(primitive, tensors, shape, traced) is None
                and b.slow(primitive, shape) is None):
            return b
    return None


def _note(primitive: str, chosen: Backend | None, record: bool) -> Backend | None:
    if record and chosen is not None:
        _last[primitive] = chosen.name
        for counter in _recorders:
            counter[(primitive, chosen.name)] += 1
    return chosen


def note_ran(ran: tuple[tuple[str, str], ...]) -> None:
    """Record (primitive, backend name) pairs as run: for a fused caller, such as the C++ training op
    (intqat.ops.cpp_step), that runs several primitives in one call."""
    _last.update(ran)
    for counter in _recorders:
        counter.update(ran)


def choices() -> dict[str, str]:
    """{primitive: backend} of the most recent call of each primitive in this process."""
    return dict(_last)


@contextlib.contextmanager
def recording():
    """Count which backend ran each primitive inside the block: yields a Counter of
    (primitive, backend) -> calls (the bench prints it; tests assert on it)."""
    counter: collections.Counter = collections.Counter()
    _recorders.append(counter)
    try:
        yield counter
    finally:
        _recorders.remove(counter)


def summary() -> list[tuple[str, str, str | None]]:
    """[(name, needs, None if it runs here else why not)] for every backend, in priority order."""
    return [(b.name, b.needs, b.unavailable()) for b in TABLE]


def _force_from_env() -> None:
    choice = os.environ.get("INTQAT_BACKEND", "auto").strip().lower()
    if choice in ("", "auto"):
        return
    if choice not in _BY_NAME:
        raise ValueError(f"INTQAT_BACKEND={choice!r}: choose 'auto' or one of {names()}")
    reason = _BY_NAME[choice].unavailable()
    if reason is not None:
        raise RuntimeError(f"INTQAT_BACKEND={choice!r}: that backend cannot run here: {reason}")
    _forced.append(choice)


_force_from_env()
