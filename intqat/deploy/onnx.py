"""export_onnx: an intqat model -> an ONNX file in one of two forms, with its census and its error against the
integer model measured in onnxruntime (CPU).

.. code-block:: python

    from intqat.deploy.onnx import export_onnx
    r = export_onnx(model, (x[:2],), "export/model.onnx", form="qdq")          # QuantizeLinear / DequantizeLinear
    r = export_onnx(model, (x[:2],), "export/model.int.onnx", form="int")      # MatMulInteger / ConvInteger
    print(r.to_markdown())     # what each integer layer became, float layers and why, the error, the size

Forms (NUMERICS.md, "ONNX forms"):
  qdq  intqat.deploy.to_qdq's program: QuantizeLinear -> DequantizeLinear around the float op, weights as int8 codes
       (per channel, axis 0, zero point 0) or INT4 codes in blocks (DequantizeLinear's block_size, opset 21); what
       onnxruntime's Q/DQ fusion and TensorRT's explicit quantization read (onnx_qdq.py). Close to the integer
       model: the runtime computes from the same codes in its own float order.
  int  the integer ops: MatMulInteger / ConvInteger into int32, then intqat's fp32 epilogue in intqat's order
       (onnx_int.py): onnxruntime's output equals the integer model's bit for bit.
Pipeline (the model is never touched): the form's module -> torch.export (batch dynamic) -> intqat's autocast rules on
the float regions (low_precision_type=fp16; None keeps them fp32; onnxruntime's CPU provider has no bf16 kernels, so
bf16 regions stay fp32 and the result says so) -> torch.onnx.export(dynamo=True) with the forms' translation tables
-> onnxruntime on the validation batches against the integer model -> the file, written atomically.

Loading the file elsewhere needs onnxruntime alone: `onnxruntime.InferenceSession(path)`.
"""

from __future__ import annotations

import ast
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from intqat.deploy._require import require
from intqat.deploy.onnx_runtime import compare, session

__all__ = ["OnnxResult", "OnnxLayer", "export_onnx", "FORMS", "DEFAULT_OPSET", "TESTED"]

