"""Where the time goes: torch.profiler, self CPU time per op.

profile_int_linear   int_linear's forward + backward: top aten ops, over `steps` calls of the candidates
                     `intqat-bench ops` times (static w8a8 and dynamic per-token int_linear, nn.Linear).
profile_blocks       a whole train step of the real-model blocks (`--models`, intqat.bench.blocks): fp32,
                     intqat integer and torchao QAT side by side, self CPU time per step in op classes (OP_CLASSES:
                     int8 GEMMs / convs, fp32 GEMMs / convs, intqat's C kernels inside its C++ ops (the quantize /
                     epilogue / mask passes, and the per-group GEMM of the 8da4w step), layout and im2col copies, other elementwise work, the autograd engine) and what no op
                     accounts for (Python, dispatch, the C passes the Python path calls through ctypes).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from intqat.bench.memory import quiet_profiler_stderr
from intqat.bench.ops import ANCHOR_LINEAR, _fwd_bwd, linear_candidates
from intqat.bench.timing import machine_lines

__all__ = ["profile_int_linear", "profile_blocks", "op_class", "OP_CLASSES"]

PROFILED = ("intqat int_linear static w8a8", "intqat int_linear dynamic per-token", ANCHOR_LINEAR)


def profile_int_linear(M: int = 256, K: int = 1024, N: int = 1024, steps: int = 20, top: int = 15) -> tuple[str, dict]:
    cands, _, x = linear_candidates(M, K, N)
    x = x.clone().requires_grad_(True)
    g = torch.randn(M, N)
    lines = [f"intqat-bench profile   int_linear forward+backward, M={M} K={K} N={N}, {steps} calls each",
             *machine_lines()]
    rows: dict = {}
    for name in PROFILED:
        c = cands[name]
        fn = _fwd_bwd(c.layer, x, g, c.params)
        for _ in range(3):
            fn()
        with quiet_profiler_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        avgs = [e for e in prof.key_averages() if e.key.startswith("aten::") or e.key.startswith("intqat::")]
        total = sum(e.self_cpu_time_total for e in avgs) or 1.0
        avgs.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        lines += ["", f"[{name}]  self CPU time per call: {total / steps / 1e3:.3f} ms (aten ops)",
                  f"  {'op':<32} {'ms/call':>8} {'share':>6} {'calls/call':>10}"]
        rows[name] = []
        for e in avgs[:top]:
            per_call = e.self_cpu_time_total / steps / 1e3
            lines.append(f"  {e.key:<32} {per_call:8.3f} {100 * e.self_cpu_time_total / total:5.1f}% {e.count / steps:10.1f}")
            rows[name].append({"op": e.key, "ms_per_call": per_call, "share": e.self_cpu_time_total / total,
                               "calls_per_call": e.count / steps})
    return "\n".join(lines), rows


# ---------------------------------------------------------------------------------------------
# Whole train steps of the blocks, per op class
# ---------------------------------------------------------------------------------------------

OP_CLASSES = ("int8 GEMM / conv", "fp32 GEMM / conv", "intqat C kernels", "layout / im2col", "elementwise / norm / optim",
              "autograd engine", "Python / dispatch (no op)")
_INT8 = ("aten::_int_mm", "onednn::qconv", "intqat::digit_matmul")
_FP32 = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::convolution_backward", "aten::mkldnn_convolution",
         "aten::_convolution", "aten::convolution", "aten::conv2d", "aten::_scaled_dot_product", "aten::_slow_conv2d",
         "aten::thnn_conv2d", "aten::_nnpack", "aten::linear", "aten::matmul")
_LAYOUT = ("aten::copy_", "aten::contiguous", "aten::clone", "aten::constant_pad_nd", "aten::unfold", "aten::permute",
           "aten::reshape", "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::cat", "aten::index_select",
           "aten::empty", "aten::to", "aten::_to_copy", "aten::set_", "aten::repeat_interleave", "aten::transpose",
           "aten::t", "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::flatten",
           "aten::zeros", "aten::zero_", "aten::fill_", "aten::resize_", "aten::detach", "aten::alias", "aten::lift",
           "aten::new_", "aten::full", "aten::ones", "aten::narrow", "aten::split", "aten::chunk", "aten::pad")


def op_class(key: str) -> str | None:
    """The OP_CLASSES entry a profiler event's self time belongs to (None: not an op, e.g. ProfilerStep)."""
    if key.startswith(_INT8):
        return OP_CLASSES[0]
    if key.startswith(_FP32):
        return OP_CLASSES[1]
    if key.startswith(("intqat_train::", "intqat::", "CppNode<")):  # the C++ ops' own code: the C kernels
        return OP_CLASSES[2]
    if key.startswith(_LAYOUT):
        return OP_CLASSES[3]
    if key.startswith("aten::") or key.startswith("torchao"):
        return OP_CLASSES[4]
    if key.startswith("autograd::") or "Backward" in key:
        return OP_CLASSES[5]
    return None


