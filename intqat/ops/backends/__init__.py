"""The backend table: the one place that decides which implementation runs each integer primitive, per call.

    TABLE (priority order)   needs                                        implements
    triton                   CUDA tensors (or forced: the interpreter)    int_mm, linear, linear_grouped, STE backward GEMMs
    cpp_step                 the C++ training ops (built on first use)    linear_step, conv_step: a whole training step in
                                                                          one C++ autograd op (cpu_fused / avx2_int16 kernels)
    onednn_conv              oneDNN's int8 conv, int8 dot-product units   conv_int8: an integer conv's accumulator without
                                                                          im2col (regular 3x3 convs of <= 64 channels)
    amx                      AMX-INT8 tiles                               linear (large layers), digit_matmul, linear_grouped (M >= 16)
    cpu_fused                the C kernels; GEMMs: int8 dot-product units GEMMs via torch._int_mm, every elementwise pass
    avx2_int16               AVX2 (x86)                                   int_mm, linear, linear_grouped (int16 multiply-adds)
    fp32_exact               fp32 only                                    int_mm, linear, digit_matmul (exact fp32 GEMMs of the codes)
    reference                torch                                        everything: the definition; the ops' Python paths

`select(primitive, *tensors, shape=, spec=)` returns the first backend that implements the primitive, takes the
call (`Backend.refuse`: device, tracing, layout, shape, options, a library GEMM that failed its self-check, a
fused step whose primitives the table puts elsewhere) and is not slow for it on this CPU (`Backend.slow`: CPU
capabilities, and the shapes where a kernel measured faster, as named constants beside the backend). So on a
CPU without int8 dot products the GEMMs fall to avx2_int16 (or fp32_exact without AVX2) while the elementwise
passes stay on cpu_fused; under torch.compile / torch.export only the traceable reference (and triton) remain,
so programs hold portable aten ops. No backend falls back inside its own methods: a call it cannot do well is
refused with the reason, so `recording()` names the backend that really ran. `explain(primitive, ...)` prints
every backend's verdict; `fast(primitive, shape, spec)` answers "does the backend that would run it call this
shape fast?" (the digit backward's rule: `digit_gemm.digits_pay`).

Trust: a backend that calls a library GEMM (torch._int_mm: cpu_fused and the C++ training ops; the fp32
GEMM: fp32_exact) refuses it where that GEMM failed its self-check (`self_check.untrusted`: run once per
process on worst-case operands against exact int64 sums; e.g. ONEDNN_MAX_CPU_ISA=AVX2 on a VNNI CPU makes
torch._int_mm wrong), and the next backend runs. The reference's own GEMMs use none of them (`exact.py`).

`use_backend(name)` forces one backend for the primitives it implements (tests, benchmarks), slow
or not: a call it refuses (say, under tracing) still falls through the table, and `choices()` /
`recording()` tell which backend ran each primitive. INTQAT_BACKEND=<name>, read once at import,
forces one for the whole process.
"""

from __future__ import annotations

import collections
import contextlib
import os

from torch import Tensor

from intqat.ops import cpp_step as cpp_ops
from intqat.ops import cpu_kernels
from intqat.ops.backends import self_check
from intqat.ops.backends.amx import Amx, amx_forward_pays
from intqat.ops.backends.avx2_int16 import Avx2Int16
from intqat.ops.backends.base import Backend, TableView, eager_cpu, plain_cpu, tracing
from intqat.ops.backends.cpp_step import CppStep
from intqat.ops.backends.cpu_fused import CpuFused
from intqat.ops.backends.fp32_exact import EXACT_K, Fp32Exact
from intqat.ops.backends.onednn_conv import OnednnConv
from intqat.ops.backends.reference import MAX_K_INT32, Reference
from intqat.ops.backends.triton import Triton

__all__ = [
    "Backend", "TABLE", "MAX_K_INT32", "EXACT_K", "select", "fast", "explain", "use_backend", "forced", "get",
    "names", "unavailable", "note_ran", "choices", "recording", "summary", "tracing", "plain_cpu", "eager_cpu",
    "amx_forward_pays", "self_check",
]

