"""The self-check: before intqat trusts a library GEMM, it checks it against the exact sums.

Why: a library GEMM can be wrong on a machine where everything else looks fine. On a VNNI CPU with
oneDNN held below VNNI (ONEDNN_MAX_CPU_ISA=AVX2 or =AVX512_CORE, set for reproducibility or in
containers), torch 2.13 still sends `torch._int_mm` to oneDNN, whose pre-VNNI kernel adds pairs of
u8 x s8 products in saturating int16 (the int8 operand is shifted by +128, so codes of 127 are the worst):
4,050 of 4,096 entries of a random 64x256 @ 256x64 product came out wrong, off by up to 67,550.

On first use in a process (a backend's `refuse` asks `untrusted(name)`), each library GEMM a backend relies
on multiplies a few worst-case operand pairs (`worst_case_operands`: all 127, all -128 at an fp32 slice
edge, 127 x -128, alternating signs, random full-range codes with a transposed operand, odd shapes), and
the results are compared with the exact int64 sums (`exact.exact_int_mm`, which shares no kernel with
them). About a millisecond, once (oneDNN's own start-up aside). A GEMM that is wrong is refused by every
backend that calls it, with the reason (naming what is set, e.g. ONEDNN_MAX_CPU_ISA=AVX2), one
RuntimeWarning is issued, and the table's next backend runs the call: exact, perhaps slower.

    GEMMS            library                       who relies on it
    torch._int_mm    oneDNN's int8 GEMM            cpu_fused's int_mm / linear / digit_matmul; the C++
                                                   training ops (kernels/cpu/train_*.cpp) through the table
    fp32 mm          torch.mm in fp32 (MKL/oneDNN) fp32_exact's int_mm / linear / digit_matmul (K slices
                                                   <= 1024 of int8 codes)
    oneDNN int8 conv onednn.qconv_pointwise        onednn_conv's conv_int8, the C++ conv step's forward (run as
                                                   a 1x1 conv: conv_onednn.gemm_via_conv)

`check_int_mm()` is the same check for anyone's torch._int_mm (intqat.ops re-exports it): run it where an
exported program, which holds aten._int_mm, will run.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from intqat.ops import conv_onednn
from intqat.ops.backends.exact import EXACT_K, exact_int_mm, fp32_slices_mm

__all__ = ["LibraryGemm", "GEMMS", "untrusted", "untrusted_while_compiling", "verdicts", "check_int_mm",
           "worst_case_operands", "settings_in_effect"]


@dataclass(frozen=True)
class LibraryGemm:
    name: str  # what reasons and reports call it
    library: str  # whose kernel it is
    users: str  # which backends / ops call it
    run: Callable[[Tensor, Tensor], Tensor]  # a (M, K) int8 @ b (K, N) int8 -> int32, as its users call it
    unavailable: Callable[[], str | None] = lambda: None  # why it cannot run here at all (then it is not checked)


GEMMS: dict[str, LibraryGemm] = {
    "torch._int_mm": LibraryGemm(
        "torch._int_mm", "oneDNN's int8 GEMM",
        "cpu_fused's int_mm / linear / digit_matmul and the C++ training ops' GEMM", torch._int_mm),
    "fp32 mm": LibraryGemm(
        "fp32 mm", "torch.mm in fp32 (MKL / oneDNN)",
        "fp32_exact's int_mm / linear / digit_matmul (exact fp32 K slices)", fp32_slices_mm),
    # the GEMM as a 1x1 convolution: u8 shift, prepack, int32 sums, the fp32 output and its channel chunks
    "oneDNN int8 conv": LibraryGemm(
        "oneDNN int8 conv", "oneDNN's int8 convolution (torch.ops.onednn.qconv_pointwise)",
        "onednn_conv's conv_int8 and the C++ conv step's forward", conv_onednn.gemm_via_conv,
        conv_onednn.unavailable_reason),
}

# Environment variables and torch settings that change which kernel a library GEMM runs: the reason for a
# wrong GEMM names those that are set (oneDNN reads both the ONEDNN_ and the older DNNL_ spelling).
_SETTINGS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS", "DNNL_CPU_ISA_HINTS",
             "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS",
             "MKL_DEBUG_CPU_TYPE", "MKL_CBWR", "ATEN_CPU_CAPABILITY")

_lock = threading.Lock()
_verdicts: dict[str, str | None] = {}  # name -> None (exact) or why not; absent: not checked yet


def settings_in_effect() -> list[str]:
    """The settings that steer torch's GEMM kernels and differ from the defaults, as 'NAME=value'."""
    found = [f"{k}={os.environ[k]}" for k in _SETTINGS if os.environ.get(k)]
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        found.append(f"torch.set_float32_matmul_precision({precision!r})")
    return found


def _library_versions() -> str:
    onednn = re.search(r"MKL-DNN v([\w.]+)", torch.__config__.show())
    return f"torch {torch.__version__}, oneDNN {onednn.group(1) if onednn else 'unknown'}"


