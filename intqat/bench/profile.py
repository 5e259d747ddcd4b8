"""Where int_linear's forward + backward spends its time: torch.profiler, top aten ops by self CPU time.

Profiled after a warm-up, over `steps` calls of the same candidates `intqat-bench ops` times
(static w8a8 and dynamic per-token int_linear, nn.Linear for reference).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from intqat.bench.memory import quiet_profiler_stderr
from intqat.bench.ops import ANCHOR_LINEAR, _fwd_bwd, linear_candidates
from intqat.bench.timing import machine_lines

__all__ = ["profile_int_linear"]

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
