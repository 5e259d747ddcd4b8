"""An ONNX file in onnxruntime (CPU), from Python: a session, a forward call, the comparison with intqat's integer
model, and timing files in a fresh Python that imports onnxruntime and numpy only.

Kept apart from onnx.py (which makes the file): this is what a deployer's process does with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from intqat.deploy.runtime import LATENCY_BURST

__all__ = ["session", "run_session", "compare", "onnx_latency", "floor_model", "ort_graph", "SESSION_OPTIONS",
           "INTEGER_KERNELS", "FLOAT_GEMMS"]

# The session options the latency is measured with (and every report states): onnxruntime's defaults a deployer gets
# (all graph optimizations, which include the Q/DQ fusion; sequential execution) on one thread. Measured and left out
# (AMX Xeon, onnxruntime 1.32): session.qdqisint8allowed=1 (int8 activations kept int8 instead of shifted to uint8)
# took the Q/DQ encoder from 0.86x to 2.9x the fp32 time: x86's fast int8 kernels are uint8 x int8. Spinning and
# inter-op threads do not apply to one thread.
SESSION_OPTIONS = {"graph_optimization_level": "ORT_ENABLE_ALL", "execution_mode": "ORT_SEQUENTIAL",
                   "intra_op_num_threads": 1, "inter_op_num_threads": 1}

# onnxruntime's integer kernels a Q/DQ GEMM / conv becomes when its optimizer fuses it, and the float ones it runs
# when it does not (attention's own products are float GEMMs too: the model keeps them float)
INTEGER_KERNELS = ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "QLinearConv", "DynamicQuantizeMatMul",
                   "MatMulInteger", "ConvInteger", "MatMulNBits", "QAttention", "DynamicQuantizeLSTM")
FLOAT_GEMMS = ("Gemm", "FusedGemm", "MatMul", "FusedMatMul", "Conv", "FusedConv")


def _options(threads: int | None = None, optimized_path: str | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only (its warnings about serializing optimized models are not ours)
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, SESSION_OPTIONS["graph_optimization_level"])
    options.execution_mode = getattr(ort.ExecutionMode, SESSION_OPTIONS["execution_mode"])
    if threads is not None:
        options.intra_op_num_threads = threads
    if optimized_path is not None:
        options.optimized_model_filepath = optimized_path
    return options


def session(model: bytes | str | os.PathLike, threads: int | None = None):
    """An onnxruntime InferenceSession on the CPU provider (SESSION_OPTIONS' optimizations: what a deployer gets)."""
    import onnxruntime as ort

    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, _options(threads), providers=["CPUExecutionProvider"])


def ort_graph(model: bytes | str | os.PathLike) -> dict[str, Any]:
    """What onnxruntime (CPU) runs after its graph optimizations (SESSION_OPTIONS; its optimized_model_filepath): the
    op counts, the integer kernels it fused Q/DQ patterns into, the float GEMM-class ops left, the Q / DQ nodes left
    (a DequantizeLinear of a weight left there runs at every call)."""
    import collections

    import onnx

    source = model if isinstance(model, bytes) else str(model)
    with tempfile.TemporaryDirectory(prefix="intqat-ort-graph-") as tmp:
        import onnxruntime as ort

        path = os.path.join(tmp, "optimized.onnx")
        ort.InferenceSession(source, _options(1, path), providers=["CPUExecutionProvider"])
        ops = collections.Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node)
    pick = lambda names: {k: ops[k] for k in names if ops.get(k)}  # noqa: E731
    return {"ops": dict(sorted(ops.items())), "integer_kernels": pick(INTEGER_KERNELS),
            "float_gemms": pick(FLOAT_GEMMS),
            "quantize_linear": ops.get("QuantizeLinear", 0), "dequantize_linear": ops.get("DequantizeLinear", 0),
            "session_options": dict(SESSION_OPTIONS)}


