"""export_onnx: an intqat model -> an ONNX file in one of two forms, with its census and its error against the
integer model measured in onnxruntime (CPU).

.. code-block:: python

    from intqat.deploy.onnx import export_onnx
    r = export_onnx(model, (x[:2],), "export/model.onnx", form="qdq")          # QuantizeLinear / DequantizeLinear
    r = export_onnx(model, (x[:2],), "export/model.int.onnx", form="int")      # MatMulInteger / ConvInteger
    print(r.to_markdown())     # what each integer layer became, float layers and why, the error, the size

Forms (docs/numerics.md, "ONNX forms"):
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

import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from intqat.deploy._require import require
from intqat.deploy.onnx_census import census, float_of, integer_layers, layer_ops, refused_layer
from intqat.deploy.onnx_graph import (batch_first_out_projection, float_translations, residual_adds_as_sum,
                                      split_packed_heads)
from intqat.deploy.onnx_report import OnnxLayer, OnnxResult
from intqat.deploy.onnx_runtime import compare, ort_graph, session

__all__ = ["OnnxResult", "OnnxLayer", "export_onnx", "FORMS", "DEFAULT_OPSET", "TESTED"]

FORMS = ("qdq", "int")
DEFAULT_OPSET = 21  # blocked DequantizeLinear and INT4 (8da4w's weights) are opset 21's
TESTED = {"onnx": "1.23.2", "onnxscript": "0.7.2", "onnxruntime": "1.32.0", "torch": "2.13.0"}  # the tests' versions


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
                                         custom_translation_table=float_translations() | table, optimize=True, verbose=False)
    residual_adds_as_sum(onnx_program.model)  # (onnx_graph: onnxruntime's SkipLayerNormalization is the slower form)
    split_packed_heads(onnx_program.model)  # (onnx_graph: MultiheadAttention's heads in 5 nodes, not 17)
    batch_first_out_projection(onnx_program.model)  # (onnx_graph: its output without the batch_first Transpose)
    return onnx_program.model


def _strip(model) -> None:
    """Drop the exporter's per-node debug metadata (stack traces, FX nodes: most of a small model's bytes)."""
    for node in model.graph:
        for key in [k for k in node.metadata_props if k != "pkg.torch.onnx.name_scopes"]:
            del node.metadata_props[key]


def _serialize(model) -> bytes:
    from onnxscript import ir

    return ir.serde.serialize_model(model).SerializeToString()


def _form_module(form: str, model: nn.Module, reference: nn.Module, keep: Sequence[str], whole: bool = False
                 ) -> nn.Module:
    """The module the file is exported from: `form`'s layers, the layers in `keep` float (both forms alike)."""
    from intqat.deploy.onnx_int import to_int_form
    from intqat.deploy.qdq import to_qdq

    if form == "qdq":
        return to_qdq(model, keep_float=keep)
    layers = dict(reference.named_modules())
    return to_int_form(model, keep_float={n: float_of(layers[n], whole) for n in keep})


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

    from intqat._version import __version__
    from intqat.convert import float_census
    from intqat.deploy.executorch import _args, _inputs_of
    from intqat.deploy.onnx_qdq import split_unrequantized_bias, store_int4_weights
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
    integer = integer_layers(reference)
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
            split_unrequantized_bias(onnx_model)
        ops = layer_ops(onnx_model, integer)
        _strip(onnx_model)
        data = _serialize(onnx_model)
        try:
            sess = session(data)
            break
        except Exception as e:  # noqa: BLE001  (onnxruntime raises its own exception types)
            refused = refused_layer(str(e), onnx_model, integer, kept)
            if refused is None:
                raise ValueError(f"onnxruntime cannot load the exported {form} form: {e}; nothing was written") from None
            kept[refused] = f"onnxruntime refused it: {str(e).strip()[:300]}"
    validation = compare(sess, reference, batches)
    fused = ort_graph(data)  # what onnxruntime made of the file: its integer kernels, the float GEMMs left
    rows = census(form, module, reference, ops, kept)
    result = OnnxResult(path, form, opset, rows, float_census(model), validation)
    result.info = {"model": type(model).__name__, "inputs": [f"{tuple(a.shape)} {a.dtype}" for a in args],
                   "float_regions": "fp32" if autocast is None else str(autocast["low_precision_type"]),
                   "notes": notes, "bytes": len(data),
                   "versions": {p: version(p) for p in ("onnx", "onnxscript", "onnxruntime")}
                   | {"torch": torch.__version__, "intqat": __version__}, "tested_with": TESTED,
                   "onnxruntime_graph": fused}
    if fp32_baseline:
        float_data = _fp32_file(model, reference, args, max_batch, opset)
        result.size = {"bytes": len(data), "fp32_bytes": len(float_data), "ratio": len(data) / len(float_data)}
        result.latency = _latency(data, float_data, args, latency_batches, latency_repeats)
    result.data = data
    if path is not None:
        result.save(path)
    return result


