"""`intqat-bench export`: the exported mixed-precision program (model.pt2) against the fp32
eager model and the integer model in eval, on the default recipe's digits MLP.

The MLP is trained here, briefly, twice from the same initialisation: fp32 throughout (the fp32
model) and along the recipe's QAT schedule, fp32 -> fake quant -> integer (the integer model,
then exported). Columns, all from one run:

latency b1 / b256  median seconds per call over interleaved repeats (intqat.bench.timing), and
                   the median per-repeat ratio to the fp32 eager model
file               model.pt2 bytes, and the fp32 program's bytes: torch.export of the fp32 model
                   saved by torch.export.save (as anyone would), and by intqat's own writer
                   (debug metadata dropped, deflate) for a like-for-like ratio
max abs err        against the fp32 program of the integer model (what autocast changes)
accuracy           top-1 on the digits test split (270 images)

A fifth row, model.aoti.pt2, is the same program compiled by AOTInductor for this CPU
(intqat.export.compile_aoti, checked equal to model.pt2): the deployment that skips the Python
interpreter of the graph, whose per-call overhead dominates a model this small.

All candidates run at `threads` torch threads (default 1, as the digits recipes train: a second
thread only waits at these sizes).

Targets: model.pt2 <= 0.35x the fp32 program; accuracy within 0.2 points of the integer model;
latency at batch 256 <= 0.5x the fp32 eager model, judged on the faster deployment (AOTInductor
package, or model.pt2 through .module()). A missed latency target comes with the profile of the
exported program (where its time goes).
"""

from __future__ import annotations

import copy
import io
import math
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from intqat.bench.table import NA, Table, fmt_num, fmt_ratio
from intqat.bench.timing import machine_info, machine_lines, time_interleaved

__all__ = ["run_export_bench", "format_table", "ExportBenchSettings", "TARGETS"]

RECIPE = "mlp_digits_w8a8"
TARGETS = {"size_ratio": 0.35, "accuracy_points": 0.2, "latency_ratio_b256": 0.5}
FP32_EAGER, INTEGER, FP32_PROGRAM, MIXED = "fp32 eager", "integer eval", "fp32 program", "model.pt2 (mixed)"
AOTI = "model.aoti.pt2 (AOTInductor)"


@dataclass(frozen=True)
class ExportBenchSettings:
    # Epochs of the recipe's schedule (3 fp32, fake quant to 12, integer to 20), scaled down
    # in quick mode: the targets concern the exported program, not how well the MLP trains.
    fp32_epochs: int = 3
    fake_epochs: int = 9
    integer_epochs: int = 8
    repeats: int = 15
    warmup: int = 3
    min_time: float = 0.05  # seconds per measurement
    batch_sizes: tuple[int, ...] = (1, 256)
    seed: int = 0
    threads: int = 1  # torch threads for every candidate (the digits recipes' num_threads)
    aoti: bool = True  # compile and time model.aoti.pt2 (~15 s)

    @classmethod
    def quick(cls, repeats: int | None = None) -> "ExportBenchSettings":
        return cls(fp32_epochs=1, fake_epochs=1, integer_epochs=1, repeats=repeats or 3, warmup=1, min_time=0.01,
                   aoti=False)


# -- the models --------------------------------------------------------------------------------------
def _recipe():
    from intqat.compose import compose

    return compose(RECIPE)


def _train(model: nn.Module, loader, epochs: int, opt: torch.optim.Optimizer, sched) -> None:
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()


def _models(s: ExportBenchSettings):
    """(fp32 model, integer model, datamodule), both trained from one initialisation."""
    import intqat
    from hydra.utils import instantiate

    cfg = _recipe()
    torch.manual_seed(s.seed)
    dm = instantiate(cfg.data)
    dm.setup()
    fp32 = instantiate(cfg.model)
    qat = copy.deepcopy(fp32)
    epochs = s.fp32_epochs + s.fake_epochs + s.integer_epochs
    steps = epochs * len(dm.train_dataloader())

    def optimizer(model):
        opt = torch.optim.Adam(model.parameters(), lr=cfg.module.lr, weight_decay=cfg.module.weight_decay)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    opt, sched = optimizer(fp32)
    _train(fp32, dm.train_dataloader(), epochs, opt, sched)

    opt, sched = optimizer(qat)
    _train(qat, dm.train_dataloader(), s.fp32_epochs, opt, sched)
    intqat.prepare_qat(qat, cfg.quant.config)  # the same Parameters: the optimizer carries on
    _train(qat, dm.train_dataloader(), s.fake_epochs, opt, sched)
    intqat.freeze_observers(qat)
    intqat.to_integer(qat)
    _train(qat, dm.train_dataloader(), s.integer_epochs, opt, sched)
    return fp32.eval(), qat.eval(), dm


