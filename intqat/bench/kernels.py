"""`intqat-bench kernels`: every Triton kernel of intqat compiled for real NVIDIA GPUs, no GPU needed.

For each kernel, each way intqat's launchers can call it (epilogue, bias or not, output and
gradient dtypes, mask, LSQ, per-tensor or per-row activations), each GPU autotune config and each
arch, the kernel is compiled by Triton's own compiler and ptxas (see triton_target) and the cubin
read: registers per thread, spill stores / loads, shared memory, the int8 tensor-core
instructions in its SASS, and an occupancy estimate. A row fails when the kernel does not
compile, spills, needs more shared memory than the arch gives one block, or (GEMM kernels) holds
no int8 tensor-core instruction.

Shapes come in two classes, because Triton specializes on them and the cubins differ:
"aligned" (K, N and the leading strides multiples of 16: vector loads, cp.async pipelining)
and "ragged" (K and N not multiples of 16: byte loads, the pipeline staged in registers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from intqat.bench.table import Table
from intqat.bench.triton_target import ARCHS, ArchLimits, compile_for_target, cubin_stats, interpreting, occupancy, parse_arch

__all__ = ["SHAPES", "KernelCase", "kernel_cases", "select_cases", "compile_case", "compile_records", "problems",
           "format_table", "main"]

# Sizes per shape class. Only their divisibility by 16 reaches the compiler (and none may be 1,
# which Triton turns into a constant): small tensors specialize like big ones.
SHAPES = {"aligned": (48, 64, 80), "ragged": (40, 72, 88)}  # (M, N, K); ragged: 72 % 16 = 8, 88 % 16 = 8


@dataclass
class KernelCase:
    """One way a launcher calls one kernel: the arguments the launch passes (CPU tensors of the
    right dtypes and layouts), its constexprs, and the GPU configs the autotuner may pick."""

    kernel_name: str
    variant: str
    shape: str
    kernel: Any  # the @triton.autotune object, as the launcher launches it
    args: tuple
    constexprs: dict
    configs: list  # triton.Config: the ones the autotuner keeps for these arguments (its early_config_prune)
    tensor_cores: bool  # an int8 GEMM: its SASS must hold int8 tensor-core instructions, and its
    # float epilogue no fp32 fma (docs/numerics.md rounds the product and the bias add separately)


def _kept(kernel, prune: Callable, configs: list, args: tuple) -> list:
    """The GPU configs the kernel's autotuner keeps for a launch with these arguments."""
    import triton

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False  # the pruner passes everything through in the interpreter
        return prune(configs, dict(zip(kernel.arg_names, args)))


def _gemm_cases(shape: str) -> list[KernelCase]:
    from intqat.kernels import int_gemm as g

    M, N, K = SHAPES[shape]
    i8, i32, f32 = torch.int8, torch.int32, torch.float32
    a = torch.zeros(M, K, dtype=i8)
    q_w = torch.zeros(N, K, dtype=i8)
    zp_t, zp_r = torch.zeros(1, dtype=i32), torch.zeros(M, dtype=i32)
    s_t, s_r = torch.ones(1), torch.ones(M)
    colsum, w_scale = torch.zeros(N, dtype=i32), torch.ones(N)
    cases = []

    def add(variant, b, c, epilogue, **vectors):
        args, constexprs = g.gemm_launch_args(a, b, c, epilogue, **vectors)
        cases.append(KernelCase("int_gemm", variant, shape, g._int_gemm_kernel, args, constexprs,
                                _kept(g._int_gemm_kernel, g.prune_configs, g.gpu_configs(), args), True))

    # int_mm: b (K, N) row-major, as torch._int_mm's callers pass it
    add("int_mm", torch.zeros(K, N, dtype=i8), torch.empty(M, N, dtype=i32), "none")
    # the linear ops: b = q_wᵀ, K-major, no copy
    add("accumulator", q_w.t(), torch.empty(M, N, dtype=i32), "zero_point", x_zero_point=zp_t, w_colsum=colsum)
    for out in (f32, torch.bfloat16, torch.float16):
        for bias in (None, torch.zeros(N, dtype=out)):
            name = f"float {str(out).removeprefix('torch.')}{' +bias' if bias is not None else ''}"
            add(name, q_w.t(), torch.empty(M, N, dtype=out), "float", x_zero_point=zp_t, w_colsum=colsum,
                x_scale=s_t, w_scale=w_scale, bias=bias)
    # dynamic activations: per-row scale and zero point (int_linear's x_dynamic)
    add("float float32 +bias per-row x", q_w.t(), torch.empty(M, N, dtype=f32), "float", x_zero_point=zp_r,
        w_colsum=colsum, x_scale=s_r, w_scale=w_scale, bias=torch.zeros(N))
    for bias in (None, torch.zeros(N)):
        add(f"int8{' +bias' if bias is not None else ''}", q_w.t(), torch.empty(M, N, dtype=i8), "int8",
            x_zero_point=zp_t, w_colsum=colsum, x_scale=s_t, w_scale=w_scale, bias=bias,
            out_inv_scale=torch.ones(1), out_zero_point=torch.zeros(1, dtype=i32))
    return cases


