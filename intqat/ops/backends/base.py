"""What a backend is: a named implementation of some of intqat's integer primitives.

A backend says what it needs (device, CPU features, eager vs traced) and, per call, why it cannot
take one (`refuse`) or why it would be slow there (`slow`); `intqat.ops.backends.select` takes the first that does not refuse, in the table's
priority order. The shape follows xformers' attention dispatch (one class per implementation,
each with its reasons) and torch.library's one-contract-many-kernels.

The primitives (the same signature in every backend that implements them):

    int_mm(a, b)                             a (M, K) int8, b (K, N) int8 -> (M, N) int32, exact
    linear(q_x, q_w, z_x, colsum, s_x, s_w, bias)
                                             epilogue(int_mm(q_x, q_wᵀ), ...): q_x (M, K), q_w (N, K)
    epilogue(acc, z_x, colsum, s_x, s_w, bias)
                                             float32(acc - z_x colsum[n]) * (s_x[m] s_w[n]) + b[n]
    digit_matmul(a, col_scale, q, z, mask)   the backward GEMM on the int8 units (digit_gemm.py)
    linear_grouped(q_x, q_w, s_w, z_x, s_x, bias)
                                             the per-group (8da4w) forward (int_linear_grouped.py)
    quantize_rows / quantize_rows_dynamic / fake_quantize_rows / dequantize_rows
                                             the elementwise passes (quant.py's formulas)
    pack_mask / unpack_mask                  clip masks as bits for backward (masks.py)
    mask_zero_packed_(g, packed)             where(unpack_mask(packed), g, 0) straight from the bits
    ste_grad_input / ste_grad_weight         the whole STE backward GEMM with its mask (Triton)
    depthwise_grad(g, q_x, z_x, s_x, q_w, s_w, stride, padding, dilation, need_x, need_w, need_b)
                                             a depthwise conv's STE backward (fp32 sums: equal within rounding)

The plain-torch backend (`reference`) implements them all and is their definition: every other
backend computes the same bits, which tests/test_backends.py checks on whatever CPU runs it (but for
depthwise_grad, whose fp32 sums each implementation orders its own way: tests/test_depthwise_backward.py).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils import _python_dispatch

__all__ = ["Backend", "TableView", "tracing", "plain_cpu", "eager_cpu"]

_Parameter = torch.nn.Parameter


def tracing(*tensors: Tensor | None) -> bool:
    """Is anything watching the aten calls? torch.compile / torch.export, a dispatch mode (make_fx,
    FlopCounterMode), a functorch transform (vmap's batched tensors look like plain ones), or a
    tensor subclass (fake, functional). Tracers must see portable torch ops, never a ctypes call."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    if torch._C._are_functorch_transforms_active() or _python_dispatch._get_current_dispatch_mode() is not None:
        return True
    return any(t is not None and type(t) is not Tensor and type(t) is not _Parameter for t in tensors)


def eager_cpu(tensors: tuple[Tensor | None, ...]) -> bool:
    """Plain CPU tensors and nothing tracing: the hot case, checked in one go (cheapest tests first)."""
    for t in tensors:
        if t is not None and ((type(t) is not Tensor and type(t) is not _Parameter) or not t.is_cpu):
            return False
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return False
    return not torch._C._are_functorch_transforms_active() and _python_dispatch._get_current_dispatch_mode() is None


def plain_cpu(*tensors: Tensor | None) -> bool:
    """Every tensor is a plain (not traced, not subclassed) CPU tensor."""
    for t in tensors:
        if t is not None and ((type(t) is not Tensor and type(t) is not _Parameter) or not t.is_cpu):
            return False
    return True


class Backend:
    """One implementation family. Subclasses set the class attributes and implement primitives.

    name        what tests, `use_backend` and the bench call it
    needs       what it needs, in words (printed by the bench and the test summary)
    primitives  the primitives it implements (methods of the same name)
    traceable   may run while a tracer watches (its ops are what the exported program should hold)
    table       the table's questions about the other primitives (`TableView`), bound when the table is
                built: what a backend that runs several primitives in one call (cpp_step) checks its
                kernels against. (Bound, not imported: backends import nothing of the table.)
    """

    name = "?"
    needs = ""
    primitives: frozenset[str] = frozenset()
    traceable = False
    table: "TableView | None" = None

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine at all (None: it can). Cached by the table."""
        return None

    def refuse(self, primitive: str, tensors: tuple[Tensor | None, ...], shape: tuple[int, ...] | None,
               traced: bool, spec=None) -> str | None:
        """Why this backend does not take this call (None: it takes it).

        tensors: the call's tensor arguments, in the order the primitive's caller passes them (empty for a
        run-time question, `select(..., at_run_time=True)`: decide from the shape, or take it); shape: the
        GEMM's (M, K, N) where that matters; traced: `tracing(*tensors)`, computed once per call by the table;
        spec: the call's scalar options (hashable), for the primitives that have them. On eager CPU calls the
        table caches the verdict per (primitive, shape, spec, the GEMM operands' shapes and strides, forced
        backend, off switches): a reason may depend on nothing else. The default: eager, plain CPU tensors only."""
        if traced:
            return "not while tracing (compile / export / a dispatch mode)"
        if not plain_cpu(*tensors):
            return "needs plain CPU tensors"
        return None

    def slow(self, primitive: str, shape: tuple[int, ...] | None, spec=None) -> str | None:
        """Why this backend, though able, is not the fast choice for this call on this CPU (None: it is).
        The table skips a slow backend unless it is forced (`use_backend`): tests force one to check its
        bits on any machine. Rules come from the CPU's capabilities (cpu_features) and, where a shape
        matters, from named constants that say which CPU class measured them."""
        return None

    def __repr__(self) -> str:
        return f"<intqat backend {self.name}>"


class TableView:
    """What a backend may ask the table (bound to every backend as `Backend.table`; backends import nothing of it).

    select(primitive, *tensors)   the table's choice for a call (backends.select): what a composed primitive calls
    runs(primitive, shape, spec)  the name of the backend an eager run on plain CPU tensors would take (None: none)
    fast(primitive, shape, spec)  whether that backend is also fast for this shape (its `slow` says None)
    state()                       what the table's choices depend on besides the call (forced backend, off switches)
    forced_note()                 ' (forced)' while use_backend / INTQAT_BACKEND forces one, else ''
    note_ran(ran)                 record (primitive, backend) pairs a fused call ran (`recording()` counts them)
    """

    def __init__(self, select, runs, fast, state, forced_note, note_ran):
        self.select, self.runs, self.fast, self.state = select, runs, fast, state
        self.forced_note, self.note_ran = forced_note, note_ran
