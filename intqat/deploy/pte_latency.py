"""The latency of an int8 .pte against its fp32 .pte, with the runtime's floor measured beside them.

The floor is a .pte of the same inputs that does almost nothing (its first input + 1, one XNNPACK delegate call):
what every call costs whatever the model (loading inputs, the method's instructions, one delegate call, the
output; from Python also the pybindings' conversions). Timed beside the two files in the same process, it gives
each file's time above the floor (model time = call - floor) and the ratio of those, beside the raw ratio. Two
runners, each in its own process, one XNNPACK thread, median CPU time per call of back-to-back calls (rounds that
run each file in turn, LATENCY_BURST calls each; the first of each burst, just after another file's, is kept
apart as "after_other": caches another model left, which a process serving one model does not see):
  python   executorch.runtime from a Python that never imports intqat (intqat.deploy.runtime.pte_latency)
  cpp      ExecuTorch's C++ runtime, no Python (intqat.deploy.pte_cpp: built on first use from the wheel's headers
           and libraries; when it cannot be built, the reason is in the result and only the Python figures exist)
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from intqat.deploy.runtime import LATENCY_BURST, cpu_name, pte_latency

__all__ = ["floor_pte", "measure_latency", "repeat_batch"]


class _Floor(nn.Module):
    """forward(*inputs) -> the first tensor input (as fp32) + 1: the least a program with these inputs does."""

    def forward(self, *inputs):
        first = next(a for a in inputs if isinstance(a, Tensor))
        return first.to(torch.float32) + 1


def floor_pte(args: tuple, max_batch: int) -> bytes:
    """The floor .pte for forward inputs like `args` (batch dynamic 1..max_batch, as export_pte's files)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    batch = torch.export.Dim("batch", min=1, max=max_batch)
    dims = tuple({0: batch} if isinstance(a, Tensor) and a.dim() else None for a in args)
    with torch.no_grad():
        program = torch.export.export(_Floor(), args, dynamic_shapes=(dims,))  # (forward(*inputs): one tuple)
    return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer


def repeat_batch(a: Any, b: int) -> Any:
    """a's samples repeated to a batch of b (the timing inputs)."""
    if not isinstance(a, Tensor) or not a.dim():
        return a
    reps = (b + a.shape[0] - 1) // a.shape[0]
    return a.repeat(reps, *([1] * (a.dim() - 1)))[:b].contiguous()


def _figures(t: dict[str, float], after_other: dict[str, float]) -> dict:
    int8, fp32, floor = t["int8"], t["fp32"], t["floor"]
    above8, above32 = int8 - floor, fp32 - floor
    return {"int8_ms": int8, "fp32_ms": fp32, "ratio": int8 / fp32, "floor_ms": floor,
            "int8_above_floor_ms": above8, "fp32_above_floor_ms": above32,
            # (None when the fp32 file is not measurably above the floor: no ratio to give)
            "ratio_above_floor": above8 / above32 if above32 > 0 and above8 >= 0 else None,
            "after_other": {"int8_ms": after_other["int8"], "fp32_ms": after_other["fp32"],
                            "ratio": after_other["int8"] / after_other["fp32"]}}


def measure_latency(buffer: bytes, fp32_buffer: bytes, args: tuple, batches: Sequence[int], repeats: int,
                    max_batch: int, cpp: bool = True) -> dict:
    """{"per_batch": {b: python figures + {"cpp": C++ figures}}, "cpp": "measured" or why not, ...}: each runner
    times the int8, fp32 and floor .pte files in rounds of back-to-back calls (module docstring)."""
    from intqat.deploy.pte_cpp import CppRunnerUnavailable, cpp_latency

    batches = [b for b in batches if b <= max_batch]
    if not batches:
        return {}
    inputs = {b: tuple(repeat_batch(a, b) for a in args) for b in batches}
    with tempfile.TemporaryDirectory(prefix="intqat-pte-") as tmp:
        files = {"int8": Path(tmp) / "int8.pte", "fp32": Path(tmp) / "fp32.pte", "floor": Path(tmp) / "floor.pte"}
        for name, data in (("int8", buffer), ("fp32", fp32_buffer), ("floor", floor_pte(args, max_batch))):
            files[name].write_bytes(data)
        python_after, cpp_after = {}, {}
        python = pte_latency(files, inputs, repeats, after_other=python_after)
        cpp_times, cpp_status = None, "not asked for"
        if cpp:
            try:
                cpp_times, cpp_status = cpp_latency(files, inputs, repeats, after_other=cpp_after), "measured"
            except CppRunnerUnavailable as e:
                cpp_status = f"not measured: {e}"
    per_batch = {}
    for b in batches:
        per_batch[b] = _figures(python[b], python_after[b])
        if cpp_times is not None:
            per_batch[b]["cpp"] = _figures(cpp_times[b], cpp_after[b])
    return {"per_batch": per_batch, "cpu": cpu_name(), "cpp": cpp_status,
            "method": f"median CPU time per call of back-to-back calls: {repeats} rounds, each running the int8, "
                      f"fp32 and floor .pte files in turn (the order rotated), {LATENCY_BURST} calls each, all but the "
                      "first timed as back to back (after_other: the first, just after another file's); 1 "
                      "XNNPACK thread; python: executorch.runtime in a Python that never imported intqat; cpp: "
                      "ExecuTorch's C++ runtime (Module API), no Python; floor: a .pte of the same inputs returning "
                      "its first input + 1 (one delegate call): the per-call cost no model avoids"}