FORMS = ("qdq", "int")
DEFAULT_OPSET = 21  # blocked DequantizeLinear and INT4 (8da4w's weights) are opset 21's
TESTED = {"onnx": "1.23.2", "onnxscript": "0.7.2", "onnxruntime": "1.32.0", "torch": "2.13.0"}  # the tests' versions
# the ONNX ops that name what a layer became, by form (Gather only for embeddings: a per-group layer's p[g] is one too)
_KEY_OPS = {"int": ("MatMulInteger", "ConvInteger"), "qdq": ("QuantizeLinear", "DequantizeLinear", "Gemm", "MatMul", "Conv")}


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

    def to_dict(self) -> dict[str, Any]:
        return {"onnx": {"path": str(self.path), "form": self.form, "opset": self.opset, **self.info},
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
        if self.size:
            lat = ", ".join(f"batch {b}: {t['ratio']:.3f}x" for b, t in self.latency.get("per_batch", {}).items())
            out.append(f"vs fp32 ONNX size {self.size['ratio']:.3f}x" + (f"; latency {lat}" if lat else ""))
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
            lines.append(f"- batch {b}: {t['ms']:.3f} ms, fp32 ONNX {t['fp32_ms']:.3f} ms ({t['ratio']:.3f}x)")
        if self.latency:
            lines.append(f"- latency: {self.latency['method']}; CPU {self.latency['cpu']}")
        lines += [""] + self.info.get("notes", []) + ["", ", ".join(f"{k} {v}" for k, v in self.info.get("versions", {}).items()), ""]
        return "\n".join(lines)


# -- the export -----------------------------------------------------------------------------------------------------
def _dynamic_batch(args: tuple, max_batch: int | None) -> tuple:
    batch = torch.export.Dim("batch", min=1, max=max_batch) if max_batch else torch.export.Dim("batch", min=1)
    return tuple({0: batch} if isinstance(a, Tensor) and a.dim() else None for a in args)


def _program(module: nn.Module, args: tuple, max_batch: int | None, autocast: dict | None, calibration: list):
    from intqat.autocast import convert

    with torch.no_grad():
        program = torch.export.export(module, args, dynamic_shapes=_dynamic_batch(args, max_batch))
    if autocast is None:
        return program
    # the integer layers keep their fp32 quantize / epilogue (suffixes: QDQIntLinear, OnnxIntLinear, ... )
    types = tuple(dict.fromkeys([*autocast.get("integer_module_types", ()), "IntLinear", "IntConv2d", "IntEmbedding"]))
    program, _ = convert(program, calibration_data=calibration or None, **{**autocast, "integer_module_types": types})
    return program


def _to_onnx(program, args: tuple, opset: int, table: dict):
    """torch.onnx.export of the program -> the onnx_ir model (quiet: its progress lines are not ours)."""
    import contextlib
    import io

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        onnx_program = torch.onnx.export(program, args, dynamo=True, opset_version=opset,
                                         custom_translation_table=table, optimize=True, verbose=False)
    return onnx_program.model


def _layer_ops(model, layers: Iterable[str]) -> dict[str, list[str]]:
    """layer -> the ONNX op types of its nodes, in graph order (from the exporter's name scopes)."""
    names, out = set(layers), {}
    for node in model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        if not scopes:
            continue
        path = [s for s in ast.literal_eval(scopes)[:-1] if s]
        layer = next((p for p in reversed(path) if p in names), None)
        if layer is not None:
            out.setdefault(layer, []).append(node.op_type)
    return out


def _strip(model) -> None:
    """Drop the exporter's per-node debug metadata (stack traces, FX nodes: most of a small model's bytes)."""
    for node in model.graph:
        for key in [k for k in node.metadata_props if k != "pkg.torch.onnx.name_scopes"]:
            del node.metadata_props[key]


def _serialize(model) -> bytes:
    from onnxscript import ir

    return ir.serde.serialize_model(model).SerializeToString()


def _scheme(layer: nn.Module) -> str:
    """The integer model's scheme of one deployed layer."""
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntEmbedding

    q_w = layer.q_w
    bits = max(2, int(q_w.abs().max()).bit_length() + 1) if q_w.numel() else 8
    if isinstance(layer, DeployedIntEmbedding):
        return f"int{bits} table, {layer.w_scale.shape[1]} scale(s) per row"
    act = "dynamic per-token" if layer.x_dynamic and q_w.dim() == 2 else "dynamic per-tensor" if layer.x_dynamic \
        else "static"
    w = f"int{bits} per group ({layer.group_size})" if isinstance(layer, DeployedGroupedIntLinear) \
        else f"int{bits} per channel"
    return f"{act} int8 activations, {w} weights"


_NOTES = {
    "int": {"OnnxIntLinear": "int32 accumulators exact; epilogue float(acc) * (s_x s_w) + b as intqat's",
            "OnnxIntConv2d": "int32 accumulators exact (padding with the zero point's code); epilogue as intqat's",
            "OnnxGroupedIntLinear": "one MatMulInteger per group (batched), the group sums added in intqat's order",
            "OnnxIntEmbedding": "the int8 rows and their scales gathered, y = float(q) * s"},
    "qdq": {"QDQIntLinear": "", "QDQIntConv2d": "", "QDQIntEmbedding": "",
            "QDQGroupedIntLinear": "per-group weights: DequantizeLinear with block_size (opset 21)"},
}


def _census(form: str, module: nn.Module, reference: nn.Module, ops: dict[str, list[str]],
            kept: dict[str, str]) -> list[OnnxLayer]:
    from intqat.deploy.onnx_int import int_layers
    from intqat.deploy.qdq import qdq_layers

    deployed = dict(reference.named_modules())
    layers = int_layers(module) if form == "int" else qdq_layers(module)
    rows = []
    for name in [n for n in deployed if n in layers or n in kept]:
        src = deployed[name]
        if name in kept:
            rows.append(OnnxLayer(name, type(src).__name__, _scheme(src), "kept float", kept[name]))
            continue
        if name not in ops:
            continue  # never called by forward (an attention projection for another input grouping): not in the file
        layer = layers[name]
        keys = _KEY_OPS[form] + (("Gather",) if "Embedding" in type(layer).__name__ else ())
        found = [o for o in dict.fromkeys(ops[name]) if o in keys]
        note = _NOTES[form].get(type(layer).__name__, "")
        aq = getattr(layer, "input_qdq", None)
        if form == "qdq" and aq is not None and aq.dynamic:
            note = ("activation scale computed at run time, written out (ReduceMax / ReduceMin / Div / Reciprocal / "
                    "Round / Clip: intqat's codes), then DequantizeLinear; runs as a float GEMM" + ("; " + note if note else ""))
        rows.append(OnnxLayer(name, type(src).__name__, _scheme(src), ", ".join(found), note))
    return rows


def _integer_layers(reference: nn.Module) -> dict[str, nn.Module]:
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    kinds = (DeployedIntLinear, DeployedIntConv2d, DeployedGroupedIntLinear, DeployedIntEmbedding)
    return {n: m for n, m in reference.named_modules() if isinstance(m, kinds)}


@torch.no_grad()
def _float_of(layer: nn.Module, whole: bool = False) -> nn.Module:
    """A deployed integer layer as the float layer a kept one becomes: its dequantized weight w_hat (the values the
    integer model's weights stand for), fp32, and no activation quantization. whole: every layer is kept float."""
    from intqat.nn import DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    if not whole and (getattr(layer, "input_codes", False) or getattr(layer, "out_codes", False)):
        raise ValueError("a layer of an int8 chain (intqat.chain_int8) cannot be kept float alone: its neighbour "
                         "passes it int8 codes")
    if isinstance(layer, DeployedIntEmbedding):
        n, d = layer.q_w.shape
        w = (layer.q_w.to(torch.float32).reshape(n, layer.w_scale.shape[1], -1) * layer.w_scale.unsqueeze(-1))
        return nn.Embedding.from_pretrained(w.reshape(n, d), freeze=True)
    w = layer.q_w.to(torch.float32)
    if isinstance(layer, DeployedIntConv2d):
        w = w * layer.w_scale.reshape(-1, 1, 1, 1)
        o, cg, kh, kw = w.shape
        m = nn.Conv2d(cg * layer.groups, o, (kh, kw), layer.stride, layer.padding, layer.dilation, layer.groups,
                      bias=layer.bias is not None)
    else:  # DeployedIntLinear (nn.Linear layout whatever it came from) or DeployedGroupedIntLinear
        w = w * layer.w_scale.reshape(-1, 1) if isinstance(layer, DeployedIntLinear) else \
            (w.reshape(w.shape[0], layer.w_scale.shape[1], -1) * layer.w_scale.unsqueeze(-1)).reshape(w.shape)
        m = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None)
    m.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if layer.bias is not None:
        m.bias = nn.Parameter(layer.bias.detach().to(torch.float32).clone(), requires_grad=False)
    return m.eval()