def _profile_step(step, steps: int) -> tuple[float, dict[str, float], list[tuple[str, float]]]:
    """-> (wall ms per step under the profiler, {class: ms per step}, [(op, ms per step)] by self time)."""
    import time

    for _ in range(2):
        step()
    with quiet_profiler_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    by_class = dict.fromkeys(OP_CLASSES, 0.0)
    ops: list[tuple[str, float]] = []
    for e in prof.key_averages():
        cls = op_class(e.key)
        if cls is None:
            continue
        ms = e.self_cpu_time_total / steps / 1e3
        by_class[cls] += ms
        ops.append((e.key, ms))
    by_class[OP_CLASSES[-1]] = max(0.0, wall - sum(by_class.values()))
    ops.sort(key=lambda t: -t[1])
    return wall, by_class, ops


def profile_blocks(names: tuple[str, ...], steps: int = 10, quick: bool = False, top: int = 8) -> tuple[str, dict]:
    """Profile one train step (zero_grad, forward, cross-entropy, backward, Adam) of each named model for fp32,
    intqat integer and torchao QAT: ms per step by op class, and the integer step's top ops."""
    from dataclasses import replace

    from intqat.bench import modules as mod

    s = replace(mod.ModulesSettings.quick() if quick else mod.ModulesSettings(), models=names)
    g = torch.Generator().manual_seed(s.seed)
    flavours = (mod.FP32, mod.INTQAT_INT, mod.TORCHAO_QAT)
    lines = [f"intqat-bench profile   train step of each block by op class (torch.profiler self CPU time), "
             f"{steps} steps each; ms per step (share of the step)", *machine_lines(),
             "classes: " + "; ".join(OP_CLASSES) + ". 'intqat C kernels' = the self time of intqat's C++ ops: its "
             "passes and, for 8da4w layers, the per-group GEMM. 'Python / dispatch' = wall time no op accounts for (the "
             "Python path's ctypes C passes land here too). Wall times include the profiler's own overhead."]
    rows: dict = {}
    for title, make, x, preset in mod.selected_models(s, g):
        y = torch.randint(0, s.classes, (x.shape[0],), generator=g)
        cols: dict[str, tuple] = {}
        for name in flavours:
            torch.manual_seed(s.seed)
            try:
                model, _ = mod.FLAVOURS[name](make(), x, replace(s, preset=preset))
            except mod.peers.Unavailable as e:
                lines.append(f"  ({name}: {e})")
                continue
            model.train()
            opt = mod.build_optimizer(model.parameters(), "adam", lr=s.lr, fused=s.fused_optimizer)
            run = mod.Run(name, model, opt, None, x, y)
            cols[name.replace("w8a8", preset)] = _profile_step(run.step, steps)
        names_ = list(cols)
        lines += ["", f"[{title}]", f"  {'op class':<28}" + "".join(f"{n[:24]:>28}" for n in names_)]
        for cls in OP_CLASSES:
            cells = "".join(f"{cols[n][1][cls]:>18.2f} ms ({100 * cols[n][1][cls] / cols[n][0]:3.0f}%)" for n in names_)
            lines.append(f"  {cls:<28}{cells}")
        lines.append(f"  {'step (wall)':<28}" + "".join(f"{cols[n][0]:>21.2f} ms      " for n in names_))
        integer = next((n for n in names_ if n.startswith("intqat integer")), None)
        if integer:
            lines.append(f"  top ops of {integer}: " + ", ".join(f"{k} {v:.2f}" for k, v in cols[integer][2][:top]))
        rows[title] = {n: {"wall_ms": c[0], "classes_ms": c[1], "top_ops_ms": c[2][:top]} for n, c in cols.items()}
    return "\n".join(lines), rows
