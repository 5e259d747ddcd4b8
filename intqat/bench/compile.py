"""Eager vs torch.compile (inductor): the train step of intqat's integer MLP and CNN.

    rows = run_compile_bench()                 # the `intqat-bench modules` shapes, 10 repeats
    rows = run_compile_bench(quick=True)       # small shapes, 2 repeats: a smoke run
    print(format_table(rows))

Models: the MLP and CNN of intqat.bench.modules (same shapes, same seed), made integer the way
`intqat-bench modules` does it: prepare_qat("w8a8"), calibrate, to_integer (observers stay on,
convs fold BN with running statistics). Step: zero_grad(set_to_none) -> forward ->
cross-entropy -> backward -> Adam.step(). Candidates, each on its own copy of the same model:

    eager                 the step as written
    compiled              torch.compile(model, backend="inductor", dynamic=False); backward through
                          the compiled graph (aot_autograd), Adam eager
    compiled + optimizer  the same, and Adam.step() compiled too (not in quick mode)

Times come from intqat.bench.timing.time_interleaved (warm-up first, candidates interleaved
round-robin, median over repeats); compile time is the first compiled step's wall time minus one
eager step. `graphs` counts the graphs the model's forward compiled to (more than one: graph
breaks). `max rel Δ` compares the first step's loss and gradients with eager's, from identical
weights: max |g_compiled - g_eager| / max |g_eager| over every gradient.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import intqat
from intqat.bench.modules import ModulesSettings, bench_models
from intqat.bench.table import NA, Table, fmt_num, fmt_ratio
from intqat.bench.timing import machine_info, machine_lines, speed_ratio, time_interleaved

__all__ = ["run_compile_bench", "format_table", "EAGER", "COMPILED", "COMPILED_OPT"]

EAGER = "eager"
COMPILED = "compiled (inductor)"
COMPILED_OPT = "compiled + optimizer"


class _CountingInductor:
    """The inductor backend, counting the graphs dynamo hands it (one per region between breaks)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)


class _Candidate:
    def __init__(self, name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
                 compile_model: bool, compile_opt: bool):
        self.name = name
        self.model = model
        self.x, self.y = x, y
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.backend = _CountingInductor() if compile_model else None
        self.opt_backend = _CountingInductor() if compile_opt else None
        self.forward: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(model, backend=self.backend, dynamic=False) if compile_model else model
        )
        if compile_opt:
            opt = self.opt

            @torch.compile(backend=self.opt_backend, dynamic=False)
            def opt_step() -> None:
                opt.step()

            self.opt_step: Callable[[], None] = opt_step
        else:
            self.opt_step = self.opt.step

    def forward_backward(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.forward(self.x), self.y)
        loss.backward()
        return loss

    def step(self) -> None:
        self.forward_backward()
        self.opt_step()


def _integer_model(make: Callable[[], nn.Module], x: torch.Tensor, s: ModulesSettings) -> nn.Module:
    torch.manual_seed(s.seed)
    model = intqat.prepare_qat(make(), "w8a8")
    intqat.calibrate(model, [x] * s.calib_batches)
    return intqat.to_integer(model).train()


