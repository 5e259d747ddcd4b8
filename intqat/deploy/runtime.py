"""The .pte in ExecuTorch's runtime, from Python: load it (with ExecuTorch's quantized kernels), run it in pieces of
at most its largest batch, and time .pte files in a fresh Python that never imports intqat.

Kept apart from executorch.py (which makes the file): this is what a deployer's process does with it.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from intqat.deploy._require import require

__all__ = ["LoadedPte", "load_pte", "run_pte", "pte_latency", "cpu_name", "chunks"]


def chunks(args: tuple, size: int) -> list[tuple]:
    """Split a batch along dim 0 into pieces of at most `size` (the .pte's largest batch)."""
    n = args[0].shape[0]
    return [tuple(a[i:i + size].contiguous() if isinstance(a, Tensor) else a for a in args) for i in range(0, n, size)]


class LoadedPte:
    """A .pte's forward in ExecuTorch's runtime. Holds the Program too: a Method reads the program's buffer, which
    must outlive it (a Method whose Program was collected crashes the process)."""

    def __init__(self, program, method):
        self.program, self.method = program, method

    def execute(self, inputs: Sequence[Any]) -> list:
        return list(self.method.execute(list(inputs)))


def load_pte(source: str | os.PathLike | bytes) -> LoadedPte:
    """The .pte's forward method in ExecuTorch's runtime (with its quantized kernels registered)."""
    require("pte")
    import executorch.kernels.quantized  # noqa: F401  (registers embedding_byte / embedding_4bit & co.)
    from executorch.runtime import Runtime

    data = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source)
    program = Runtime.get().load_program(data)
    method = program.load_method("forward")
    if method is None:
        raise ValueError(f"{source if not isinstance(source, bytes) else 'the program'} has no forward method")
    return LoadedPte(program, method)


def run_pte(method, args: tuple, max_batch: int) -> list[Tensor]:
    """forward(*args) through the .pte, in pieces of at most max_batch, outputs concatenated on dim 0."""
    outs = [method.execute(part) for part in chunks(args, max_batch)]
    return [torch.cat([o[i] for o in outs]) for i in range(len(outs[0]))]


# Timed in a fresh Python that never imports intqat: the .pte files as a deployer loads them, and one XNNPACK thread
# set before any program is loaded. (_unsafe_reset_threadpool frees the pool that already-loaded XNNPACK delegates
# point to: resetting it in a process holding loaded programs made their next call deadlock, seen here.)
_TIMING_SCRIPT = r"""
import json, statistics, sys, time
import torch
from executorch.extension.pybindings import portable_lib
portable_lib._unsafe_reset_threadpool(1)
import executorch.kernels.quantized  # noqa: F401
from executorch.runtime import Runtime
spec = json.loads(sys.argv[1])
runtime = Runtime.get()
programs = {name: runtime.load_program(path) for name, path in spec["files"].items()}
methods = {name: p.load_method("forward") for name, p in programs.items()}
result = {}
for batch, path in spec["inputs"].items():
    inputs = list(torch.load(path))
    times = {name: [] for name in methods}
    for _ in range(spec["warmup"]):
        for m in methods.values():
            m.execute(inputs)
    for _ in range(spec["repeats"]):
        for name, m in methods.items():
            t0 = time.process_time()
            m.execute(inputs)
            times[name].append((time.process_time() - t0) * 1e3)
    result[batch] = {name: statistics.median(t) for name, t in times.items()}
print(json.dumps(result))
"""


def pte_latency(files: dict[str, str | os.PathLike], inputs: dict[int, tuple], repeats: int = 30,
                warmup: int = 3) -> dict[int, dict[str, float]]:
    """Median CPU ms per call of each .pte (name -> file) for each batch's inputs, one call of each per round
    (interleaved), time.process_time (counts this process only: on a shared machine the ratio holds), one XNNPACK
    thread, in a fresh Python that never imports intqat."""
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="intqat-pte-timing-") as tmp:
        paths = {}
        for batch, args in inputs.items():
            paths[str(batch)] = os.path.join(tmp, f"inputs_{batch}.pt")
            torch.save(tuple(args), paths[str(batch)])
        spec = {"files": {k: str(v) for k, v in files.items()}, "inputs": paths, "repeats": repeats, "warmup": warmup}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _TIMING_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"timing the .pte files failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    last = done.stdout.strip().splitlines()[-1]
    return {int(b): t for b, t in json.loads(last).items()}



def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