def _form_module(form: str, model: nn.Module, reference: nn.Module, keep: Sequence[str], whole: bool = False
                 ) -> nn.Module:
    """The module the file is exported from: `form`'s layers, the layers in `keep` float (both forms alike)."""
    from intqat.deploy.onnx_int import to_int_form
    from intqat.deploy.qdq import to_qdq

    if form == "qdq":
        return to_qdq(model, keep_float=keep)
    layers = dict(reference.named_modules())
    return to_int_form(model, keep_float={n: _float_of(layers[n], whole) for n in keep})


def _table(form: str) -> dict:
    from intqat.deploy.onnx_int import TRANSLATIONS
    from intqat.deploy.onnx_qdq import qdq_translations

    return qdq_translations() if form == "qdq" else TRANSLATIONS()


def _check_path(path: Path) -> None:
    """A clear error before any work when the file cannot be written there."""
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if path.is_dir():
        raise ValueError(f"{path} is a directory: give the ONNX file's path (e.g. {path / 'model.onnx'})")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"cannot write {path}: {parent} is not a writable directory")


@torch.no_grad()
def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike | None,
    *,
    form: str = "qdq",
    opset: int = DEFAULT_OPSET,
    max_batch: int | None = None,
    validation_data: Iterable | None = None,
    calibration_data: Iterable | None = None,
    keep_float: Sequence[str] = (),
    low_precision_type: Any = None,
    fp32_baseline: bool = False,
    latency_batches: Sequence[int] = (1, 32),
    latency_repeats: int = 30,
    **autocast_options: Any,
) -> OnnxResult:
    """Export `model` (never modified) as ONNX in `form` ("qdq" or "int"; module docstring) and write it to `path`
    atomically (None: only the result; a failure writes nothing).

    example_inputs: forward()'s positional tensors (the batch dim is dynamic in the file; max_batch bounds it while
    tracing only: onnxruntime takes any batch). validation_data: batches (input tuples or (inputs..., labels)) the
    file is run on in onnxruntime against the integer model (default: the examples). keep_float: integer layers (as
    in model.named_modules()) to keep float (their dequantized weights, float input); a layer onnxruntime refuses is
    kept float too, named with its error. low_precision_type: None keeps the float regions fp32; torch.float16 applies
    intqat's autocast rules (autocast_options: intqat.autocast.convert's keywords, calibration_data its data_max);
    bf16 stays fp32 (onnxruntime's CPU provider has no bf16 kernels; said in result.info["notes"]).
    fp32_baseline: also export the model with every layer float and compare size and latency (one onnxruntime
    thread, CPU time, median of latency_repeats, at latency_batches).
    """
    from importlib.metadata import version

    from intqat import __version__
    from intqat.convert import float_census
    from intqat.deploy.executorch import _args, _inputs_of
    from intqat.deploy.onnx_qdq import store_int4_weights
    from intqat.deploy.qdq import _integer_copy

    if form not in FORMS:
        raise ValueError(f"unknown ONNX form {form!r}: choose 'qdq' (QuantizeLinear / DequantizeLinear) or 'int' "
                         "(MatMulInteger / ConvInteger, bit for bit)")
    require("onnx" if form == "qdq" else "onnx-int")
    if not isinstance(opset, int) or opset < DEFAULT_OPSET:
        raise ValueError(f"opset {opset!r}: the ONNX forms need opset >= {DEFAULT_OPSET} (blocked DequantizeLinear and "
                         "INT4 weights)")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 (or None), got {max_batch}")
    path = None if path is None else Path(path)
    if path is not None:
        _check_path(path)
    args = _args(example_inputs)
    if not all(isinstance(a, Tensor) for a in args):
        raise TypeError("export_onnx takes tensor inputs only (an ONNX graph's inputs are tensors)")
    calibration = [_inputs_of(b, len(args))[0] for b in calibration_data] if calibration_data is not None else []
    batches = [_inputs_of(b, len(args)) for b in validation_data] if validation_data is not None else [(args, None)]
    if not batches:
        raise ValueError("validation_data yielded no batch")
    notes = []
    autocast = None
    if low_precision_type in (torch.bfloat16, "bf16", "bfloat16"):
        notes.append("float regions kept fp32, not bf16: onnxruntime's CPU provider has no bf16 kernels (a bf16 Gemm "
                     "fails: 'Could not find an implementation for Gemm(13)'); low_precision_type=fp16 casts them")
    elif low_precision_type is not None:
        autocast = {"low_precision_type": low_precision_type, **autocast_options}
    elif autocast_options:
        raise ValueError(f"autocast options {sorted(autocast_options)} need low_precision_type (fp16)")

    reference = _integer_copy(model).eval()
    integer = _integer_layers(reference)
    unknown = sorted(set(keep_float) - set(integer))
    if unknown:
        raise ValueError(f"keep_float names {unknown}, which are not integer layers of the model; its integer layers: "
                         f"{', '.join(integer) or '(none)'}")
    kept = {n: "asked (keep_float)" for n in keep_float}
    table = _table(form)
    while True:  # a layer onnxruntime refuses is kept float and the model exported again
        module = _form_module(form, model, reference, list(kept))
        onnx_model = _to_onnx(_program(module, args, max_batch, autocast, calibration), args, opset, table)
        if form == "qdq":
            store_int4_weights(onnx_model)
        ops = _layer_ops(onnx_model, integer)
        _strip(onnx_model)
        data = _serialize(onnx_model)
        try:
            sess = session(data)
            break
        except Exception as e:  # noqa: BLE001  (onnxruntime raises its own exception types)
            refused = _refused_layer(str(e), onnx_model, integer, kept)
            if refused is None:
                raise ValueError(f"onnxruntime cannot load the exported {form} form: {e}; nothing was written") from None
            kept[refused] = f"onnxruntime refused it: {str(e).strip()[:300]}"
    validation = compare(sess, reference, batches)
    census = _census(form, module, reference, ops, kept)
    result = OnnxResult(path, form, opset, census, float_census(model), validation)
    result.info = {"model": type(model).__name__, "inputs": [f"{tuple(a.shape)} {a.dtype}" for a in args],
                   "float_regions": "fp32" if autocast is None else str(autocast["low_precision_type"]),
                   "notes": notes, "bytes": len(data),
                   "versions": {p: version(p) for p in ("onnx", "onnxscript", "onnxruntime")}
                   | {"torch": torch.__version__, "intqat": __version__}, "tested_with": TESTED}
    if fp32_baseline:
        float_data = _fp32_file(model, reference, args, max_batch, opset)
        result.size = {"bytes": len(data), "fp32_bytes": len(float_data), "ratio": len(data) / len(float_data)}
        result.latency = _latency(data, float_data, args, latency_batches, latency_repeats)
    result.data = data
    if path is not None:
        result.save(path)
    return result