def floor_model(example_inputs: Sequence[Tensor]) -> bytes:
    """An ONNX file that returns its inputs (Identity): the same inputs as the model, the batch symbolic. Timed beside
    the model, it is onnxruntime's fixed cost of one InferenceSession.run from Python (feeds in, outputs out as numpy:
    the output here is the input's size, an upper bound on a classifier's small output), the floor under any file's
    batch-1 latency."""
    import onnx
    from onnx import helper

    tensors = [a for a in example_inputs if isinstance(a, Tensor)]
    dtype = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
             torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32}
    ins, outs, nodes = [], [], []
    for i, t in enumerate(tensors):
        if t.dtype not in dtype:
            raise ValueError(f"floor_model: input {i} has dtype {t.dtype}; supported: {sorted(map(str, dtype))}")
        shape = ["batch", *t.shape[1:]] if t.dim() else []
        ins.append(helper.make_tensor_value_info(f"x{i}", dtype[t.dtype], shape))
        outs.append(helper.make_tensor_value_info(f"y{i}", dtype[t.dtype], shape))
        nodes.append(helper.make_node("Identity", [f"x{i}"], [f"y{i}"]))
    graph = helper.make_graph(nodes, "onnxruntime_floor", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


def run_session(sess, args: Sequence[Any]) -> list[Tensor]:
    """forward(*args) through the session: the tensor inputs in order, the outputs as torch tensors."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    names = [i.name for i in sess.get_inputs()]
    if len(names) != len(tensors):
        raise ValueError(f"the ONNX file takes {len(names)} inputs ({', '.join(names)}), got {len(tensors)} tensors")
    outs = sess.run(None, {n: t.detach().contiguous().numpy() for n, t in zip(names, tensors)})
    return [torch.from_numpy(o) for o in outs]


def compare(sess, reference, batches: list[tuple[tuple, Tensor | None]]) -> dict[str, Any]:
    """The session against the integer model on (inputs, labels or None) batches: bit-exact flag, max |diff| in units
    of the output's step (max |y| / 127 of the integer model's outputs), top-1 agreement, SQNR, accuracy."""
    exact, max_diff, ref_amax, err2, sig2, samples = True, 0.0, 0.0, 0.0, 0.0, 0
    preds, preds_ref, labels = [], [], []
    for args, y in batches:
        got = run_session(sess, args)
        with torch.no_grad():
            out = reference(*args)
        want = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]
        if len(got) != len(want):
            raise ValueError(f"the ONNX file returns {len(got)} tensors, the integer model {len(want)}")
        for g, w in zip(got, want):
            if g.shape != w.shape:
                raise ValueError(f"the ONNX file returns shape {tuple(g.shape)} where the integer model returns "
                                 f"{tuple(w.shape)}")
            exact &= torch.equal(g, w.to(g.dtype)) and g.dtype == w.dtype
            d = (g.double() - w.double()).abs()
            if d.numel():
                max_diff, ref_amax = max(max_diff, float(d.max())), max(ref_amax, float(w.abs().max()))
            err2, sig2 = err2 + float((d ** 2).sum()), sig2 + float((w.double() ** 2).sum())
        if got[0].dim():
            preds.append(got[0].argmax(-1).reshape(-1))
            preds_ref.append(want[0].argmax(-1).reshape(-1))
            samples += got[0].shape[0]
        if y is not None:
            labels.append(torch.as_tensor(y).reshape(-1))
    import math

    step = ref_amax / 127 if ref_amax else 1.0
    out = {"batches": len(batches), "samples": samples, "bit_exact": bool(exact), "max_abs_diff": max_diff,
           "output_step": step, "max_diff_in_steps": max_diff / step,
           "output_step_is": "max |output| / 127 of the integer model: one step of a symmetric int8 grid over the "
                             "output's range",
           "sqnr_db": math.inf if err2 == 0 else 10 * math.log10(sig2 / err2) if sig2 else 0.0}
    if preds:
        pred, pred_ref = torch.cat(preds), torch.cat(preds_ref)
        out["top1_agreement"] = float((pred == pred_ref).float().mean())
        if labels:
            lab = torch.cat(labels)
            if lab.numel() == pred.numel():
                out["accuracy"] = float((pred == lab).float().mean())
                out["accuracy_integer"] = float((pred_ref == lab).float().mean())
    return out


# Timed in a fresh Python that imports onnxruntime and numpy only: the files as a deployer loads them, one thread.
_TIMING_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
import onnxruntime as ort
spec = json.loads(sys.argv[1])
settings = spec["options"]
options = ort.SessionOptions()
options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, settings["graph_optimization_level"])
options.execution_mode = getattr(ort.ExecutionMode, settings["execution_mode"])
options.intra_op_num_threads = settings["intra_op_num_threads"]
options.inter_op_num_threads = settings["inter_op_num_threads"]
options.log_severity_level = 3
sessions = {name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for name, path in spec["files"].items()}
result = {}
for batch, path in spec["inputs"].items():
    arrays = np.load(path)
    inputs = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    feeds = {name: {i.name: a for i, a in zip(s.get_inputs(), inputs)} for name, s in sessions.items()}
    after_other = {name: [] for name in sessions}  # the first call of each burst: another file ran just before it
    back_to_back = {name: [] for name in sessions}  # the burst's other calls: the file ran just before itself
    for _ in range(spec["warmup"]):
        for name, s in sessions.items():
            s.run(None, feeds[name])
    names = list(sessions)
    for r in range(spec["repeats"]):
        # the order rotates each round: a burst's first call depends on what ran just before it (the caches it left)
        for name in names[r % len(names):] + names[:r % len(names)]:
            for i in range(spec["burst"]):
                t0 = time.process_time()
                sessions[name].run(None, feeds[name])
                (back_to_back if i else after_other)[name].append((time.process_time() - t0) * 1e3)
    result[batch] = {"back_to_back": {n: statistics.median(back_to_back[n] or after_other[n]) for n in names},
                     "after_other": {n: statistics.median(after_other[n]) for n in names}}
assert not any(m == "intqat" or m.startswith("intqat.") for m in sys.modules)
print(json.dumps(result))
"""