def _fp32_file(model: nn.Module, reference: nn.Module, args: tuple, max_batch: int | None, opset: int) -> bytes:
    """The same model with every integer layer float (its dequantized weights): the baseline's bytes."""
    module = _form_module("int", model, reference, list(integer_layers(reference)), whole=True)
    onnx_model = _to_onnx(_program(module, args, max_batch, None, []), args, opset, {})
    _strip(onnx_model)
    return _serialize(onnx_model)


def _latency(data: bytes, float_data: bytes, args: tuple, batches: Sequence[int], repeats: int) -> dict:
    import tempfile

    from intqat.deploy.executorch import _repeat_batch
    from intqat.deploy.onnx_runtime import LATENCY_BURST, SESSION_OPTIONS, onnx_latency
    from intqat.deploy.runtime import cpu_name

    if not batches:
        return {}
    with tempfile.TemporaryDirectory(prefix="intqat-onnx-") as tmp:
        files = {"int8": Path(tmp) / "int8.onnx", "fp32": Path(tmp) / "fp32.onnx"}
        files["int8"].write_bytes(data)
        files["fp32"].write_bytes(float_data)
        after_other: dict = {}
        times = onnx_latency(files, {b: tuple(_repeat_batch(a, b) for a in args) for b in batches}, repeats,
                             after_other=after_other)
    # floor: an Identity file on the same inputs, timed the same way (onnxruntime's fixed cost per call from
    # Python); above the floor: the ratio of what the two graphs themselves cost. after_other: each file's first
    # call of a burst, just after another file's (caches and onnxruntime state another model left): beside, not
    # the target's figure
    per_batch = {b: {"ms": t["int8"], "fp32_ms": t["fp32"], "ratio": t["int8"] / t["fp32"], "floor_ms": t["floor"],
                     "ratio_above_floor": (t["int8"] - t["floor"]) / max(t["fp32"] - t["floor"], 1e-9),
                     "after_other": {"ms": after_other[b]["int8"], "fp32_ms": after_other[b]["fp32"],
                                     "ratio": after_other[b]["int8"] / after_other[b]["fp32"]}}
                 for b, t in times.items()}
    return {"per_batch": per_batch, "cpu": cpu_name(), "session_options": dict(SESSION_OPTIONS),
            "load": _load(),
            "method": f"median CPU time (time.process_time) per call of back-to-back calls: {repeats} rounds, each "
                      "running the file, the fp32 file and an Identity floor on the same inputs in turn (the order "
                      f"rotated each round), {LATENCY_BURST} calls each, all but the first timed as back to back "
                      "(after_other: the first, just after another file's); onnxruntime session options "
                      f"{', '.join(f'{k}={v}' for k, v in SESSION_OPTIONS.items())}, in a Python that never imported "
                      "intqat"}


def _load() -> str:
    """The 1-, 5-, 15-minute load averages beside the figures (a shared machine's ratios hold, its times less so)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
