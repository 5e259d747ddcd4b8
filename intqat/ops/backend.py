"""Which implementation runs an integer op.

- CUDA tensors: the Triton kernels in `intqat.kernels`.
- CPU tensors: `torch._int_mm` (AMX / VNNI int8 units; ~100x faster than out_dtype's fallback).
- `INTQAT_BACKEND=triton`: the Triton kernels on CPU too, through the interpreter. Set
  `TRITON_INTERPRET=1` before triton is imported; that is how tests check the kernels without a GPU.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

_CHOICES = ("auto", "torch", "triton")


def backend_for(t: torch.Tensor) -> str:
    """'triton' or 'torch' for tensors living where t lives."""
    choice = os.environ.get("INTQAT_BACKEND", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"INTQAT_BACKEND must be one of {_CHOICES}, got {choice!r}")
    if choice == "triton":
        return "triton"
    if choice == "torch":
        return "torch"
    return "triton" if t.is_cuda else "torch"


def cpu_is_torch() -> bool:
    """True unless INTQAT_BACKEND sends CPU tensors to the Triton interpreter (a cheap test for hot paths)."""
    choice = os.environ.get("INTQAT_BACKEND")
    return choice is None or choice.lower() in ("auto", "torch")  # anything else: backend_for decides / rejects


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