def onnx_latency(files: dict[str, str | os.PathLike], inputs: dict[int, tuple], repeats: int = 30,
                 warmup: int = 5, floor: bool = True, burst: int = LATENCY_BURST,
                 after_other: dict | None = None) -> dict[int, dict[str, float]]:
    """Median CPU ms per call of each ONNX file (name -> path) for each batch's inputs, {batch: {name: ms}}, called
    back to back as a deployer's process calls its one model: each round runs every file in turn (the order
    rotated each round), `burst` calls each, and the burst's calls after its first are the figure. The first
    calls, each made just after another file's (what per-call interleaving measured before 2026-11-28: the caches
    and onnxruntime's per-session state another model left), go into `after_other` ({batch: {name: ms}}) when a
    dict is given. time.process_time (this process only: on a shared machine the ratio holds), SESSION_OPTIONS
    (one onnxruntime thread), in a fresh Python that never imports intqat. floor: also the floor_model of the
    inputs, timed the same way, under the name "floor" (onnxruntime's fixed cost per call)."""
    if burst < 1:
        raise ValueError(f"onnx_latency: burst must be >= 1 (calls per file and round), got {burst}")
    import numpy as np

    if floor and "floor" in files:
        raise ValueError('onnx_latency: "floor" names the floor model; give the files other names')
    with tempfile.TemporaryDirectory(prefix="intqat-onnx-timing-") as tmp:
        if floor:
            files = {**files, "floor": os.path.join(tmp, "floor.onnx")}
            with open(files["floor"], "wb") as f:
                f.write(floor_model(next(iter(inputs.values()))))
        paths = {}
        for batch, args in inputs.items():
            paths[str(batch)] = os.path.join(tmp, f"inputs_{batch}.npz")
            np.savez(paths[str(batch)], *[a.detach().contiguous().numpy() for a in args if isinstance(a, Tensor)])
        spec = {"files": {k: str(v) for k, v in files.items()}, "inputs": paths, "repeats": repeats, "warmup": warmup,
                "burst": burst, "options": SESSION_OPTIONS}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _TIMING_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"timing the ONNX files failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if after_other is not None:
        after_other.update({int(b): t["after_other"] for b, t in measured.items()})
    return {int(b): t["back_to_back"] for b, t in measured.items()}
