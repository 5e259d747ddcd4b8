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


LATENCY_BURST = 4  # calls of one file in a row per round: the first after another file's, the rest back to back

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
    after_other = {name: [] for name in methods}  # the first call of each burst: another file ran just before it
    back_to_back = {name: [] for name in methods}  # the burst's other calls: the file ran just before itself
    for _ in range(spec["warmup"]):
        for m in methods.values():
            m.execute(inputs)
    names = list(methods)
    for r in range(spec["repeats"]):
        for name in names[r % len(names):] + names[:r % len(names)]:  # (the order rotates each round)
            for i in range(spec["burst"]):
                t0 = time.process_time()
                methods[name].execute(inputs)
                (back_to_back if i else after_other)[name].append((time.process_time() - t0) * 1e3)
    result[batch] = {"back_to_back": {n: statistics.median(back_to_back[n] or after_other[n]) for n in names},
                     "after_other": {n: statistics.median(after_other[n]) for n in names}}
print(json.dumps(result))
"""


def pte_latency(files: dict[str, str | os.PathLike], inputs: dict[int, tuple], repeats: int = 30,
                warmup: int = 3, burst: int = LATENCY_BURST,
                after_other: dict | None = None) -> dict[int, dict[str, float]]:
    """Median CPU ms per call of each .pte (name -> file) for each batch's inputs, {batch: {name: ms}}, called back
    to back as a deployer's process calls its one model: each round runs every file in turn (the order rotated
    each round), `burst` calls each, and the burst's calls after its first are the figure; the first calls (just
    after another file's) go into `after_other` ({batch: {name: ms}}) when a dict is given. time.process_time
    (counts this process only: on a shared machine the ratio holds), one XNNPACK thread, in a fresh Python that
    never imports intqat."""
    if burst < 1:
        raise ValueError(f"pte_latency: burst must be >= 1 (calls per file and round), got {burst}")
    import subprocess
    import sys

    with tempfile.TemporaryDirectory(prefix="intqat-pte-timing-") as tmp:
        paths = {}
        for batch, args in inputs.items():
            paths[str(batch)] = os.path.join(tmp, f"inputs_{batch}.pt")
            torch.save(tuple(args), paths[str(batch)])
        spec = {"files": {k: str(v) for k, v in files.items()}, "inputs": paths, "repeats": repeats, "warmup": warmup,
                "burst": burst}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _TIMING_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"timing the .pte files failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if after_other is not None:
        after_other.update({int(b): t["after_other"] for b, t in measured.items()})
    return {int(b): t["back_to_back"] for b, t in measured.items()}



def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