def _refused_layer(message: str, onnx_model, integer: dict, kept: dict) -> str | None:
    """The integer layer whose node onnxruntime names in its error, if any (and not already kept float)."""
    for node in onnx_model.graph:
        if node.name and f"'{node.name}'" in message:
            scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
            path = [s for s in ast.literal_eval(scopes)[:-1] if s] if scopes else []
            layer = next((p for p in reversed(path) if p in integer), None)
            if layer is not None and layer not in kept:
                return layer
    return None


def _fp32_file(model: nn.Module, reference: nn.Module, args: tuple, max_batch: int | None, opset: int) -> bytes:
    """The same model with every integer layer float (its dequantized weights): the baseline's bytes."""
    module = _form_module("int", model, reference, list(_integer_layers(reference)), whole=True)
    onnx_model = _to_onnx(_program(module, args, max_batch, None, []), args, opset, {})
    _strip(onnx_model)
    return _serialize(onnx_model)


def _latency(data: bytes, float_data: bytes, args: tuple, batches: Sequence[int], repeats: int) -> dict:
    import tempfile

    from intqat.deploy.executorch import _repeat_batch
    from intqat.deploy.onnx_runtime import onnx_latency
    from intqat.deploy.runtime import cpu_name

    if not batches:
        return {}
    with tempfile.TemporaryDirectory(prefix="intqat-onnx-") as tmp:
        files = {"int8": Path(tmp) / "int8.onnx", "fp32": Path(tmp) / "fp32.onnx"}
        files["int8"].write_bytes(data)
        files["fp32"].write_bytes(float_data)
        times = onnx_latency(files, {b: tuple(_repeat_batch(a, b) for a in args) for b in batches}, repeats)
    per_batch = {b: {"ms": t["int8"], "fp32_ms": t["fp32"], "ratio": t["int8"] / t["fp32"]} for b, t in times.items()}
    return {"per_batch": per_batch, "cpu": cpu_name(),
            "method": f"median CPU time (time.process_time) of {repeats} interleaved calls, 1 onnxruntime thread, in "
                      "a Python that never imported intqat"}