TABLE: tuple[Backend, ...] = (Triton(), CppStep(), OnednnConv(), Amx(), CpuFused(), Avx2Int16(), Fp32Exact(), Reference())
_BY_NAME = {b.name: b for b in TABLE}
_forced: list[str] = []
_last: dict[str, str] = {}
_recorders: list[collections.Counter] = []
# primitives whose refusals read the operands' shapes and strides: those go into the cache key of eager calls
_BY_LAYOUT = frozenset({"int_mm", "linear", "epilogue", "digit_matmul", "linear_grouped", "conv_int8"})


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


def _state() -> tuple:
    """What a decision depends on besides the call: the forced backend and the kernels' off switches."""
    return _forced[-1] if _forced else None, cpu_kernels.disabled_depth(), cpp_ops.disabled_depth()


def select(primitive: str, *tensors: Tensor | None, shape: tuple[int, ...] | None = None, spec=None,
           record: bool = True, at_run_time: bool = False, eager: bool | None = None) -> Backend | None:
    """The backend that runs `primitive` on these tensors. shape: the GEMM's (M, K, N) where a backend's choice
    depends on it; spec: the call's scalar options (hashable: part of the cache key). None only for primitives
    the reference does not implement (the Triton-only fused STE backward). record=False: a question, not a call
    (not counted). at_run_time: the backend an eager run on plain CPU tensors would take, even while tracing (a
    traced graph that holds an opaque op choosing its kernels when it runs asks this). eager: `eager_cpu(tensors)`
    where the caller computed it already (the training steps' hot path)."""
    if at_run_time:
        tensors = ()
    key = None
    if at_run_time or (eager if eager is not None else eager_cpu(tensors)):
        # eager CPU calls (the hot path: ~10 per layer and step) decide from what the key holds: the call's
        # shape and options, the forced backend and the off switches, and for the GEMMs (whose refusals read
        # them) the operands' shapes and strides
        layout = (tuple(None if t is None else (t.shape, t.stride()) for t in tensors)
                  if primitive in _BY_LAYOUT else None)
        key = (primitive, _forced[-1] if _forced else None, cpu_kernels.disabled_depth(), cpp_ops.disabled_depth(),
               shape, spec, layout)
        chosen = _decided.get(key, _UNDECIDED)
        if chosen is not _UNDECIDED:
            return _note(primitive, chosen, record)
        traced = False
    else:
        traced = tracing(*tensors)
    chosen = _choose(primitive, tensors, shape, spec, traced)
    if key is not None and len(_decided) < 4096:
        _decided[key] = chosen  # (None too: "only Triton implements it" is asked on every backward)
    return _note(primitive, chosen, record and not traced)  # a traced call runs later, as its graph


_decided: dict[tuple, Backend | None] = {}
_UNDECIDED = object()


def _verdict(b: Backend, primitive, tensors, shape, spec, traced, forced_here: bool) -> str | None:
    """None if backend b takes this call, else why not (the table's one rule, used by select and explain)."""
    if primitive not in b.primitives:
        return "does not implement it"
    reason = b.refuse(primitive, tensors, shape, traced, spec)
    if reason is not None:
        return f"refuses: {reason}"
    if not forced_here:
        reason = b.slow(primitive, shape, spec)
        if reason is not None:
            return f"slow here: {reason}"
    return None


def _choose(primitive, tensors, shape, spec, traced) -> Backend | None:
    if _forced:
        b = _BY_NAME[_forced[-1]]
        if _verdict(b, primitive, tensors, shape, spec, traced, True) is None:
            return b
    for b in TABLE:
        if _verdict(b, primitive, tensors, shape, spec, traced, False) is None:
            return b
    return None