def _max_rel(actual: list[torch.Tensor | None], expected: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for a, e in zip(actual, expected):
        if a is None or e is None:
            if (a is None) != (e is None):
                return math.inf
            continue
        scale = e.abs().max().item()
        diff = (a - e).abs().max().item()
        worst = max(worst, diff / scale if scale else diff)
    return worst


def _bench_model(title: str, make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, s: ModulesSettings,
                 repeats: int, compile_optimizer: bool) -> list[dict[str, Any]]:
    torch.compiler.reset()  # every model compiles from scratch; no cache entry of another model is reused
    base = _integer_model(make, x, s)
    wanted = [(EAGER, False, False), (COMPILED, True, False)]
    if compile_optimizer:
        wanted.append((COMPILED_OPT, True, True))
    cands = [_Candidate(name, copy.deepcopy(base), x, y, s.lr, cm, co) for name, cm, co in wanted]

    # first step of each from the same weights: compile time and agreement with eager
    first: dict[str, tuple[float, list[torch.Tensor | None], float]] = {}
    for c in cands:
        t0 = time.perf_counter()
        loss = c.forward_backward()
        grads = [None if p.grad is None else p.grad.detach().clone() for p in c.model.parameters()]
        c.opt_step()
        first[c.name] = (time.perf_counter() - t0, grads, loss.item())
    eager_first = first[EAGER][0]
    timings = time_interleaved({c.name: c.step for c in cands}, repeats, warmup=s.warmup, min_time=0.0 if repeats <= 2 else 0.05)

    rows = []
    eager_loss = first[EAGER][2]
    for c in cands:
        t_first, grads, loss = first[c.name]
        tm = timings[c.name]
        loss_rel = abs(loss - eager_loss) / abs(eager_loss) if eager_loss else abs(loss - eager_loss)
        rows.append({
            "model": title,
            "candidate": c.name,
            "median_s": tm.median,
            "times_s": tm.times,
            "inner": tm.inner,
            "speed_vs_eager": speed_ratio(timings[EAGER], tm),
            "compile_s": None if c.backend is None else max(t_first - eager_first, 0.0),
            "graphs": None if c.backend is None else c.backend.graphs,
            "optimizer_graphs": None if c.opt_backend is None else c.opt_backend.graphs,
            "max_rel_diff": None if c.backend is None else max(_max_rel(grads, first[EAGER][1]), loss_rel),
        })
    return rows


def run_compile_bench(quick: bool = False, repeats: int | None = None, settings: ModulesSettings | None = None,
                      compile_optimizer: bool | None = None) -> list[dict[str, Any]]:
    """Time the integer MLP's and CNN's train steps, eager against torch.compile; one dict per (model, candidate).

    Each row: model, candidate, median_s (seconds per step), times_s (every repeat), speed_vs_eager
    (median of per-repeat t_eager / t_candidate), compile_s, graphs (forward graphs of the model:
    1 = no graph break), optimizer_graphs, max_rel_diff (first step vs eager). `compile_optimizer`
    adds the "compiled + optimizer" candidate (default: on unless quick).
    """
    s = settings or (ModulesSettings.quick() if quick else ModulesSettings())
    repeats = repeats if repeats is not None else s.repeats
    compile_optimizer = (not quick) if compile_optimizer is None else compile_optimizer
    g = torch.Generator().manual_seed(s.seed)
    models = bench_models(s, g, prefix="integer ")
    rows: list[dict[str, Any]] = []
    try:
        for title, make, x in models:
            y = torch.randint(0, s.classes, (x.shape[0],), generator=g)
            rows += _bench_model(title, make, x, y, s, repeats, compile_optimizer)
    finally:
        torch.compiler.reset()  # drop the compiled models (and the memory they hold)
    for r in rows:
        r["repeats"] = repeats
    return rows


def format_table(rows: list[dict[str, Any]], info: dict | None = None) -> str:
    """The rows of run_compile_bench as one aligned plain-text table, grouped by model."""
    info = info or machine_info()
    repeats = rows[0]["repeats"] if rows else 0
    t = Table(
        title="intqat compile   integer train step (zero_grad, forward, cross-entropy, backward, Adam.step): "
              "eager vs torch.compile",
        header_lines=[*machine_lines(info),
                      f"timing: {repeats} repeats, interleaved round-robin over the candidates of a model, median"],
        columns=["candidate", "step ms", "speed vs eager", "compile s", "graphs", "max rel Δ (1st step)"],
    )
    current = None
    for r in rows:
        if r["model"] != current:
            current = r["model"]
            t.group(current)
        graphs = NA if r["graphs"] is None else str(r["graphs"])
        if r.get("optimizer_graphs") is not None:
            graphs += f" + {r['optimizer_graphs']} opt"
        rel = r["max_rel_diff"]
        t.add([r["candidate"], fmt_num(r["median_s"] * 1e3), fmt_ratio(r["speed_vs_eager"]),
               NA if r["compile_s"] is None else f"{r['compile_s']:.1f}", graphs,
               "-" if rel is None else ("0" if rel == 0 else f"{rel:.1e}")], r)
    t.footnotes = [
        "speed: median over repeats of t_eager / t_candidate (> 1 = faster). compile s: the first compiled step's "
        "wall time minus one eager step (dynamo + aot_autograd + inductor, forward and backward; a warm inductor "
        "cache shortens it, and 'compiled + optimizer' reuses the model graphs compiled just before). graphs: graphs the model's forward compiled to; 1 = no graph break.",
        "max rel Δ: first step from identical weights, max |compiled - eager| / max |eager| over the loss and every "
        "gradient. Models: prepare_qat('w8a8'), calibrate, to_integer (intqat-bench modules' integer flavour).",
    ]
    return t.render()
