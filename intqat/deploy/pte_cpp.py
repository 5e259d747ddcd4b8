"""Timing .pte files in ExecuTorch's C++ runtime, without Python: kernels/cpu/pte_timer.cpp, built on first use
against the headers and shared libraries the executorch wheel ships (include/, lib/: libexecutorch, the XNNPACK
delegate, the optimized and quantized kernels, the thread pool), cached like intqat's kernels.

Why: from Python every call of a .pte pays the pybindings' conversion of inputs and outputs (measured here, Intel
Xeon AMX, executorch 1.5.1: ~4.5 µs of the ~5.2 µs an `x + 1` .pte takes per call at batch 1); a deployer calling
the runtime from C++ does not. For the digits MLP that is most of the call.

    cpp_runner()                  the built binary's path, or raise CppRunnerUnavailable with the reason
    cpp_latency(files, inputs, repeats, warmup, burst, after_other)   {batch: {name: median CPU ms}}, as
                                  runtime.pte_latency (back to back; the calls just after another file's in
                                  after_other)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from intqat.deploy.runtime import LATENCY_BURST

__all__ = ["CppRunnerUnavailable", "cpp_runner", "cpp_latency"]

# the wheel's libraries the runner links (--no-as-needed: the kernels and the delegate register themselves from
# static initializers, which an as-needed link would drop)
_LIBS = ("executorch", "executorch_kernels_optimized", "executorch_kernels_quantized", "executorch_backend_xnnpack",
         "executorch_threadpool")
_DTYPES = {torch.float32: "float32", torch.int64: "int64", torch.int32: "int32"}


class CppRunnerUnavailable(RuntimeError):
    """The C++ timer cannot be built here (no compiler, or a wheel without headers / libraries)."""


def _wheel_root() -> Path:
    import executorch

    return Path(next(iter(executorch.__path__)))


def cpp_runner() -> Path:
    """Build kernels/cpu/pte_timer.cpp once per (source, executorch, compiler) into intqat's cache; return it."""
    from importlib.metadata import version

    from intqat.ops.cbuild import cache_dir, kernel_sources

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise CppRunnerUnavailable("no C++ compiler (set CXX or install g++)")
    root = _wheel_root()
    include, lib = root / "include", root / "lib"
    missing = [str(p) for p in (include / "executorch/extension/module/module.h",
                                *(lib / f"lib{name}.so" for name in _LIBS)) if not p.exists()]
    if missing:
        raise CppRunnerUnavailable(f"this executorch wheel has no {', '.join(missing)}")
    src = kernel_sources(["pte_timer.cpp"])[0]
    flags = ["-std=c++17", "-O2", "-w", "-DC10_USING_CUSTOM_GENERATED_MACROS", "-DET_EVENT_TRACER_ENABLED",
             f"-I{include}", f"-I{include}/executorch/runtime/core/portable_type/c10"]
    link = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-Wl,--no-as-needed", *(f"-l{name}" for name in _LIBS)]
    key = hashlib.sha256(b"\0".join([src.read_bytes(), " ".join([compiler, *flags, *link]).encode(),
                                     version("executorch").encode()])).hexdigest()[:16]
    out = cache_dir() / f"pte_timer-{key}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pte_timer-", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, "-o", tmp, str(src), *link], capture_output=True, text=True)
        if proc.returncode != 0:
            raise CppRunnerUnavailable(f"building the C++ .pte timer failed: {proc.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: several processes may build at once
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cpp_latency(files: dict[str, str | os.PathLike], inputs: dict[int, tuple], repeats: int = 30,
                warmup: int = 3, burst: int = LATENCY_BURST,
                after_other: dict | None = None) -> dict[int, dict[str, float]]:
    """Median CPU ms per call of each .pte (name -> file) for each batch's inputs, back to back (runtime.pte_latency's
    rounds and bursts; the first call of each burst, just after another file's, in `after_other` when a dict is
    given), one XNNPACK thread, in ExecuTorch's C++ runtime (module docstring). Raises CppRunnerUnavailable with
    the reason."""
    if burst < 1:
        raise ValueError(f"cpp_latency: burst must be >= 1 (calls per file and round), got {burst}")
    runner = cpp_runner()
    with tempfile.TemporaryDirectory(prefix="intqat-pte-cpp-") as tmp:
        lines = [f"repeats {repeats}", f"warmup {warmup}", f"burst {burst}"]
        lines += [f"pte {name} {Path(path).resolve()}" for name, path in files.items()]
        for batch, args in inputs.items():
            for i, a in enumerate(args):
                if not isinstance(a, Tensor) or a.dtype not in _DTYPES:
                    raise CppRunnerUnavailable(f"input {i} is not a {'/'.join(_DTYPES.values())} tensor: the C++ "
                                               "timer takes tensors of those dtypes only")
                path = Path(tmp) / f"input_{batch}_{i}.bin"
                path.write_bytes(a.detach().contiguous().numpy().tobytes())
                lines.append(f"input {batch} {_DTYPES[a.dtype]} {','.join(map(str, a.shape))} {path}")
        spec = Path(tmp) / "spec.txt"
        spec.write_text("\n".join(lines) + "\n")
        done = subprocess.run([str(runner), str(spec)], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        err = [ln for ln in done.stderr.splitlines() if not ln.startswith("I ")]
        raise RuntimeError(f"the C++ .pte timer failed (exit {done.returncode}): {' '.join(err)[-1500:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if after_other is not None:
        after_other.update({int(b): t["after_other"] for b, t in measured.items()})
    return {int(b): t["back_to_back"] for b, t in measured.items()}
