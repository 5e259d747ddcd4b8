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

__all__ = ["session", "run_session", "compare", "onnx_latency"]


def session(model: bytes | str | os.PathLike, threads: int | None = None):
    """An onnxruntime InferenceSession on the CPU provider (default graph optimizations: what a deployer gets)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only (its warnings about serializing optimized models are not ours)
    if threads is not None:
        options.intra_op_num_threads = threads
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


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
options = ort.SessionOptions()
options.intra_op_num_threads = 1
options.inter_op_num_threads = 1
options.log_severity_level = 3
sessions = {name: ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for name, path in spec["files"].items()}
result = {}
for batch, path in spec["inputs"].items():
    arrays = np.load(path)
    inputs = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    feeds = {name: {i.name: a for i, a in zip(s.get_inputs(), inputs)} for name, s in sessions.items()}
    times = {name: [] for name in sessions}
    for _ in range(spec["warmup"]):
        for name, s in sessions.items():
            s.run(None, feeds[name])
    for _ in range(spec["repeats"]):
        for name, s in sessions.items():
            t0 = time.process_time()
            s.run(None, feeds[name])
            times[name].append((time.process_time() - t0) * 1e3)
    result[batch] = {name: statistics.median(t) for name, t in times.items()}
assert not any(m == "intqat" or m.startswith("intqat.") for m in sys.modules)
print(json.dumps(result))
"""


def onnx_latency(files: dict[str, str | os.PathLike], inputs: dict[int, tuple], repeats: int = 30,
                 warmup: int = 5) -> dict[int, dict[str, float]]:
    """Median CPU ms per call of each ONNX file (name -> path) for each batch's inputs: one call of each per round
    (interleaved), time.process_time (this process only: on a shared machine the ratio holds), one onnxruntime
    thread, in a fresh Python that never imports intqat."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="intqat-onnx-timing-") as tmp:
        paths = {}
        for batch, args in inputs.items():
            paths[str(batch)] = os.path.join(tmp, f"inputs_{batch}.npz")
            np.savez(paths[str(batch)], *[a.detach().contiguous().numpy() for a in args if isinstance(a, Tensor)])
        spec = {"files": {k: str(v) for k, v in files.items()}, "inputs": paths, "repeats": repeats, "warmup": warmup}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _TIMING_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"timing the ONNX files failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return {int(b): t for b, t in json.loads(done.stdout.strip().splitlines()[-1]).items()}