def worst_case_operands() -> list[tuple[str, Tensor, Tensor]]:
    """[(what, a (M, K) int8, b (K, N) int8)]: the products an int8 GEMM kernel gets wrong first.

    - all 127, K = 2: oneDNN's pre-VNNI path adds 128 to one operand (u8 255) and sums pairs of
      255 * 127 in int16, which saturates at 32767;
    - all -128, K = EXACT_K + 1: every pair sums to 2^15 (one past int16), and each fp32 slice of EXACT_K
      reaches 2^24, the largest magnitude fp32 holds exactly;
    - 127 x -128 at K = EXACT_K: the largest negative sums;
    - alternating signs along K (a and b alike, so every product is positive and large), odd shape 17x33x9;
    - random full-range codes 64x256 @ 256x64 with b a transposed view: the layout int_linear passes (q_wᵀ);
    - one element.
    """
    def full(shape, v):
        return torch.full(shape, v, dtype=torch.int8)

    signs = torch.where(torch.arange(33) % 2 == 0, 127, -128).to(torch.int8)
    g = torch.Generator().manual_seed(0)
    rand_a = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)
    rand_w = torch.randint(-128, 128, (64, 256), dtype=torch.int8, generator=g)
    return [
        ("all 127, 3x2 @ 2x5", full((3, 2), 127), full((2, 5), 127)),
        (f"all -128, 3x{EXACT_K + 1} @ {EXACT_K + 1}x5", full((3, EXACT_K + 1), -128), full((EXACT_K + 1, 5), -128)),
        (f"127 x -128, 5x{EXACT_K} @ {EXACT_K}x3", full((5, EXACT_K), 127), full((EXACT_K, 3), -128)),
        ("alternating signs, 17x33 @ 33x9", signs.expand(17, 33).contiguous(), signs.reshape(33, 1).expand(33, 9).contiguous()),
        ("random codes, 64x256 @ (64x256)ᵀ", rand_a, rand_w.t()),
        ("one element, -128 x -128", full((1, 1), -128), full((1, 1), -128)),
    ]


def _mismatch(mm: Callable[[Tensor, Tensor], Tensor]) -> str | None:
    """None if mm gives the exact sums on every worst case, else what went wrong (counts and the worst)."""
    wrong = total = 0
    worst: tuple[str, int] | None = None
    for what, a, b in worst_case_operands():
        want = exact_int_mm(a, b).to(torch.int64)
        try:
            got = mm(a, b)
        except Exception as e:  # a kernel that refuses a layout or a shape is as untrustworthy as a wrong one
            return f"it raised on {what}: {type(e).__name__}: {str(e)[:200]}"
        if got.shape != want.shape:
            return f"it returned shape {tuple(got.shape)} for {what}"
        diff = (got.to(torch.int64) - want).abs()
        n = int((diff != 0).sum())
        total += want.numel()
        if n:
            wrong += n
            off = int(diff.max())
            if worst is None or off > worst[1]:
                worst = (what, off)
    if not wrong:
        return None
    return f"{wrong} of {total} entries of its self-check are wrong (worst: {worst[0]}, off by up to {worst[1]})"


def _explain(gemm: LibraryGemm, mismatch: str) -> str:
    settings = settings_in_effect()
    why = ("set here: " + ", ".join(settings)) if settings else \
        f"no setting intqat knows of explains it ({_library_versions()})"
    return f"{gemm.name} ({gemm.library}) is not exact on this machine: {mismatch}; {why}"


def _run_check(name: str) -> str | None:
    gemm = GEMMS[name]
    # outside any tracer (a fake-tensor mode while compile traces a backward, say): real tensors, real kernels
    with _disable_current_modes(), torch.no_grad():
        mismatch = _mismatch(gemm.run)
    if mismatch is None:
        return None
    reason = _explain(gemm, mismatch)
    warnings.warn(
        f"intqat: {reason}. intqat does not use it: {gemm.users} go to the next backend in the table "
        "(avx2_int16's exact int16 kernel, fp32_exact or the reference: exact, slower; backends.recording() "
        "names it). Programs exported here still hold aten._int_mm: check the torch that "
        "runs them with intqat.ops.check_int_mm().", RuntimeWarning, stacklevel=2)
    return reason


def untrusted(name: str) -> str | None:
    """Why library GEMM `name` (a key of GEMMS) must not be used in this process; None: it passed its self-check.

    The check runs on the first call (under a lock), and once: its verdict holds for the process."""
    try:
        return _verdicts[name]
    except KeyError:
        pass
    with _lock:
        if name not in _verdicts:
            _verdicts[name] = _run_check(name)
        return _verdicts[name]


@torch.compiler.assume_constant_result
def untrusted_while_compiling(name: str) -> bool:
    """`untrusted(name) is not None`, callable from code torch.compile traces: dynamo runs it once, eagerly,
    and keeps the answer as a constant of the graph (the verdict holds for the process)."""
    return untrusted(name) is not None


def verdicts(run: bool = True) -> list[tuple[LibraryGemm, str | None, bool]]:
    """[(gemm, reason or None, checked)] for every library GEMM; run=True checks those not checked yet (a GEMM that
    cannot run here at all, `LibraryGemm.unavailable`, is not checked)."""
    out = []
    for name, gemm in GEMMS.items():
        if run and gemm.unavailable() is None:
            untrusted(name)
        out.append((gemm, _verdicts.get(name), name in _verdicts))
    return out


def check_int_mm(mm: Callable[[Tensor, Tensor], Tensor] | None = None) -> str | None:
    """Is this process's torch._int_mm (or `mm`) exact? None if it is, else what is wrong and what is set.

    Needs torch only (no compiler, no intqat kernels): run it where an exported intqat program runs,
    since the program's integer layers are aten._int_mm. Runs the worst cases every time (~1 ms) and
    warns nothing: the caller decides."""
    gemm = GEMMS["torch._int_mm"]
    if mm is not None:
        gemm = LibraryGemm(getattr(mm, "__name__", "mm"), "the GEMM given", "", mm)
    with _disable_current_modes(), torch.no_grad():
        mismatch = _mismatch(gemm.run)
    return None if mismatch is None else _explain(gemm, mismatch)