# -- measurements ------------------------------------------------------------------------------------
def _saved_bytes(program, compress: bool) -> int:
    from intqat.export import write_program

    if not compress:
        buf = io.BytesIO()
        torch.export.save(program, buf)
        return len(buf.getvalue())
    with tempfile.TemporaryDirectory() as d:
        return write_program(program, Path(d) / "fp32.pt2", compress=True)


@torch.no_grad()
def _accuracy(fn: Callable, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((fn(x).argmax(-1) == y).float().mean())


@torch.no_grad()
def profile_ops(fn: Callable, x: torch.Tensor, calls: int = 20, top: int = 6) -> dict[str, Any]:
    """Where a call's time goes: wall time, time inside aten ops, top ops by self CPU time."""
    import time

    from torch.profiler import ProfilerActivity, profile

    fn(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        wall = (time.perf_counter() - t0) / calls
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    # self times of aten ops add up to the time spent in kernels (and their dispatch)
    in_ops = sum(e.self_cpu_time_total for e in events) / 1e6 / calls
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_s": wall,
        "aten_self_s": in_ops,
        "aten_calls": sum(e.count for e in events) / calls,
        "top": [(e.key, e.self_cpu_time_total / 1e6 / calls, e.count / calls) for e in ranked],
    }


def run_export_bench(quick: bool = False, repeats: int | None = None) -> list[dict[str, Any]]:
    """One row per candidate (fp32 eager, integer eval, fp32 program, model.pt2, model.aoti.pt2);
    numbers raw, latencies in seconds, ratios against the fp32 eager model; see format_table."""
    s = ExportBenchSettings.quick(repeats) if quick else ExportBenchSettings(**({"repeats": repeats} if repeats else {}))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        return _run(s, quick)
    finally:
        torch.set_num_threads(threads_before)


def _run(s: ExportBenchSettings, quick: bool) -> list[dict[str, Any]]:
    import torch._inductor

    from intqat.export import export_mixed_precision

    machine = machine_info()  # before the run: the load average says whether others were busy
    fp32, integer, dm = _models(s)
    xt, yt = dm.test_set.tensors
    calibration = [tuple(b) for _, b in zip(range(4), dm.val_dataloader())]
    example = xt[:2].clone()

    result = export_mixed_precision(integer, (example,), calibration_data=calibration, validation_data=[(xt, yt)])
    auto = torch.export.Dim.AUTO
    with torch.no_grad():
        fp32_program = torch.export.export(fp32, (example,), dynamic_shapes=({0: auto},))
    with tempfile.TemporaryDirectory() as d:
        paths = result.save(d, aoti=s.aoti)
        model_bytes = paths["model.pt2"].stat().st_size
        loaded = torch.export.load(paths["model.pt2"])  # what a deployment runs: read back from disk
        if s.aoti:
            aoti_bytes = paths["model.aoti.pt2"].stat().st_size
            aoti_runner = torch._inductor.aoti_load_package(str(paths["model.aoti.pt2"]))
    mixed = loaded.module()
    fp32_prog = fp32_program.module()
    candidates = {FP32_EAGER: fp32, INTEGER: integer, FP32_PROGRAM: fp32_prog, MIXED: mixed}
    if s.aoti:
        candidates[AOTI] = aoti_runner

    latency: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for b in s.batch_sizes:
            xb = xt[:b].contiguous() if b <= len(xt) else xt.repeat(math.ceil(b / len(xt)), 1, 1, 1)[:b]
            calls = {name: (lambda f=f, xb=xb: f(xb)) for name, f in candidates.items()}
            latency[b] = time_interleaved(calls, repeats=s.repeats, warmup=s.warmup, min_time=s.min_time)

    reference = result.reference.module()
    fp32_bytes = {"save": _saved_bytes(fp32_program, compress=False), "intqat": _saved_bytes(fp32_program, compress=True)}
    acc_integer = _accuracy(integer, xt, yt)
    rows = []
    for name, fn in candidates.items():
        row: dict[str, Any] = {"name": name, "accuracy": _accuracy(fn, xt, yt)}
        for b, timings in latency.items():
            anchor, mine = timings[FP32_EAGER].times, timings[name].times
            row[f"latency_b{b}_s"] = timings[name].median
            row[f"latency_ratio_b{b}"] = statistics.median(m / a for a, m in zip(anchor, mine))
        with torch.no_grad():
            row["max_abs_err"] = None if name == FP32_EAGER else float((fn(xt) - reference(xt)).abs().max())
        if name == FP32_PROGRAM:
            row["bytes"] = fp32_bytes["save"]
        if name == AOTI:
            row["bytes"] = aoti_bytes
        if name == MIXED:
            row.update(bytes=model_bytes, size_ratio=model_bytes / fp32_bytes["save"],
                       size_ratio_like_for_like=model_bytes / fp32_bytes["intqat"],
                       fp32_program_bytes=fp32_bytes, accuracy_delta_points=100 * (row["accuracy"] - acc_integer),
                       autocast=result.report.counts(), graph_nodes=result.info["graph_nodes"])
        rows.append(row)
    mixed_row = next(r for r in rows if r["name"] == MIXED)
    big = max(s.batch_sizes)
    best = min(r.get(f"latency_ratio_b{big}", math.inf) for r in rows if r["name"] in (MIXED, AOTI))
    if best > TARGETS["latency_ratio_b256"]:
        xb = xt[:big] if big <= len(xt) else xt.repeat(math.ceil(big / len(xt)), 1, 1, 1)[:big]
        mixed_row["profile"] = {name: profile_ops(candidates[name], xb) for name in (MIXED, FP32_EAGER)}
        mixed_row["profile_batch"] = big
    rows[0]["settings"] = {"quick": quick, **s.__dict__, "machine": machine_lines(machine)}
    return rows


# -- the table ----------------------------------------------------------------------------------------
def _us(v: float | None) -> str:
    return NA if v is None else fmt_num(v * 1e6)


def _check(ok: bool) -> str:
    return "met" if ok else "MISSED"


def format_table(rows: list[dict[str, Any]]) -> str:
    settings = rows[0].get("settings", {})
    bs = sorted(int(k[len("latency_b"):-2]) for k in rows[0] if k.startswith("latency_b") and k.endswith("_s"))
    columns = ["candidate"]
    for b in bs:
        columns += [f"b{b} us", f"b{b} vs fp32"]
    columns += ["file KiB", "max abs err", "accuracy"]
    table = Table(
        title=f"intqat-bench export: {RECIPE} MLP, digits test split",
        header_lines=[*settings.get("machine", machine_lines()),
                      f"repeats {settings.get('repeats')}, interleaved, median; quick={settings.get('quick')}"],
        columns=columns,
    )
    for r in rows:
        cells = [r["name"]]
        for b in bs:
            cells += [_us(r.get(f"latency_b{b}_s")), fmt_ratio(r.get(f"latency_ratio_b{b}"))]
        cells += [NA if r.get("bytes") is None else f"{r['bytes'] / 1024:.1f}",
                  NA if r.get("max_abs_err") is None else f"{r['max_abs_err']:.3g}",
                  f"{100 * r['accuracy']:.2f}%"]
        table.add(cells, r)
    m = next(r for r in rows if r["name"] == MIXED)
    big = max(bs)
    size_ok = m["size_ratio"] <= TARGETS["size_ratio"]
    acc_ok = abs(m["accuracy_delta_points"]) <= TARGETS["accuracy_points"]
    a = next((r for r in rows if r["name"] == AOTI), None)
    lat = m.get(f"latency_ratio_b{big}")
    lat_aoti = None if a is None else a.get(f"latency_ratio_b{big}")
    best = min(v for v in (lat, lat_aoti, math.inf) if v is not None)
    lat_ok = best <= TARGETS["latency_ratio_b256"]
    fp32_bytes = m["fp32_program_bytes"]
    table.footnotes += [
        "max abs err: against the fp32 program of the integer model (integer layers int8, float ops fp32).",
        f"fp32 program file: {fp32_bytes['save']} B as torch.export.save writes it, {fp32_bytes['intqat']} B "
        "through intqat's writer (no debug metadata, deflate); model.pt2 uses intqat's writer.",
        f"autocast: {m['autocast']}; graph nodes {m['graph_nodes']}",
        "",
        f"target size     model.pt2 / fp32 program = {m['size_ratio']:.3f} (<= {TARGETS['size_ratio']}): "
        f"{_check(size_ok)}; like for like {m['size_ratio_like_for_like']:.3f}",
        f"target accuracy model.pt2 - integer model = {m['accuracy_delta_points']:+.2f} points "
        f"(within {TARGETS['accuracy_points']}): {_check(acc_ok)}",
        f"target latency  deployed / fp32 eager at batch {big}: model.aoti.pt2 {fmt_ratio(lat_aoti)}, model.pt2 "
        f"through .module() {fmt_ratio(lat)} (<= {TARGETS['latency_ratio_b256']}x): {_check(lat_ok)}",
        f"threads: every candidate at {settings.get('threads')} torch thread(s). model.aoti.pt2: model.pt2 compiled by "
        "AOTInductor for this CPU, outputs checked equal (torch.equal) to model.pt2 before timing.",
    ]
    for name, p in (m.get("profile") or {}).items():
        top = ", ".join(f"{k.removeprefix('aten::')} {v * 1e6:.0f}us x{c:g}" for k, v, c in p["top"])
        table.footnotes.append(
            f"profile {name} @ b{m['profile_batch']}: {p['wall_s'] * 1e6:.0f} us/call, {p['aten_self_s'] * 1e6:.0f} us "
            f"in {p['aten_calls']:g} aten ops, the rest Python; top: {top}")
    return table.render()
