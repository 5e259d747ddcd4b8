"""`intqat-bench deploy`: the int8 .pte (ExecuTorch, XNNPACK) against an fp32 .pte of the same model, and the Q/DQ and
integer ONNX files in onnxruntime against an fp32 ONNX of the same model, at batch 1 and 32: latency and file size,
and each file's agreement with intqat's integer model (issue 23).

Models:
  digits MLP   the default recipe (mlp_digits_w8a8: 64 -> 128 -> 128 -> 10, w8a8 static), trained here along the
               recipe's schedule (intqat.bench.export's training); agreement on the digits test split (270 images)
  encoder      a BERT-tiny-like encoder layer (intqat.bench.blocks: d 128, 2 heads, FFN 512, GELU, seq 32) and a
               linear head, random weights, calibrated on random batches, w8a8 static and w8a8_dynamic

Every .pte is made by intqat.deploy.executorch.export_pte (its census decides what runs where); the fp32 .pte is
the same model with every layer float, lowered with XNNPACK the same way. Every ONNX file is made by
intqat.deploy.onnx.export_onnx (form qdq: model.onnx; form int: model.int.onnx); the fp32 ONNX is the same model with
every layer float (its dequantized weights). Latency: median CPU time (time.process_time) per call of back-to-back
calls, one thread (XNNPACK / onnxruntime), in a fresh Python that never imports intqat (the files as a deployer
loads them): each round runs every file in turn, 4 calls each (intqat.deploy.runtime.LATENCY_BURST), the order
rotated; the first call of each burst, made just after another file's, is kept apart ("after another file": caches
and runtime state another model left, which a process serving its one model does not see) and its ratio printed
in the verdicts beside the target's. (Before 2026-11-28's fifth pass every timed call followed another file's.)
The .pte rows also give the floor (a .pte of the same input returning it + 1, timed beside both files:
the per-call cost no model avoids), the ratio above it ((int8 - floor) / (fp32 - floor): the models' own time),
and the same three files timed in ExecuTorch's C++ runtime (intqat.deploy.pte_latency). The ONNX rows give
onnxruntime's floor the same way (an Identity file on the same inputs, intqat.deploy.onnx_runtime.floor_model). The .pte verdict judges
the C++ runner's raw ratio (the runtime as a deployer's process calls it) and prints the others beside it.

Targets (issue 23), at batch 1: int8 .pte latency <= 0.6x the fp32 .pte and size <= 0.3x for the digits MLP and
the encoder block; Q/DQ ONNX latency <= 0.7x the fp32 ONNX; top-1 agreement with the integer model 100% on the
digits test split; the integer ONNX equal to the integer model bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from importlib.metadata import version

import torch

from intqat.bench.table import Table, fmt_num, fmt_ratio
from intqat.bench.timing import machine_info, machine_lines
from intqat.deploy.runtime import LATENCY_BURST

__all__ = ["run_deploy_bench", "DeploySettings", "TARGETS"]

TARGETS = {"latency_ratio_b1": 0.6, "size_ratio": 0.3, "digits_top1": 1.0, "onnx_latency_ratio_b1": 0.7}
FORMATS = {"pte": ".pte XNNPACK", "onnx": "ONNX Q/DQ", "onnx-int": "ONNX int"}


@dataclass(frozen=True)
class DeploySettings:
    repeats: int = 30  # timed calls per .pte and batch (median)
    batches: tuple[int, ...] = (1, 32)
    seq: int = 32  # encoder tokens per sample
    d_model: int = 128
    ffn: int = 512
    calibration_batches: int = 4
    quick: bool = False

    @classmethod
    def quick_settings(cls, repeats: int | None = None) -> "DeploySettings":
        return cls(repeats=repeats or 5, seq=8, d_model=32, ffn=64, calibration_batches=2, quick=True)


def _digits(s: DeploySettings):
    """(integer MLP, example, calibration, validation) of the default recipe, trained as intqat-bench export does."""
    from intqat.bench.export import ExportBenchSettings, _models

    train = ExportBenchSettings.quick() if s.quick else ExportBenchSettings()
    _, integer, dm = _models(train)
    xt, yt = dm.test_set.tensors
    calibration = [tuple(b) for _, b in zip(range(s.calibration_batches), dm.val_dataloader())]
    return integer, xt[:2].clone(), calibration, [(xt[i:i + 64], yt[i:i + 64]) for i in range(0, len(xt), 64)]


def _encoder(s: DeploySettings, preset: str):
    """(integer encoder block, example, calibration, validation): random weights, observers on random batches."""
    import intqat
    from intqat.bench.blocks import make_encoder

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = make_encoder(s.d_model, 2, s.ffn, 10).eval()
    batches = [(torch.randn(8, s.seq, s.d_model, generator=g),) for _ in range(s.calibration_batches)]
    model = intqat.to_integer(copy.deepcopy(model), config=preset, calibration_data=batches).eval()
    validation = [(torch.randn(16, s.seq, s.d_model, generator=g),) for _ in range(2)]
    return model, batches[0][0][:2].clone(), batches, validation


def _where(result, fmt: str) -> str:
    """The census in a few words: where the integer layers run (.pte) / what they became (ONNX)."""
    counts: dict[str, int] = {}
    for c in result.census:
        key = c.where.split(" (")[0] if fmt == "pte" else ("kept float" if c.became == "kept float" else
                                                          "Q/DQ" if fmt == "onnx" else "integer ops")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} {w}" for w, n in counts.items())


def _row(table: Table, name: str, fmt: str, result, batch: int, first: bool) -> None:
    t = result.latency["per_batch"].get(batch) or result.latency["per_batch"].get(str(batch))
    v = result.validation
    ms, fp32_ms = (t["int8_ms"], t["fp32_ms"]) if fmt == "pte" else (t["ms"], t["fp32_ms"])
    size, fp32_size = (result.size["int8_bytes"], result.size["fp32_bytes"]) if fmt == "pte" else \
        (result.size["bytes"], result.size["fp32_bytes"])
    exact = fmt != "pte" and v.get("bit_exact")
    cpp = t.get("cpp") if fmt == "pte" else None
    floor = [fmt_num(t["floor_ms"]), _ratio(t["ratio_above_floor"])] if "floor_ms" in t else ["-", "-"]
    floor += [fmt_num(cpp["fp32_ms"]), fmt_num(cpp["int8_ms"]), fmt_ratio(cpp["ratio"]), fmt_num(cpp["floor_ms"]),
              _ratio(cpp["ratio_above_floor"])] if cpp else ["-"] * 5
    cells = [name if first else "", FORMATS[fmt], str(batch), fmt_num(fp32_ms), fmt_num(ms), fmt_ratio(ms / fp32_ms),
             *floor, f"{fp32_size / 1024:.1f}", f"{size / 1024:.1f}", fmt_ratio(size / fp32_size),
             f"{100 * v['top1_agreement']:.2f}%", "0 (bit for bit)" if exact else fmt_num(v["max_diff_in_steps"]),
             _where(result, fmt)]
    row = {"model": name, "format": fmt, "batch": batch, "fp32_ms": fp32_ms, "int8_ms": ms,
           "latency_ratio": ms / fp32_ms, "fp32_bytes": fp32_size, "int8_bytes": size,
           "size_ratio": size / fp32_size, "top1_agreement": v["top1_agreement"],
           "max_diff_in_steps": v["max_diff_in_steps"], "bit_exact": bool(exact), "samples": v["samples"],
           "census": [c.to_dict() for c in result.census]}
    if "floor_ms" in t:  # the runtime's own per-call cost (pte_latency / onnx_runtime.onnx_latency)
        row.update(floor_ms=t["floor_ms"], latency_ratio_above_floor=t["ratio_above_floor"])
    if "after_other" in t:  # each burst's first call, just after another file's (not the target's figure)
        row.update(after_other=t["after_other"])
    if fmt == "pte":  # the C++ runner (intqat.deploy.pte_latency)
        row.update(cpp=cpp,
                   cpp_status=result.latency.get("cpp"), delegate_calls=result.info.get("delegate_calls"))
    table.add(cells, row)


def _ratio(r: float | None) -> str:
    return "n/a" if r is None else fmt_ratio(r)


def run_deploy_bench(quick: bool = False, repeats: int | None = None, info: dict | None = None) -> Table:
    """The table (module docstring); its data rows hold the raw numbers."""
    from intqat.deploy import require
    from intqat.deploy.executorch import export_pte
    from intqat.deploy.onnx import export_onnx

    for fmt in FORMATS:
        require(fmt)
    s = DeploySettings.quick_settings(repeats) if quick else DeploySettings(**({"repeats": repeats} if repeats else {}))
    info = info or machine_info()
    table = Table(
        title="intqat-bench deploy: int8 .pte (ExecuTorch, XNNPACK) vs fp32 .pte; Q/DQ and integer ONNX vs fp32 ONNX "
              "(onnxruntime) of the same model",
        header_lines=machine_lines(info) + [
            f"executorch {version('executorch')}, onnxruntime {version('onnxruntime')}; latency: median CPU ms per "
            f"call of back-to-back calls ({s.repeats} rounds, each running every file in turn, {LATENCY_BURST} calls "
            "each, all but the first timed), one thread, in a Python that never imports intqat; 'after another "
            "file' (verdicts): the first call of each burst; agreement: each file against intqat's integer model",
            "floor = a .pte of the same input returning it + 1 (one delegate call) / an Identity ONNX, timed beside "
            "both files; above floor = (int8 - floor) / (fp32 - floor), the model's own time; C++ = the same "
            "three files in ExecuTorch's C++ runtime (no Python binding)",
            f"targets at batch 1: int8 .pte latency <= {TARGETS['latency_ratio_b1']}x and size <= "
            f"{TARGETS['size_ratio']}x the fp32 .pte; Q/DQ ONNX latency <= {TARGETS['onnx_latency_ratio_b1']}x the fp32 "
            "ONNX; digits top-1 agreement 100%; ONNX int bit for bit",
        ],
        columns=["model", "format", "batch", "fp32 ms", "int8 ms", "latency", "floor ms", "above floor",
                 "C++ fp32 ms", "C++ int8 ms", "C++ latency", "C++ floor ms", "C++ above floor", "fp32 KiB",
                 "int8 KiB", "size", "top-1 agree", "max |diff| steps", "integer layers"],
    )
    models = [("digits MLP w8a8 (test split)", lambda: _digits(s))]
    enc = f"encoder d{s.d_model} seq{s.seq}"
    models += [(f"{enc} w8a8", lambda: _encoder(s, "w8a8")), (f"{enc} w8a8_dynamic", lambda: _encoder(s, "w8a8_dynamic"))]
    for name, build in models:
        model, example, calibration, validation = build()
        results = {"pte": export_pte(model, (example,), calibration_data=calibration, validation_data=validation,
                                     latency_batches=s.batches, latency_repeats=s.repeats)}
        for fmt, form in (("onnx", "qdq"), ("onnx-int", "int")):
            results[fmt] = export_onnx(model, (example,), None, form=form, calibration_data=calibration,
                                       validation_data=validation, fp32_baseline=True, latency_batches=s.batches,
                                       latency_repeats=s.repeats)
        first = True
        for fmt, result in results.items():
            for batch in s.batches:
                _row(table, name, fmt, result, batch, first=first)
                first = False
        if name.startswith("digits"):
            table.meta["digits"] = {f: {"top1_agreement": r.validation["top1_agreement"],
                                        "accuracy": r.validation.get("accuracy"),
                                        "accuracy_integer": r.validation.get("accuracy_integer")}
                                    for f, r in results.items()}
    table.meta.update(machine=info, settings=s.__dict__, targets=TARGETS)
    table.footnotes += _verdicts(table)
    return table


def _verdicts(table: Table) -> list[str]:
    out = []
    for r in table.data:
        if r["batch"] != 1 or r["model"].endswith("w8a8_dynamic") and r["format"] != "onnx-int":
            continue
        lat, size = r["latency_ratio"], r["size_ratio"]
        if r["format"] == "pte":
            out.append(_pte_verdict(r))
        elif r["format"] == "onnx":
            out.append(f"{r['model']}, ONNX Q/DQ: batch-1 latency {lat:.2f}x back to back "
                       f"({'met' if lat <= TARGETS['onnx_latency_ratio_b1'] else 'NOT met'}; "
                       f"{_after_other(r.get('after_other'))} after another file), size {size:.2f}x")
        else:
            out.append(f"{r['model']}, ONNX int: {'bit for bit' if r['bit_exact'] else 'NOT bit for bit'} "
                       f"({r['max_diff_in_steps']:.2g} steps), batch-1 latency {lat:.2f}x")
    for fmt, d in (table.meta.get("digits") or {}).items():
        ok = d["top1_agreement"] >= TARGETS["digits_top1"]
        out.append(f"digits top-1 agreement with the integer model, {FORMATS[fmt]}: {100 * d['top1_agreement']:.2f}% "
                   f"({'met' if ok else 'NOT met'})")
    return out


def _pte_verdict(r: dict) -> str:
    """The .pte target judged on the raw ratio of the C++ runner (the runtime as a deployer calls it: its fixed
    per-call cost counts, the Python binding's does not), or of the Python runner where C++ was not measured; the
    other figures beside it, not judged."""
    lat, size, cpp, above = r["latency_ratio"], r["size_ratio"], r.get("cpp"), r.get("latency_ratio_above_floor")
    judged, which = (cpp["ratio"], "C++ runner, raw, back to back") if cpp else \
        (lat, "Python runner, raw, back to back: no C++ runner here")
    also = [f"{_after_other((cpp or r).get('after_other'))} after another file", f"from Python {lat:.2f}x raw"]
    if cpp:
        also.append(f"above the floor (model time, not the target) C++ {_num(cpp['ratio_above_floor'])}, Python "
                    f"{_num(above)}")
    else:
        also.append(f"above the floor (model time, not the target) {_num(above)}; C++: {r.get('cpp_status')}")
    return (f"{r['model']}, .pte: batch-1 latency {judged:.2f}x ({which}: "
            f"{'met' if judged <= TARGETS['latency_ratio_b1'] else 'NOT met'}); {'; '.join(also)}; size {size:.2f}x "
            f"({'met' if size <= TARGETS['size_ratio'] else 'NOT met'}); {r.get('delegate_calls')} delegate calls")


def _after_other(t: dict | None) -> str:
    return "n/a" if not t else f"{t['ratio']:.2f}x"


def _num(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"
