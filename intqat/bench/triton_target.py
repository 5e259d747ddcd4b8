"""Compile a Triton kernel for a named NVIDIA GPU with no GPU present, and read what ptxas made of it.

    compiled = compile_for_target(kernel, args, kwargs, config, "sm_90")
    stats = cubin_stats(compiled)      # registers, spills, shared memory, tensor-core instructions

The kernel is specialized exactly as a launch with `args` would specialize it (Triton's own
specializer: ints equal to 1 and None become constants, ints and pointers divisible by 16 carry
tt.divisibility), so the cubin is the one a GPU would run for arguments shaped like these.

Needs a process in which triton was imported without TRITON_INTERPRET=1: with it, `@triton.jit`
returns interpreter functions, and so it did for triton.language's own library (tl.cdiv,
tl.zeros, tl.max... 83 functions in triton 3.9), which Triton's code generator cannot inline.
intqat.bench.kernels runs the compiles in a child process without the variable when the caller
has it set (the test suite does). The tools are the ones the triton wheel ships (ptxas,
cuobjdump under triton/backends/nvidia/bin).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction, create_function_from_signature

__all__ = ["ARCHS", "ArchLimits", "CubinStats", "compile_for_target", "cubin_stats", "interpreting", "occupancy",
           "parse_arch"]


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of one compute capability (CUDA C Programming Guide, "Technical
    Specifications per Compute Capability")."""

    name: str  # "sm_80"
    capability: int  # 80
    example: str  # a GPU of this class, for the table's header
    smem_per_block: int  # bytes, the opt-in maximum one block may use
    smem_per_sm: int  # bytes
    max_warps_per_sm: int
    max_blocks_per_sm: int
    regs_per_sm: int = 65536
    smem_reserved_per_block: int = 1024  # the CUDA runtime's own share per block (sm_80 and later)


ARCHS = {
    a.name: a
    for a in (
        ArchLimits("sm_80", 80, "A100", 163 * 1024, 164 * 1024, 64, 32),
        ArchLimits("sm_86", 86, "RTX 3090 / A10", 99 * 1024, 100 * 1024, 48, 16),
        ArchLimits("sm_89", 89, "RTX 4090 / L4", 99 * 1024, 100 * 1024, 48, 24),
        ArchLimits("sm_90", 90, "H100", 227 * 1024, 228 * 1024, 64, 32),
    )
}


def parse_arch(text: str) -> ArchLimits:
    """"sm_80" / "sm80" / "80" -> ARCHS["sm_80"]; a clear error for anything else."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)", text.strip().lower())
    name = f"sm_{m.group(1)}" if m else None
    if name not in ARCHS:
        raise ValueError(f"unknown arch {text!r}: choose from {', '.join(ARCHS)}")
    return ARCHS[name]


# ---------------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------------


def compile_for_target(kernel: Any, args: tuple, kwargs: dict[str, Any], config: triton.Config | None,
                       arch: ArchLimits) -> Any:
    """triton.compile of `kernel` for `arch`, specialized as a launch `kernel[grid](*args,
    **kwargs, **config.kwargs)` would be, with the config's num_warps / num_stages.

    Returns Triton's CompiledKernel (asm["ptx"], asm["cubin"], metadata.shared, ...). Tensors in
    `args` may live on the CPU: only their dtype and address alignment are read.
    """
    if interpreting():
        raise RuntimeError("compile_for_target needs triton imported without TRITON_INTERPRET=1 (its @jit functions "
                           "are interpreter functions here): run it in a child process without the variable")
    fn = kernel
    while isinstance(fn, (Autotuner, Heuristics)):
        fn = fn.fn
    if not isinstance(fn, JITFunction):
        raise TypeError(f"expected a @triton.jit kernel, got {type(fn).__name__}")
    target = GPUTarget("cuda", arch.capability, 32)
    backend = make_backend(target)
    launch = dict(kwargs)
    if config is not None:
        launch.update(config.all_kwargs())
    # Triton's launch path: bind, specialize each argument, split signature / constants / attributes.
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **launch)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def interpreting() -> bool:
    """True when this process's triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)


# ---------------------------------------------------------------------------------------------
# What ptxas made of it
# ---------------------------------------------------------------------------------------------

# int8 tensor-core instructions in SASS: IMMA (mma.sync, sm_75+) and IGMMA (wgmma, sm_90).
_TENSOR_CORE = re.compile(r"\b(IMMA|IGMMA)\.[0-9A-Za-z.x]*")
_FLOAT_TENSOR_CORE = re.compile(r"\b(HMMA|HGMMA)\.[0-9A-Za-z.x]*")
_SPILL = re.compile(r"\b(STL|LDL)(\.[0-9A-Z.]+)?\s")
_WIDTH = {".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}


@dataclass
class CubinStats:
    """One cubin as ptxas left it. Spill bytes are summed over the SASS's local-memory
    stores / loads (STL / LDL x their width), which is what `ptxas -v` reports."""

    registers: int  # per thread
    stack: int  # bytes of stack frame per thread
    spill_store_bytes: int
    spill_load_bytes: int
    shared: int  # bytes of dynamic shared memory per block (Triton's own allocation)
    num_warps: int
    int8_mma: Counter  # SASS opcode (e.g. "IMMA.16832.S8.S8.SAT") -> count
    float_mma: Counter
    ptx_fp32_fma: int  # fma.rn.f32 in the PTX: fp32 multiply-adds, explicit or contracted by fp fusion
    sass: str


def _tool(name: str) -> str:
    return getattr(triton.knobs.nvidia, name).path


def cubin_stats(compiled: Any) -> CubinStats:
    """Registers, spills, shared memory and tensor-core instructions of a CompiledKernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)],
                               check=True, capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(path)], check=True, capture_output=True,
                              text=True).stdout
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if reg is None or stack is None:
        raise RuntimeError(f"cuobjdump --dump-resource-usage printed no REG / STACK:\n{usage}")
    stores = loads = 0
    for m in _SPILL.finditer(sass):
        width = next((w for suffix, w in _WIDTH.items() if (m.group(2) or "").startswith(suffix)), 4)
        if m.group(1) == "STL":
            stores += width
        else:
            loads += width
    return CubinStats(
        registers=int(reg.group(1)),
        stack=int(stack.group(1)),
        spill_store_bytes=stores,
        spill_load_bytes=loads,
        shared=int(compiled.metadata.shared),
        num_warps=int(compiled.metadata.num_warps),
        int8_mma=Counter(m.group(0) for m in _TENSOR_CORE.finditer(sass)),
        float_mma=Counter(m.group(0) for m in _FLOAT_TENSOR_CORE.finditer(sass)),
        ptx_fp32_fma=len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32\b", compiled.asm["ptx"])),
        sass=sass,
    )


def occupancy(stats: CubinStats, arch: ArchLimits) -> tuple[int, float]:
    """(resident blocks per SM, resident warps / the SM's maximum), from registers (allocated
    per warp in units of 256), shared memory (plus the runtime's 1 KiB per block), warps and
    the block limit. An estimate: it ignores the L1 / shared-memory carve-out the driver picks."""
    regs_per_warp = -(-max(stats.registers, 1) * 32 // 256) * 256
    by_regs = (arch.regs_per_sm // regs_per_warp) // stats.num_warps
    by_smem = arch.smem_per_sm // (stats.shared + arch.smem_reserved_per_block)
    by_warps = arch.max_warps_per_sm // stats.num_warps
    blocks = max(0, min(by_regs, by_smem, by_warps, arch.max_blocks_per_sm))
    return blocks, blocks * stats.num_warps / arch.max_warps_per_sm