def _ste_cases(shape: str) -> list[KernelCase]:
    from intqat.kernels import ste_backward as s

    M, N, K = SHAPES[shape]
    f32 = torch.float32
    q_w = torch.zeros(N, K, dtype=torch.int8)
    q_x = torch.zeros(M, K, dtype=torch.int8)
    cases = []
    for dtype in (f32, torch.bfloat16, torch.float16):
        dt = str(dtype).removeprefix("torch.")
        g = torch.zeros(M, N, dtype=dtype)
        for masked in (False, True):
            mask = torch.zeros(M, K, dtype=torch.bool) if masked else None
            out = torch.empty(M, K)
            args, constexprs = s.grad_input_launch_args(g, q_w, torch.ones(N), mask, out if masked else None, out,
                                                        block_k=s.GPU_BLOCK_K)
            configs = _kept(s._ste_grad_input_kernel, s.prune_grad_input_configs, s.gpu_configs("grad_input"), args)
            cases.append(KernelCase("ste_grad_input", f"{dt}{' mask' if masked else ''}", shape,
                                    s._ste_grad_input_kernel, args, constexprs, configs, False))
        for masked in (False, True):
            for lsq in (False, True):
                for per_row in (False, True) if dtype == f32 and not masked and not lsq else (False,):
                    x_scale = torch.ones(M if per_row else 1)
                    x_zp = torch.zeros(M if per_row else 1, dtype=torch.int32)
                    mask = torch.zeros(N, K, dtype=torch.bool) if masked else None
                    extra = dict(weight=torch.zeros(N, K, dtype=dtype), w_inv_scale=torch.ones(N),
                                 grad_s_partial=torch.empty(N, -(-K // s.GPU_BLOCK_K)), w_qmin=-127, w_qmax=127) if lsq else {}
                    args, constexprs = s.grad_weight_launch_args(g, q_x, x_scale, x_zp, mask, torch.empty(N, K),
                                                                 block_k=s.GPU_BLOCK_K, **extra)
                    name = dt + "".join(t for t, on in ((" mask", masked), (" lsq", lsq), (" per-row x", per_row)) if on)
                    configs = _kept(s._ste_grad_weight_kernel, s.prune_grad_weight_configs,
                                    s.gpu_configs("grad_weight"), args)
                    cases.append(KernelCase("ste_grad_weight", name, shape, s._ste_grad_weight_kernel, args,
                                            constexprs, configs, False))
    return cases


def kernel_cases(shapes: Iterable[str] = tuple(SHAPES)) -> list[KernelCase]:
    """Every (kernel, launch variant, shape class) intqat can launch."""
    cases = []
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape class {shape!r}: choose from {', '.join(SHAPES)}")
        cases += _gemm_cases(shape) + _ste_cases(shape)
    return cases


def config_label(config) -> str:
    """'128x256x64 g8 w8 s3': the tile (BLOCK_M x BLOCK_N x BLOCK_K, or rows x reduction), warps, stages."""
    kw = config.kwargs
    tile = "x".join(str(kw[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_O", "BLOCK_R") if k in kw)
    return f"{tile} w{config.num_warps} s{config.num_stages}"


def select_cases(shapes: Iterable[str] = tuple(SHAPES), kernels: Optional[Iterable[str]] = None,
                 variants: Optional[Iterable[str]] = None) -> list[KernelCase]:
    """kernel_cases filtered by kernel name and variant name (None: all)."""
    cases = kernel_cases(shapes)
    known = {c.kernel_name for c in cases}
    if kernels is not None and not set(kernels) <= known:
        raise ValueError(f"unknown kernel(s) {sorted(set(kernels) - known)}: choose from {sorted(known)}")
    cases = [c for c in cases if kernels is None or c.kernel_name in set(kernels)]
    if variants is not None:
        missing = set(variants) - {c.variant for c in cases}
        if missing:
            raise ValueError(f"unknown variant(s) {sorted(missing)}: choose from {sorted({c.variant for c in cases})}")
        cases = [c for c in cases if c.variant in set(variants)]
    return cases


def problems(record: dict) -> list[str]:
    """Why one compile record fails; empty when it passes."""
    if record["error"] is not None:
        return ["compile error"]
    out = []
    if record["spill_store_bytes"] or record["spill_load_bytes"]:
        out.append("spills")
    if record["shared"] > record["smem_per_block"]:
        out.append("shared memory")
    if record["tensor_cores"] and not record["int8_mma"]:
        out.append("no int8 tensor cores")
    if record["tensor_cores"] and record["ptx_fp32_fma"]:
        out.append("fused fp32 epilogue (fma)")
    return out


def compile_case(case: KernelCase, config, arch: ArchLimits) -> dict:
    """Compile one case for one config and arch -> a record (a compile error is recorded, not raised)."""
    record = {
        "kernel": case.kernel_name, "variant": case.variant, "shape": case.shape, "config": config_label(config),
        "arch": arch.name, "smem_per_block": arch.smem_per_block, "tensor_cores": case.tensor_cores, "error": None,
        "registers": None, "stack": None, "spill_store_bytes": 0, "spill_load_bytes": 0, "shared": 0, "int8_mma": {},
        "ptx_fp32_fma": 0, "blocks_per_sm": None, "occupancy": None,
    }
    t0 = time.perf_counter()
    try:
        stats = cubin_stats(compile_for_target(case.kernel, case.args, case.constexprs, config, arch))
    except Exception as e:  # noqa: BLE001 - any failure is this row's result, named in the table
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        record["error"] = f"{type(e).__name__}: {lines[-1][:200] if lines else ''}"  # the message, after any source
    else:
        blocks, occ = occupancy(stats, arch)
        record.update(registers=stats.registers, stack=stats.stack, spill_store_bytes=stats.spill_store_bytes,
                      spill_load_bytes=stats.spill_load_bytes, shared=stats.shared, int8_mma=dict(stats.int8_mma),
                      ptx_fp32_fma=stats.ptx_fp32_fma,
                      blocks_per_sm=blocks, occupancy=round(occ, 4))
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["problems"] = problems(record)
    return record


def compile_records(archs: Iterable[str], shapes: Iterable[str] = tuple(SHAPES), kernels: Optional[Iterable[str]] = None,
                    variants: Optional[Iterable[str]] = None, configs: Optional[Iterable[str]] = None,
                    progress: Callable[[str], None] | None = None, only: Optional[list] = None) -> list[dict]:
    """Compile every selected case x GPU config (by label, None: all) x arch; -> one record each.
    `only`: a list of [kernel, variant, shape] to keep (None: every selected case).

    Where this process's triton interprets (TRITON_INTERPRET=1, as in the test suite), the
    compiles run in a child process without the variable (see triton_target) and the records
    come back as JSON; progress lines then arrive on this process's stderr.
    """
    request = {"archs": list(archs), "shapes": list(shapes), "kernels": None if kernels is None else list(kernels),
               "variants": None if variants is None else list(variants),
               "configs": None if configs is None else list(configs),
               "only": None if only is None else [list(t) for t in only]}
    arch_limits = [parse_arch(a) for a in request["archs"]]  # bad names fail here, not in the child
    cases = select_cases(request["shapes"], request["kernels"], request["variants"])
    if only is not None:
        cases = [c for c in cases if [c.kernel_name, c.variant, c.shape] in request["only"]]
    if interpreting():
        return _compile_in_child(request, progress is not None)
    jobs = [(case, config, arch) for case in cases for config in case.configs
            if configs is None or config_label(config) in request["configs"] for arch in arch_limits]
    records = []
    for case, config, arch in jobs:
        records.append(compile_case(case, config, arch))
        if progress is not None:
            r = records[-1]
            progress(f"[{len(records)}/{len(jobs)}] {r['kernel']} {r['variant']} {r['shape']} {r['config']} "
                     f"{r['arch']}: {r['seconds']:.1f} s" + (f"  {', '.join(r['problems'])}" if r["problems"] else ""))
    return records


def _compile_in_child(request: dict, show_progress: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        cmd = [sys.executable, "-m", "intqat.bench.kernels", json.dumps(request), str(out)]
        if show_progress:
            cmd.append("--progress")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None if show_progress else subprocess.PIPE,
                              text=True)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the compile child process failed (exit {proc.returncode}):\n{proc.stderr or ''}"
                               f"{proc.stdout}")
        return json.loads(out.read_text())


def _tc_cell(record: dict) -> str:
    if not record["int8_mma"]:
        return "-"
    return " ".join(f"{'.'.join(op.split('.')[:2])} x{n}" for op, n in sorted(record["int8_mma"].items()))


def format_table(records: list[dict]) -> Table:
    """The report: one row per compile, grouped by kernel and shape class."""
    import triton

    archs = [ARCHS[a] for a in dict.fromkeys(r["arch"] for r in records)]
    t = Table(
        title="intqat-bench kernels: Triton kernels compiled for NVIDIA GPUs (no GPU used)",
        header_lines=[
            f"triton {triton.__version__}, ptxas / cuobjdump from its wheel; "
            + ", ".join(f"{a.name} = {a.example}, {a.smem_per_block // 1024} KiB smem per block" for a in archs),
            "shapes: aligned = K, N multiples of 16 (vector loads, cp.async); ragged = K, N not (byte loads)",
        ],
        columns=["kernel / variant", "shape", "config", "arch", "regs", "spill st/ld B", "smem B", "int8 tensor-core SASS",
                 "occupancy", "status"],
    )
    group = None
    for r in records:
        if (r["kernel"], r["shape"]) != group:
            group = (r["kernel"], r["shape"])
            t.group(f"{r['kernel']}, {r['shape']}")
        if r["error"] is not None:
            cells = ["-"] * 5
        else:
            cells = [str(r["registers"]), f"{r['spill_store_bytes']}/{r['spill_load_bytes']}", str(r["shared"]),
                     _tc_cell(r), f"{r['blocks_per_sm']} blk {r['occupancy']:.0%}"]
        status = ("FAIL: " + ", ".join(r["problems"])) if r["problems"] else "ok"
        if r["error"] is not None:
            status += f" ({r['error']})"
        t.add([r["variant"], r["shape"], r["config"], r["arch"], *cells, status], r)
    failed = [r for r in records if r["problems"]]
    t.footnotes += [
        "regs: registers per thread (255 = the cap). spill st/ld: bytes of local-memory stores / loads in the SASS.",
        "occupancy: resident blocks per SM and warps / max warps, from registers, shared memory and warps (estimate).",
        "int8 tensor-core SASS: IMMA = mma.sync (sm_80+), IGMMA = wgmma (sm_90). The STE kernels are fp32 dots "
        "(input_precision='ieee'): FMA units, no tensor cores by design.",
        "int_gemm rows also fail on an fp32 fma in the PTX: the epilogue must round float(acc) * scale and + bias "
        "separately, as the CPU path does.",
        f"{len(records) - len(failed)} of {len(records)} compiles pass; {len(failed)} fail.",
    ]
    return t


def main(arch_list: str, shapes: str, kernels: Optional[str], json_out: dict, quiet: bool = False) -> int:
    """The CLI body: prints the table; 0 if every compile passes, 1 if any fails (the table says which)."""
    archs = [parse_arch(a).name for a in arch_list.split(",") if a.strip()]
    shape_list = [s.strip() for s in shapes.split(",") if s.strip()]
    names = [k.strip() for k in kernels.split(",") if k.strip()] if kernels else None
    progress = None if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    records = compile_records(archs, shape_list, names, progress=progress)
    table = format_table(records)
    print(table.render(), flush=True)
    json_out["kernels"] = table.to_dict()
    return 1 if any(r["problems"] for r in records) else 0


if __name__ == "__main__":
    # The child process of _compile_in_child: argv = request JSON, output path [, --progress].
    _request = json.loads(sys.argv[1])
    _progress = (lambda line: print(line, file=sys.stderr, flush=True)) if "--progress" in sys.argv[3:] else None
    _records = compile_records(**_request, progress=_progress)
    _tmp = sys.argv[2] + ".tmp"
    Path(_tmp).write_text(json.dumps(_records))
    os.replace(_tmp, sys.argv[2])