def fast(primitive: str, shape: tuple[int, ...], spec=None) -> bool:
    """Does the backend an eager run would take for `primitive` (forced or not) call this shape fast (`slow` None)?

    The question an op asks before it picks an algorithm a backend makes worthwhile: the backward GEMM as
    digits (`digit_gemm.digits_pay`: spec 'x' or 'w'); asked while tracing too (the opaque ops decide as eager)."""
    b = select(primitive, record=False, at_run_time=True)
    return b is not None and b.slow(primitive, shape, spec) is None


def explain(primitive: str, *tensors: Tensor | None, shape: tuple[int, ...] | None = None, spec=None,
            at_run_time: bool = False, file=None) -> str:
    """Print (and return) every backend's verdict on this call, in the table's order, and which one runs it.

        >>> intqat.ops.explain("linear", q_x, q_w, s_x, s_w, shape=(256, 1024, 1024))
        linear on 2 tensors, shape (256, 1024, 1024) (forced: none)
          triton      refuses: CPU tensors (the Triton interpreter runs only when forced)
          cpp_step    does not implement it
          amx         unavailable here: this CPU (or kernel) has no AMX-INT8 tiles
          cpu_fused   RUNS IT
          ...
    """
    if spec is None and primitive in _STEP_SPECS:
        raise ValueError(
            f"explain({primitive!r}, ...) needs spec=: the step's options as {_STEP_SPECS[primitive]}, the value the "
            f"layer's first call builds. To see which backend ran a layer's step, run it under "
            f"`with intqat.ops.backends.recording() as ran:` and read `ran` ((primitive, backend) -> calls)")
    if at_run_time:
        tensors = ()
    traced = False if at_run_time else tracing(*tensors)
    forced_name = forced()
    chosen = _choose(primitive, tensors, shape, spec, traced)
    lines = [f"{primitive} on {len(tensors)} tensor{'s' if len(tensors) != 1 else ''}"
             + ("" if shape is None else f", shape {tuple(shape)}") + ("" if spec is None else f", spec {spec}")
             + (", traced" if traced else "") + f" (forced: {forced_name or 'none'})"]
    for b in TABLE:
        gone = b.unavailable() if primitive in b.primitives else None
        if b is chosen:
            verdict = "RUNS IT" + (" (forced)" if b.name == forced_name else "")
        elif gone is not None:
            verdict = f"unavailable here: {gone}"
        else:
            verdict = _verdict(b, primitive, tensors, shape, spec, traced, b.name == forced_name) or "would take it"
            if b.name == forced_name:
                verdict += " (forced, so the table went on)"
        lines.append(f"  {b.name:<11} {verdict}")
    if chosen is None:
        other = _OTHER_ALGORITHM.get(primitive, "its other path")
        lines.append("  no backend takes it" + (f"; for a question with a shape: none is fast, so the op keeps its other "
                                                  f"algorithm ({other})" if shape else
                                                  f" (a primitive only some backends implement; the op keeps {other})"))
    text = "\n".join(lines)
    print(text, file=file)
    return text


# the primitives whose verdicts read the step's options (explain refuses them without spec=, naming the type)
_STEP_SPECS = {"linear_step": "intqat.ops.int_linear.LinearStep", "grouped_step": "intqat.ops.int_linear_grouped.GroupedStep",
               "conv_step": "intqat.ops.int_conv2d.ConvStep"}

# what an op does when no backend takes a primitive only some implement (explain's last line)
_OTHER_ALGORITHM = {"digit_matmul": "the digit GEMM's: the fp32 backward",
                    "conv_int8": "the integer conv's: im2col + int_mm",
                    "ste_grad_input": "the STE backward's: its GEMM, then the mask",
                    "ste_grad_weight": "the STE backward's: its GEMM, then the mask"}


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


def _runs(primitive: str, shape=None, spec=None) -> str | None:
    b = select(primitive, shape=shape, spec=spec, record=False, at_run_time=True)
    return None if b is None else b.name


_VIEW = TableView(select=select, runs=_runs, fast=fast, state=_state,
                  forced_note=lambda: " (forced)" if _forced else "", note_ran=note_ran)
for _b in TABLE:
    _b.table = _VIEW
