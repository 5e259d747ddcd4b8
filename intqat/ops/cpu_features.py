"""What this CPU can do, read once from /proc/cpuinfo: the facts backends are chosen from.

Dispatch never uses thresholds fitted to one machine's speed without saying which class of CPU they
were measured on; it uses these capabilities, which hold on every machine of a class.
"""

from __future__ import annotations

import functools
import os
import platform

__all__ = ["cpu_info", "cpu_vendor_family", "cpu_has_int8_dot", "int8_gemm_outpaces_fp32_8x", "cpu_class",
           "INT8_DOT_FLAGS"]

# CPU features that run int8 dot products natively (x86: AMX, AVX512-VNNI, AVX-VNNI; Arm: SDOT,
# I8MM). Without them torch._int_mm is a scalar loop, ~50x slower than an fp32 GEMM.
INT8_DOT_FLAGS = frozenset({"amx_int8", "avx512_vnni", "avx_vnni", "asimddp", "i8mm"})


@functools.lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) from /proc/cpuinfo (x86 "flags", Arm "Features"); read once."""
    model, flags = None, frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "CPU part") and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown CPU", flags


@functools.lru_cache(maxsize=1)
def cpu_vendor_family() -> tuple[str, int | None]:
    """(vendor_id, cpu family) from /proc/cpuinfo, e.g. ("AuthenticAMD", 26); ("", None) where absent (Arm)."""
    vendor, family = "", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "cpu family" and family is None:
                    family = int(value.strip()) if value.strip().isdigit() else None
                if vendor and family is not None:
                    break
    except OSError:
        pass
    return vendor, family


@functools.lru_cache(maxsize=1)
def emulating_no_int8_dot() -> bool:
    """INTQAT_EMULATE_NO_INT8_DOT=1 (read once): behave as on a CPU without int8 dot-product units
    (the backend table takes the GEMMs off torch._int_mm and AMX, the backward keeps fp32 GEMMs), so
    `intqat-bench` on any machine shows what that class of CPU runs. Numbers, not capabilities: the
    units are still there, and the bench header says it is an emulation."""
    return os.environ.get("INTQAT_EMULATE_NO_INT8_DOT", "0") not in ("", "0")


def cpu_has_int8_dot() -> bool:
    """Does this CPU run int8 dot products natively (so torch._int_mm beats an fp32 GEMM)?"""
    return bool(INT8_DOT_FLAGS & cpu_info()[1]) and not emulating_no_int8_dot()


def int8_gemm_outpaces_fp32_8x() -> bool:
    """Is this a CPU whose int8 GEMM (torch._int_mm) runs at >= ~8x the multiply rate of torch's fp32
    GEMM? Then a backward GEMM done as three int8 digit GEMMs (digit_gemm) pays from small sizes on.

    True for AMD Zen 5 (family 26) with AVX-512 VNNI: oneDNN's int8 GEMM runs on its full-width 512-bit
    VNNI units, while MKL's fp32 GEMM takes its AVX2 path on non-Intel CPUs (AVX-512 only on Intel's).
    Measured on an EPYC of that class: torch._int_mm 8.8x torch.mm's throughput at 1024^3 (2 threads).
    Not Zen 4 (family 25): it runs 512-bit VNNI at half rate (two 256-bit halves), ~4x like Intel's
    AVX-512 CPUs, whose MKL fp32 GEMM is AVX-512: those keep the narrower rule in `digits_pay`.
    """
    if emulating_no_int8_dot() or "avx512_vnni" not in cpu_info()[1]:
        return False
    vendor, family = cpu_vendor_family()
    return vendor == "AuthenticAMD" and family is not None and family >= 26


def cpu_class() -> str:
    """The class figures are reported for: 'AMX-INT8', 'VNNI, no AMX', 'Arm int8 dot', or
    'no int8 dot-product units' (with ', emulated' under INTQAT_EMULATE_NO_INT8_DOT)."""
    flags = cpu_info()[1]
    if emulating_no_int8_dot():
        return "no int8 dot-product units (emulated by INTQAT_EMULATE_NO_INT8_DOT=1 on a CPU that has them)"
    if "amx_int8" in flags:
        return "AMX-INT8"
    if flags & {"avx512_vnni", "avx_vnni"}:
        return "VNNI, no AMX"
    if flags & {"asimddp", "i8mm"}:
        return "Arm int8 dot"
    return "no int8 dot-product units"
