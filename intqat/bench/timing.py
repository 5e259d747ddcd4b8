"""The shared timer: every speed number in intqat comes from here.

Rules (so that a ratio means something on a shared, noisy machine):
- candidates are timed in the SAME run, interleaved: repeat r times every candidate once, in an
  order rotated by r, so a burst of machine noise hits all candidates alike;
- warm-up first (oneDNN primitive creation, allocator growth, lazy imports are not timed);
- one measurement = `inner` back-to-back calls (inner chosen so a measurement lasts >= min_time),
  reported per call; the statistic is the median over repeats;
- a ratio is the median over repeats of the per-repeat ratio (anchor and candidate timed seconds
  apart), not a ratio of medians;
- torch.set_num_threads is left alone (torch's default: one thread per core).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from intqat.ops import cpp_step, cpu_kernels
from intqat.ops import backends
from intqat.ops.cpu_features import cpu_class, cpu_info, int8_gemm_outpaces_fp32_8x

__all__ = ["Timing", "time_interleaved", "speed_ratio", "machine_info", "machine_lines"]


@dataclass
class Timing:
    """Seconds per call of one candidate, one entry per repeat."""

    name: str
    times: list[float] = field(default_factory=list)
    inner: int = 1

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def time_interleaved(
    candidates: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 2,
    min_time: float = 0.05,
) -> dict[str, Timing]:
    """Time each zero-argument callable; round-robin over candidates, `repeats` times.

    `warmup` untimed rounds first (0 when the caller has warmed the candidates up already);
    `min_time` <= 0: one call per measurement (for calls that last long enough on their own).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(candidates)
    out = {n: Timing(n) for n in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one candidate's window would be charged to it alone
    try:
        for _ in range(warmup):
            for n in names:
                candidates[n]()
        if min_time > 0:
            for n in names:  # calls per measurement, from one more (warm) call
                t0 = time.perf_counter()
                candidates[n]()
                dt = time.perf_counter() - t0
                out[n].inner = max(1, math.ceil(min_time / max(dt, 1e-9)))
        for r in range(repeats):
            for i in range(len(names)):
                n = names[(i + r) % len(names)]
                fn, inner = candidates[n], out[n].inner
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                out[n].times.append((time.perf_counter() - t0) / inner)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def speed_ratio(anchor: Timing, candidate: Timing) -> float:
    """How many times faster than the anchor (> 1: faster): median over repeats of t_anchor / t_cand."""
    return statistics.median(a / c for a, c in zip(anchor.times, candidate.times))


def machine_info() -> dict:
    """What the numbers were measured on (goes into every table header and JSON file)."""
    model, flags = cpu_info()
    try:
        import importlib.metadata as md

        torchao_version = md.version("torchao")
    except Exception:  # not installed: the peers' rows say n/a
        torchao_version = None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {
        "cpu": model,
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "int8_isa": [f for f in ("amx_int8", "avx512_vnni", "avx_vnni") if f in flags],
        "torch": torch.__version__,
        "torchao": torchao_version,
        "python": platform.python_version(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "fused_cpu_kernels": cpu_kernels.available(),
        "cpp_training_op": cpp_step.unavailable_reason() or "on",
        "cpu_class": cpu_class(),
        # which rule `digits_pay` applies to the backward GEMMs through torch._int_mm
        "int8_8x_fp32": int8_gemm_outpaces_fp32_8x(),
        "backend_forced": backends.forced(),
        "backends_unavailable": {n: r for n, _, r in backends.summary() if r is not None},
        # library GEMMs the self-check refused (backends.self_check): their backends' GEMMs ran elsewhere
        "gemms_refused": {g.name: r for g, r, _ in backends.self_check.verdicts() if r is not None},
    }


def machine_lines(info: dict | None = None) -> list[str]:
    """The header lines every table starts with: the machine, and a warning when it was busy."""
    info = info or machine_info()
    isa = "+".join(info["int8_isa"]) or "no int8 dot-product ISA"
    load = info["load_avg_1min"]
    lines = [
        f"machine: {info['cpu']} ({isa}), {info['cores']} cores, {info['torch_threads']} torch threads; "
        f"torch {info['torch']}, torchao {info['torchao'] or 'not installed'}"
        + f"; intqat fused CPU kernels {'on' if info.get('fused_cpu_kernels') else 'OFF (torch path)'}"
        + ("" if "cpp_training_op" not in info else "; C++ training op "
           + ("on" if info["cpp_training_op"] == "on" else f"OFF ({info['cpp_training_op']}: Python path, slower)"))
        + ("" if load is None else f"; 1-min load avg before the run {load:.2f}")
    ]
    if "cpu_class" in info:
        forced = info.get("backend_forced")
        off = ", ".join(f"{n} ({r})" for n, r in info.get("backends_unavailable", {}).items()) or "none"
        lines.append(f"CPU class: {info['cpu_class']}; backends "
                     + (f"FORCED to {forced} (INTQAT_BACKEND) where it implements a primitive"
                        if forced else "chosen per call by the table (column 'backends': what ran)")
                     + f"; cannot run here: {off}")
        for gemm, reason in info.get("gemms_refused", {}).items():
            lines.append(f"SELF-CHECK REFUSED {gemm}: {reason}. The backends that call it took none of these rows' "
                         "GEMMs: the next backend ran them (column 'backends').")
        if info.get("int8_8x_fp32"):
            lines.append("backward digit GEMMs: the int8 ~8x fp32 rule (AMD Zen 5 with AVX-512 VNNI: both backward "
                         "GEMMs from 2^21 multiply-adds; intqat.ops.digit_gemm.digits_pay)")
    if load is not None and load > 0.5 * info["cores"]:
        stall = (
            " With several torch threads a descheduled OpenMP thread also stalls every parallel region, which "
            "penalises many small kernels more than few large ones." if info["torch_threads"] > 1 else ""
        )
        lines.append(f"WARNING: other processes were using the CPUs: timings include their interference.{stall} "
                     "Ratios are unreliable; measure on a quiet machine.")
    return lines


# named one by one in the backends column (the GEMMs, and the depthwise backward: its own kernel, not a pass)
_GEMM_PRIMITIVES = ("int_mm", "linear", "linear_grouped", "digit_matmul", "ste_grad_input", "ste_grad_weight",
                    "conv_int8", "depthwise_grad")
_STEP_PRIMITIVES = ("linear_step", "conv_step", "grouped_step")  # a whole layer step: the C++ op (cpp_step) or the Python path


def backends_used(run: Callable[[], object]) -> str:
    """Run once and say which backend ran each primitive: the GEMMs (and the depthwise backward) by name, the
    elementwise passes together, e.g. 'linear=fp32_exact passes=cpu_fused' ('-': no intqat primitive ran)."""
    with backends.recording() as ran:
        run()
    gemms: dict[str, set] = {}  # (a primitive the table put on two backends by shape: both, e.g. amx+cpu_fused)
    for p, b in ran:
        if p in _GEMM_PRIMITIVES:
            gemms.setdefault(p, set()).add(b)
    passes = sorted({b for (p, b) in ran if p not in _GEMM_PRIMITIVES and p not in _STEP_PRIMITIVES})
    parts = [f"{p}={'+'.join(sorted(bs))}" for p, bs in sorted(gemms.items())]
    if any(p in _STEP_PRIMITIVES and b == "cpp_step" for p, b in ran):
        parts.append("step=C++")  # a layer's forward and backward through the C++ op (backend cpp_step)
    if passes:
        parts.append("passes=" + "+".join(passes))
    return " ".join(parts) or "-"
