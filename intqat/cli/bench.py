"""intqat-bench: speed and memory of intqat's integer ops and modules against their peers.

    intqat-bench ops                 int_mm and one linear layer (M=256, K=N=1024)
    intqat-bench modules             train steps of an MLP and a CNN, peak memory, deploy mismatch
    intqat-bench modules --loop-optimizer   the same with Adam's per-parameter loop (torch's default)
    intqat-bench all --json out.json both, and the raw numbers (every repeat) as JSON
    intqat-bench ops --quick         a seconds-long smoke run on small shapes (numbers not meaningful)
    intqat-bench export              exported mixed-precision program vs fp32 eager (digits MLP)
    intqat-bench deploy              int8 .pte (ExecuTorch, XNNPACK) and ONNX (Q/DQ, integer ops; onnxruntime)
                                     vs their fp32 twins: latency at batch 1 and 32, size, agreement
                                     (digits MLP, a BERT-tiny-like encoder; needs intqat[deploy])
    intqat-bench compile             torch.compile vs eager train step of the integer MLP and CNN
    intqat-bench modules --models resnet,mbconv,convnext,encoder,llama   the real-model blocks (issue 27; 'all': every model)
    intqat-bench profile             torch.profiler top ops of int_linear forward+backward
    intqat-bench profile --models resnet,llama   where a block's train step spends its time, fp32 vs integer, per op class
    intqat-bench kernels --arch sm_80,sm_90   the Triton kernels compiled for NVIDIA GPUs, no GPU needed
                                     (registers, spills, shared memory, tensor cores; exit 1 on a failure)
    intqat-bench gpu                 Triton kernels vs cuBLASLt / bf16 / torchao on a CUDA device
                                     (exit 3 where there is none)

Every number is a ratio against an anchor timed in the same run (see intqat.bench.timing); run
on a quiet machine: the header prints the load average, and with 2 cores another busy process
stalls torch's OpenMP threads and skews ratios between kernels with many and few parallel regions.
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import time
import warnings
from dataclasses import replace

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="intqat-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("ops", "int_mm and linear forward+backward"), ("modules", "MLP and CNN train steps"),
                        ("export", "exported mixed-precision program vs fp32 eager vs integer eval"),
                        ("compile", "torch.compile vs eager train step of the integer models"),
                        ("deploy", "int8 .pte (XNNPACK) and ONNX vs fp32 files: latency, size, agreement"),
                        ("all", "ops, modules, export, compile"), ("profile", "top ops of int_linear forward+backward")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--quick", action="store_true", help="small shapes, 2 repeats: a smoke run (numbers not meaningful)")
        sp.add_argument("--repeats", type=int, default=None, help="timed repeats per candidate (median reported)")
        sp.add_argument("--json", metavar="PATH", default=None, help="also write the results (every repeat) as JSON")
        if name in ("modules", "all"):
            sp.add_argument("--loop-optimizer", action="store_true",
                            help="time Adam's default per-parameter loop instead of the recipes' fused Adam")
        if name in ("modules", "all", "profile"):
            sp.add_argument("--models", default=None,
                            help="comma-separated: mlp, cnn, cnn_cl, encoder, dwsep, resnet, mbconv, convnext, llama, "
                                 "or all (modules' default: mlp, cnn, cnn_cl, encoder, dwsep; profile: int_linear "
                                 "alone unless given)")
        if name in ("ops", "all", "profile"):
            sp.add_argument("-M", type=int, default=None, help="rows of x (tokens); default 256")
            sp.add_argument("-K", type=int, default=None, help="in features; default 1024")
            sp.add_argument("-N", type=int, default=None, help="out features; default 1024")
    sp = sub.add_parser("kernels", help="compile every Triton kernel for NVIDIA GPUs (no GPU needed)")
    sp.add_argument("--arch", default="sm_80,sm_90", help="comma-separated targets: sm_80, sm_86, sm_89, sm_90")
    sp.add_argument("--shapes", default="aligned,ragged", help="shape classes: aligned (K, N %% 16 == 0), ragged")
    sp.add_argument("--kernel", default=None, help="only these kernels (comma-separated): int_gemm, ste_grad_input, "
                    "ste_grad_weight")
    sp.add_argument("--quiet", action="store_true", help="no progress line per compile on stderr")
    sp.add_argument("--json", metavar="PATH", default=None, help="also write every compile's record as JSON")
    sp = sub.add_parser("gpu", help="time the Triton kernels against their peers on a CUDA device")
    sp.add_argument("--quick", action="store_true", help="small shapes, few repeats: a smoke run")
    sp.add_argument("--repeats", type=int, default=None, help="timed repeats per candidate (median reported)")
    sp.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    return p


def _ops_settings(args):
    from intqat.bench.ops import OpsSettings

    s = OpsSettings.quick() if args.quick else OpsSettings()
    over = {k: v for k, v in (("M", args.M), ("K", args.K), ("N", args.N), ("repeats", args.repeats)) if v is not None}
    return replace(s, **over)


def _modules_settings(args):
    from intqat.bench.modules import ModulesSettings, parse_models

    s = ModulesSettings.quick() if args.quick else ModulesSettings()
    s = replace(s, fused_optimizer=not args.loop_optimizer, models=parse_models(args.models))
    return replace(s, repeats=args.repeats) if args.repeats is not None else s


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("kernels", "gpu"):
        return _gpu_command(args)
    if args.repeats is not None and args.repeats < 1:
        print("intqat-bench: --repeats must be >= 1", file=sys.stderr)
        return 2
    if getattr(args, "models", None):
        from intqat.bench.modules import parse_models

        try:
            parse_models(args.models)
        except ValueError as e:
            print(f"intqat-bench: {e}", file=sys.stderr)
            return 2
    from intqat.bench.timing import machine_info

    info = machine_info()  # once, before this run adds its own load
    out: dict = {}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peers' deprecation notices would bury the tables
        if args.command in ("ops", "all"):
            from intqat.bench.ops import run_ops

            table = run_ops(_ops_settings(args), info)
            print(table.render(), end="\n\n", flush=True)
            out["ops"] = table.to_dict()
        if args.command in ("modules", "all"):
            from intqat.bench.modules import run_modules

            table = run_modules(_modules_settings(args), info)
            print(table.render(), end="\n\n", flush=True)
            out["modules"] = table.to_dict()
        if args.command in ("export", "all"):
            from intqat.bench.export import format_table, run_export_bench

            rows = run_export_bench(quick=args.quick, repeats=args.repeats)
            print(format_table(rows), end="\n\n", flush=True)
            out["export"] = rows
        if args.command in ("compile", "all"):
            from intqat.bench.compile import format_table as compile_table, run_compile_bench

            rows = run_compile_bench(quick=args.quick, repeats=args.repeats)
            print(compile_table(rows, info), end="\n\n", flush=True)
            out["compile"] = rows
        if args.command == "deploy":
            from intqat.bench.deploy import run_deploy_bench
            from intqat.deploy import MissingDeployPackage

            try:
                table = run_deploy_bench(quick=args.quick, repeats=args.repeats, info=info)
            except MissingDeployPackage as e:
                print(f"intqat-bench deploy: {e}", file=sys.stderr)
                return 1
            print(table.render(), end="\n\n", flush=True)
            out["deploy"] = table.to_dict()
        if args.command == "profile" and args.models:
            from intqat.bench.modules import parse_models
            from intqat.bench.profile import profile_blocks

            text, rows = profile_blocks(parse_models(args.models), steps=args.repeats or (3 if args.quick else 10),
                                        quick=args.quick)
            print(text, flush=True)
            out["profile"] = rows
        elif args.command == "profile":
            from intqat.bench.profile import profile_int_linear

            s = _ops_settings(args)
            text, rows = profile_int_linear(s.M, s.K, s.N, steps=args.repeats or (5 if args.quick else 20))
            print(text, flush=True)
            out["profile"] = rows
    print(f"intqat-bench {args.command}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json:
        tmp = f"{args.json}.tmp"  # written whole, then renamed: never a half file
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return 0


def _gpu_command(args) -> int:
    """`kernels` and `gpu`: their own exit codes (kernels: 1 = a compile failed; gpu: 3 = no CUDA device)."""
    out: dict = {}
    t0 = time.perf_counter()
    if args.command == "kernels":
        from intqat.bench import kernels

        try:
            code = kernels.main(args.arch, args.shapes, args.kernel, out, quiet=args.quiet)
        except ValueError as e:  # an unknown arch / shape class / kernel name
            print(f"intqat-bench kernels: {e}", file=sys.stderr)
            return 2
    else:
        from intqat.bench import gpu

        if args.repeats is not None and args.repeats < 1:
            print("intqat-bench: --repeats must be >= 1", file=sys.stderr)
            return 2
        code = gpu.main(quick=args.quick, repeats=args.repeats, json_out=out)
    print(f"intqat-bench {args.command}: {time.perf_counter() - t0:.1f} s", flush=True)
    if args.json and out:
        tmp = f"{args.json}.tmp"  # written whole, then renamed: never a half file
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return code


if __name__ == "__main__":
    sys.exit(main())
