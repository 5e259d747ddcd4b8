"""The result of intqat.deploy.onnx.export_onnx: the file's bytes, its census (what each integer layer became), the
model's float layers and why, the comparison with the integer model in onnxruntime, size and latency; as a dict,
Markdown, terminal lines, and written atomically with its report beside it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["OnnxLayer", "OnnxResult"]


@dataclass
class OnnxLayer:
    """One integer layer of the model in the ONNX file."""

    name: str
    kind: str  # the integer model's module (DeployedIntLinear, ...)
    scheme: str  # "static int8 activations, int8 per channel weights", ...
    became: str  # the ONNX ops it is, in graph order ("QuantizeLinear, DequantizeLinear, Gemm"), or "kept float"
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "scheme": self.scheme, "became": self.became, "note": self.note}


@dataclass
class OnnxResult:
    """path: the file; census: one entry per integer layer; float_layers: the model's float layers and why;
    validation: onnxruntime against the integer model; size (and latency) against an fp32 ONNX of the same model."""

    path: Path | None
    form: str
    opset: int
    census: list[OnnxLayer]
    float_layers: dict[str, str]
    validation: dict[str, Any]
    size: dict[str, Any] = field(default_factory=dict)
    latency: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    data: bytes = field(default=b"", repr=False)  # the file's bytes
    _tensorrt: Any = field(default=None, repr=False)  # tensorrt(), once

    def save(self, path: str | os.PathLike, report: bool = False) -> dict[str, Path]:
        """Write the file (and, with `report`, <name>_report.json / .md beside it: model.onnx ->
        model_onnx_report.json), each atomically."""
        import json

        from intqat.deploy.executorch import atomic_write

        path = Path(path)
        self.path = path
        payload = {path: self.data}
        if report:
            stem = path.name.replace(".", "_")
            payload[path.with_name(f"{stem}_report.json")] = (json.dumps(self.to_dict(), indent=2) + "\n").encode()
            payload[path.with_name(f"{stem}_report.md")] = self.to_markdown().encode()
        for p, data in payload.items():
            atomic_write(p, data)
        return {p.name: p for p in payload}

    def tensorrt(self):
        """Whether the file is one TensorRT's explicit quantization takes (intqat.deploy.tensorrt_check, read once
        from the file's bytes): a TensorRTReadiness, or None without bytes."""
        from intqat.deploy.tensorrt_check import check_tensorrt

        if self._tensorrt is None and self.data:
            self._tensorrt = check_tensorrt(self.data)
        return self._tensorrt

    def to_dict(self) -> dict[str, Any]:
        trt = self.tensorrt()
        return {"onnx": {"path": str(self.path), "form": self.form, "opset": self.opset, **self.info},
                "tensorrt": trt.to_dict() if trt is not None else None,
                "census": [c.to_dict() for c in self.census], "float_layers": self.float_layers,
                "validation": self.validation, "size": self.size, "latency": self.latency}

    def lines(self) -> list[str]:
        """A few lines for a terminal (intqat-export)."""
        v = self.validation
        kept = sum(c.became.startswith("kept float") for c in self.census)
        out = [f"{self.form} form, opset {self.opset}: {len(self.census) - kept} integer layers as "
               f"{'Q/DQ' if self.form == 'qdq' else 'integer ops'}" + (f", {kept} kept float" if kept else "")
               + (f"; {len(self.float_layers)} float layers ({', '.join(sorted(self.float_layers)[:4])}"
                  f"{', ...' if len(self.float_layers) > 4 else ''})" if self.float_layers else "")]
        agree = f"top-1 agreement {100 * v['top1_agreement']:.2f}%, " if "top1_agreement" in v else ""
        out.append(f"vs integer   {'bit for bit, ' if v['bit_exact'] else ''}{agree}max |diff| {v['max_abs_diff']:.4g} "
                   f"({v['max_diff_in_steps']:.3g} output steps) on {v['samples']} samples (onnxruntime, CPU)")
        g = self.info.get("onnxruntime_graph")
        if g:
            out.append(f"onnxruntime ran {_counts(g['integer_kernels']) or 'no integer kernel'}; float GEMM-class ops "
                       f"{_counts(g['float_gemms']) or 'none'}; Q / DQ left "
                       f"{g['quantize_linear']} / {g['dequantize_linear']}")
        if self.size:
            lat = ", ".join(f"batch {b}: {t['ratio']:.3f}x" + (f" (floor {1e3 * t['floor_ms']:.1f} us)"
                                                               if "floor_ms" in t else "")
                            for b, t in self.latency.get("per_batch", {}).items())
            out.append(f"vs fp32 ONNX size {self.size['ratio']:.3f}x" + (f"; latency {lat}" if lat else ""))
        trt = self.tensorrt()
        out += trt.lines() if trt is not None else []
        out += self.info.get("notes", [])
        return out

    def to_markdown(self) -> str:
        v = self.validation
        lines = [f"# intqat ONNX ({self.form} form, opset {self.opset}): {self.info.get('model', 'model')}", ""]
        lines += ["## Integer layers", "", "| layer | kind | scheme | became | note |", "|---|---|---|---|---|"]
        lines += [f"| {c.name} | {c.kind} | {c.scheme} | {c.became} | {c.note} |" for c in self.census]
        lines += ["", "## Float layers", ""] + ([f"- {n}: {r}" for n, r in self.float_layers.items()] or ["none"])
        lines += ["", "## Against the integer model (onnxruntime, CPU)", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v[k]:.6g} |" if isinstance(v[k], float) else f"| {k} | {v[k]} |"
                  for k in ("bit_exact", "top1_agreement", "max_abs_diff", "output_step", "max_diff_in_steps",
                            "sqnr_db", "accuracy", "accuracy_integer", "samples") if k in v]
        if self.size:
            lines += ["", f"Size: {self.size['bytes']} bytes, fp32 ONNX {self.size['fp32_bytes']} bytes "
                          f"({self.size['ratio']:.3f}x)"]
        for b, t in self.latency.get("per_batch", {}).items():
            floor = (f"; floor (an Identity file, same inputs) {t['floor_ms']:.4f} ms, above it "
                     f"{t['ratio_above_floor']:.3f}x") if "floor_ms" in t else ""
            after = (f"; just after another file's call {t['after_other']['ms']:.4f} vs {t['after_other']['fp32_ms']:.4f} "
                     f"ms ({t['after_other']['ratio']:.3f}x)") if t.get("after_other") else ""
            lines.append(f"- batch {b}: {t['ms']:.4f} ms, fp32 ONNX {t['fp32_ms']:.4f} ms ({t['ratio']:.3f}x){floor}{after}")
        if self.latency:
            lines.append(f"- latency: {self.latency['method']}; CPU {self.latency['cpu']}"
                         + (f"; load {self.latency['load']}" if "load" in self.latency else ""))
        g = self.info.get("onnxruntime_graph")
        if g:
            lines += ["", "## What onnxruntime runs (its optimized graph, CPU provider)", "",
                      f"- integer kernels: {_counts(g['integer_kernels']) or 'none'}",
                      f"- float GEMM-class ops: {_counts(g['float_gemms']) or 'none'}",
                      f"- QuantizeLinear / DequantizeLinear left: {g['quantize_linear']} / {g['dequantize_linear']}",
                      f"- session options: {', '.join(f'{k}={v}' for k, v in g['session_options'].items())}"]
        trt = self.tensorrt()
        if trt is not None:
            lines += ["", "## TensorRT", "", *(ln.strip() for ln in trt.lines())]
        lines += [""] + self.info.get("notes", []) + ["", ", ".join(f"{k} {v}" for k, v in self.info.get("versions", {}).items()), ""]
        return "\n".join(lines)


def _counts(ops: dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in ops.items())


# -- the export -----------------------------------------------------------------------------------------------------
