"""export_pte: an intqat model -> model.pte for ExecuTorch, lowered with XNNPACK, with its delegation census and its
error against the integer model measured in ExecuTorch's own runtime.

.. code-block:: python

    from intqat.deploy.executorch import export_pte
    result = export_pte(model, (x[:2],), "export/model.pte", calibration_data=val, validation_data=test)
    print(result.to_markdown())          # census, agreement, size and latency against an fp32 .pte

Pipeline (the model is never touched):
  to_qdq (intqat.deploy.qdq: the Q/DQ form, codes equal to the integer model's)
  -> torch.export (batch dynamic up to max_batch: ExecuTorch plans memory for the largest shape)
  -> XNNPACK's needs (intqat.deploy.xnnpack: int8 outputs of static GEMMs, the dynamic-conv marker)
  -> intqat's autocast rules on the float regions (low_precision_type; None keeps them fp32)
  -> to_edge_transform_and_lower with XnnpackPartitioner (intqat.deploy.lower: the census)
  -> layers XNNPACK refused are kept float (w_hat, fp32 GEMM) and the program is lowered again: nothing quantized
     is left to run silently outside it; each is named with the partitioner's reason
  -> to_executorch (quantized embeddings fused into ExecuTorch's embedding_byte / embedding_4bit kernels)
  -> run in executorch.runtime against the integer model; the same model kept float is the fp32 .pte baseline.

Loading the file elsewhere: `executorch.runtime.Runtime.get().load_program(path)`; a model with quantized
embeddings needs ExecuTorch's quantized kernels registered (`import executorch.kernels.quantized` in Python).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from intqat.deploy._require import require
from intqat.deploy.lower import LayerCensus, Lowered, lower_xnnpack
from intqat.deploy.qdq import QDQGroupedIntLinear, QDQIntConv2d, QDQIntEmbedding, qdq_layers, to_qdq
from intqat.deploy.pte_latency import measure_latency, repeat_batch
from intqat.deploy.pte_size import pte_parts
from intqat.deploy.runtime import chunks, load_pte, pte_latency, run_pte
from intqat.deploy.xnnpack_graph import rewrite_for_xnnpack, rewrite_quantized_for_xnnpack
from intqat.deploy.xnnpack import OutputGrid, mark_dynamic_convs, model_output_layers, requantize_static_outputs

__all__ = ["PteResult", "export_pte", "load_pte", "run_pte", "pte_latency", "PTE_FILE"]

_repeat_batch = repeat_batch  # (intqat.deploy.onnx times its files on the same inputs)

PTE_FILE = "model.pte"
TESTED = {"executorch": "1.5.1", "torch": "2.13.0", "torchao": "0.18.0"}  # what tests/test_deploy_pte.py ran on


# -- inputs --------------------------------------------------------------------------------------------
def _args(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TypeError(f"example_inputs must be a tensor or a tuple of forward()'s positional inputs, got "
                        f"{type(example_inputs).__name__}; e.g. export_pte(model, (x[:2],), 'model.pte')")
    return tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in example_inputs)


def _inputs_of(item: Any, n_args: int) -> tuple[tuple, Tensor | None]:
    """One batch as (inputs, labels or None): a tensor, a tuple of inputs, or (inputs..., labels)."""
    if isinstance(item, Tensor):
        return (item,), None
    if isinstance(item, (tuple, list)) and len(item) in (n_args, n_args + 1):
        return tuple(item[:n_args]), (item[n_args] if len(item) > n_args else None)
    raise TypeError(f"a batch must be a tensor, a tuple of {n_args} input(s) or (inputs..., labels), "
                    f"got {type(item).__name__}")


def _float_leaves(out: Any) -> list[Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]


# -- lowering --------------------------------------------------------------------------------------------
def _dynamic_batch(args: tuple, max_batch: int) -> tuple:
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    return tuple({0: batch} if isinstance(a, Tensor) and a.dim() else None for a in args)


def _scheme(layer: nn.Module) -> str:
    aq = getattr(layer, "input_qdq", None)
    if isinstance(layer, QDQIntEmbedding):
        return f"int{_bits(layer)} per group ({layer.group_size}) table"
    act = ("static int8" if not aq.dynamic else
           f"dynamic {'per-token' if aq.per_token else 'per-tensor'} int8") if aq is not None else "float"
    w = f"int{_bits(layer)} per group ({layer.group_size})" if isinstance(layer, QDQGroupedIntLinear) \
        else f"int{_bits(layer)} per channel"
    return f"{act} activations, {w} weights"


def _bits(layer: nn.Module) -> int:
    return 4 if (layer.w_qmin, layer.w_qmax) == (-8, 7) else max(2, (layer.w_qmax - layer.w_qmin).bit_length())


def _export(qdq: nn.Module, args: tuple, max_batch: int):
    with torch.no_grad():
        program = torch.export.export(qdq, args, dynamic_shapes=_dynamic_batch(args, max_batch))
    return program.run_decompositions({})  # functional (an in-place relu_ becomes relu), aten.linear & co. kept


def _lower(qdq: nn.Module, args: tuple, max_batch: int, calibration: list[tuple], autocast: dict | None
           ) -> tuple[Lowered, list[OutputGrid], Any]:
    from intqat.deploy.qdq import QDQ_TYPES, FloatKeptConv2d, FloatKeptLinear

    layers = [n for n, m in qdq.named_modules() if isinstance(m, QDQ_TYPES + (FloatKeptLinear, FloatKeptConv2d))]
    program = _export(qdq, args, max_batch)
    rewrites = rewrite_for_xnnpack(program)  # (the same values; fewer ops outside XNNPACK, fewer delegate calls)
    grids = requantize_static_outputs(program, layers, calibration)
    mark_dynamic_convs(program)
    report = None
    if autocast is not None:
        from intqat.autocast import convert

        # the Q/DQ layers stay as they are: a cast inside one breaks the pattern XNNPACK (or ExecuTorch's embedding
        # fusion) matches; the suffixes cover QDQIntLinear, QDQGroupedIntLinear, QDQIntConv2d, QDQIntEmbedding
        types = tuple(dict.fromkeys([*autocast.get("integer_module_types", ("IntLinear", "IntConv2d")),
                                     "IntLinear", "IntConv2d", "IntEmbedding"]))
        program, report = convert(program, calibration_data=calibration or None,
                                  **{**autocast, "integer_module_types": types})
    rewrites.update(rewrite_quantized_for_xnnpack(program))  # (fp32 ops re-spelled for XNNPACK, values kept)
    lowered = lower_xnnpack(program, layers)
    lowered.rewrites = rewrites
    _restore_batch_range(lowered, max_batch)
    return lowered, grids, report


def _restore_batch_range(lowered: Lowered, max_batch: int) -> None:
    """Give the batch symbol its range [1, max_batch] back before memory planning. Lowering re-runs aten.conv2d on
    fake tensors, whose backend choice (torch's fake conv, `_select_conv_backend`) guards the batch against 16 with
    the example's batch as the hint; the guard refines the batch's range to [2, 15], and ExecuTorch then plans
    the input for 15 images (a batch of 16 failed: "Attempted to resize a bounded tensor"). The guard picks a
    kernel in torch, not a shape rule: XNNPACK's delegate takes any batch."""
    from torch.utils._sympy.value_ranges import ValueRanges

    program = lowered.manager.exported_program()
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
            sym = val.shape[0].node.expr
            if sym.is_Symbol:
                val.shape[0].node.shape_env.var_to_range[sym] = ValueRanges(1, max_batch)
                program.range_constraints[sym] = ValueRanges(1, max_batch)


def _xnnpack_cannot(qdq: nn.Module) -> dict[str, str]:
    """Layers whose quantized form XNNPACK cannot take, known from its sources before lowering: per-group weights
    must be int4 in groups of a multiple of 32 (its serializer asserts otherwise, after the partitioner took them:
    executorch/backends/xnnpack/operators/node_visitor.py, _check_per_channel_group_params), and dynamic
    activations only feed standard (not grouped / depthwise) convs."""
    out = {}
    for name, layer in qdq_layers(qdq).items():
        if isinstance(layer, QDQIntConv2d) and layer.input_qdq.dynamic and layer.groups > 1:
            # (its partitioner's own words, gemm_configs.ConvolutionConfig: known before lowering, which saves one)
            out[name] = ("XNNPACK only supports standard 2D convolutions for dynamic quantization (its partitioner: "
                         f"a grouped / depthwise conv, groups={layer.groups}, with dynamic activations)")
        if isinstance(layer, QDQGroupedIntLinear) and (_bits(layer) > 4 or layer.group_size % 32):
            out[name] = (f"XNNPACK's per-group GEMM takes int4 weights in groups of a multiple of 32; this layer has "
                         f"int{_bits(layer)} weights in groups of {layer.group_size}")
    return out


def _buffer(lowered: Lowered) -> bytes:
    import executorch.kernels.quantized  # noqa: F401  (the out variants of quantized_decomposed's ops)
    from executorch.exir import ExecutorchBackendConfig

    try:
        program = lowered.manager.to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))
    except RuntimeError as e:
        if "Missing out variants" not in str(e):
            raise
        raise ValueError(f"ExecuTorch has no kernel for ops left outside XNNPACK: {e}") from None
    lowered.final_ops = _layer_ops(program.exported_program(), lowered)
    return program.buffer


def _layer_ops(program, lowered: Lowered) -> dict[str, set[str]]:
    """The fused quantized-embedding kernels in the final program: "" -> their op names. (The fusion pass gives
    its nodes no module path; it succeeded for every embedding when to_executorch did: an unfused torchao
    dequantize_affine has no ExecuTorch kernel, and to_executorch refuses it.)"""
    from intqat.deploy.lower import _target_name

    return {"": {_target_name(n) for n in program.graph.nodes
                 if n.op == "call_function" and "quantized_decomposed.embedding_" in _target_name(n)}}


# -- the result --------------------------------------------------------------------------------------------
@dataclass
class PteResult:
    """buffer: the .pte bytes; census: one entry per integer layer; validation: the .pte against the integer
    model in executorch.runtime; size / latency: against an fp32 .pte of the same model (its layers float)."""

    buffer: bytes
    census: list[LayerCensus]
    validation: dict[str, Any]
    size: dict[str, Any] = field(default_factory=dict)
    latency: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"pte": self.info, "census": [c.to_dict() for c in self.census], "validation": self.validation,
                "size": self.size, "latency": self.latency}

    def to_markdown(self) -> str:
        v, info = self.validation, self.info
        lines = [f"# intqat .pte (ExecuTorch, XNNPACK): {info.get('model', 'model')}", ""]
        if info.get("source"):
            lines += [f"Source: {info['source']}", ""]
        lines += ["## Integer layers", "", "| layer | kind | scheme | runs in | note |", "|---|---|---|---|---|"]
        lines += [f"| {c.name} | {c.kind} | {c.scheme} | {c.where} | {c.note} |" for c in self.census]
        outside = info.get("float_ops_outside_xnnpack") or {}
        lines += ["", "Float ops outside XNNPACK (ExecuTorch's portable kernels): "
                  + (", ".join(f"{op} x{n}" for op, n in outside.items()) if outside else "none")]
        if "delegate_calls" in info:
            rw = ", ".join(f"{k} {v}" for k, v in info.get("graph_rewrites", {}).items())
            lines += ["", f"XNNPACK delegate calls per forward: {info['delegate_calls']} (graph rewrites for XNNPACK, "
                      f"values unchanged: {rw or 'none'})"]
        for note in info.get("notes", []):
            lines += ["", note]
        lines += ["", "## Against the integer model (executorch.runtime)", "",
                  f"On {v['samples']} samples ({v['batches']} batches).", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v[k])} |" for k in ("top1_agreement", "max_abs_diff", "output_step",
                                                     "max_diff_in_steps", "mean_abs_diff", "accuracy",
                                                     "accuracy_integer", "cross_entropy", "cross_entropy_integer",
                                                     "perplexity", "perplexity_integer", "perplexity_change") if k in v]
        lines += ["", f"output_step: {v.get('output_step_is', '')}"]
        if self.size:
            s = self.size
            lines += ["", "## Size and latency against an fp32 .pte of the same model", "",
                      f"- size: {s['int8_bytes']} bytes, fp32 .pte {s['fp32_bytes']} bytes ({s['ratio']:.3f}x)"]
            if "int8_parts" in s:
                lines += [f"- {k} .pte parts (bytes): " + ", ".join(f"{n} {v}" for n, v in s[f"{k}_parts"].items())
                          for k in ("int8", "fp32")]
        for batch, t in self.latency.get("per_batch", {}).items():
            for runner, f in (("python", t), ("C++", t.get("cpp"))):
                if f is None:
                    continue
                above = "n/a" if f["ratio_above_floor"] is None else f"{f['ratio_above_floor']:.3f}x"
                lines.append(f"- batch {batch}, {runner}: {f['int8_ms'] * 1e3:.2f} µs, fp32 .pte {f['fp32_ms'] * 1e3:.2f} µs "
                             f"({f['ratio']:.3f}x raw); floor {f['floor_ms'] * 1e3:.2f} µs, above it "
                             f"{f['int8_above_floor_ms'] * 1e3:.2f} vs {f['fp32_above_floor_ms'] * 1e3:.2f} µs ({above})"
                             + (f"; just after another file's call {f['after_other']['ratio']:.3f}x"
                                if f.get("after_other") else ""))
        if self.latency:
            lines.append(f"- latency: {self.latency['method']}; C++ runner {self.latency['cpp']}; CPU "
                         f"{self.latency['cpu']}")
        lines += ["", f"executorch {info.get('executorch')}, torch {info.get('torch')}, intqat {info.get('intqat')}", ""]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike, report: bool = True) -> dict[str, Path]:
        """Write the .pte (and, with `report`, <stem>_report.json / .md beside it), each atomically."""
        path = Path(path)
        files = {path.name: path}
        payload = {path.name: self.buffer}
        if report:
            stem = path.stem
            payload[f"{stem}_report.json"] = (json.dumps(self.to_dict(), indent=2) + "\n").encode()
            payload[f"{stem}_report.md"] = self.to_markdown().encode()
            files.update({n: path.with_name(n) for n in payload if n != path.name})
        for name, data in payload.items():
            atomic_write(files[name], data)
        self.path = path
        return files


def atomic_write(path: Path, data: bytes) -> None:
    """Write into a temporary file beside path, fsync, rename: a failure leaves no half file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


# -- the census ------------------------------------------------------------------------------------------
def _census(qdq: nn.Module, lowered: Lowered, kept: dict[str, str], grids: list[OutputGrid],
            fp32_weights: Sequence[str] = ()) -> list[LayerCensus]:
    grid_of = {g.layer: g for g in grids}
    rows = []
    for name, layer in qdq_layers(qdq).items():
        if name not in lowered.present and name not in kept:
            continue  # never called by forward (an attention's projection for another input grouping): not in the .pte
        kind, scheme = type(layer).__name__, _scheme(layer)
        if isinstance(layer, QDQIntEmbedding):
            want = "embedding_4bit" if _bits(layer) <= 4 else "embedding_byte"
            fused = sorted(op for op in lowered.final_ops.get("", set()) if want in op)
            if fused:
                rows.append(LayerCensus(name, kind, scheme, f"ExecuTorch kernel {fused[0]}",
                                        "XNNPACK has no gather: ExecuTorch's quantized kernel dequantizes the rows asked "
                                        "for (load the .pte with ExecuTorch's quantized kernels registered)"))
            else:
                raise ValueError(f"embedding {name}: the .pte holds no quantized_decomposed.{want} kernel for it")
            continue
        if name in kept:
            rows.append(LayerCensus(name, kind, scheme, "kept float (fp32 GEMM in XNNPACK)"
                                    if name in lowered.taken else "kept float (ExecuTorch portable kernels)",
                                    f"XNNPACK refused its quantized form: {kept[name]}"))
            continue
        if name in fp32_weights:
            where = "XNNPACK (fp32 GEMM, int8-quantized input)" if name in lowered.taken else \
                f"ExecuTorch portable kernels ({lowered.refused.get(name, 'not delegated')})"
            rows.append(LayerCensus(name, kind, scheme, where,
                                    "its output is the model's output: fp32 as in the integer model, where XNNPACK's "
                                    "static int8 GEMM would round the logits to int8; its weight is stored dequantized "
                                    "(w_hat, fp32), its input keeps its Q/DQ"))
            continue
        if name in lowered.taken:
            g = grid_of.get(name)
            note = "" if g is None else (f"int8 output on {g.reason} (s={g.scale:.6g}, z={g.zero_point})" if g.exact else
                                         f"int8 output: {g.reason} (s={g.scale:.6g}, z={g.zero_point}); adds a rounding "
                                         "of up to s/2 the integer model does not have (XNNPACK's static GEMM writes int8)")
            if isinstance(layer, QDQIntConv2d) and layer.input_qdq.dynamic:
                note = "XNNPACK quantizes each image's activations itself at run time (asymmetric)"
            elif getattr(layer, "input_qdq", None) is not None and layer.input_qdq.dynamic:
                note = "XNNPACK quantizes each row's activations itself at run time (asymmetric per token)"
            rows.append(LayerCensus(name, kind, scheme, "XNNPACK", note))
        else:  # (refused twice: its float form is not delegated either)
            rows.append(LayerCensus(name, kind, scheme, "ExecuTorch portable kernels", lowered.refused.get(name, "")))
    return rows


# -- the entry point ---------------------------------------------------------------------------------------
@torch.no_grad()
def export_pte(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike | None = None,
    *,
    calibration_data: Iterable | None = None,
    validation_data: Iterable | None = None,
    labels: Tensor | Sequence[int] | None = None,
    max_batch: int = 64,
    low_precision_type: Any = None,
    fp32_baseline: bool = True,
    latency_batches: Sequence[int] = (1, 32),
    latency_repeats: int = 30,
    int8_model_outputs: bool = False,
    **autocast_options: Any,
) -> PteResult:
    """Export `model` (never modified) as an ExecuTorch program lowered with XNNPACK (module docstring).

    example_inputs: forward()'s positional inputs (batch dim dynamic, 1..max_batch). calibration_data: batches
    (input tuples or (inputs, labels)) for the output grids of static layers that feed float ops and for autocast's
    data_max; default the examples. validation_data: batches the .pte is compared on (default calibration_data).
    low_precision_type: None keeps every float op fp32; torch.bfloat16 / torch.float16 applies intqat's autocast
    rules (autocast_options: intqat.autocast.convert's keywords). XNNPACK takes fp32 and fp16; bf16 ops run in
    ExecuTorch's portable kernels (named in the report). path: write the .pte there (atomically); None: only
    the result (result.save(path) later). fp32_baseline: also lower the model with every layer float and compare
    size and latency (one XNNPACK thread, CPU time, median of latency_repeats) at latency_batches.
    int8_model_outputs: a static layer whose output is the model's output is requantized to int8 too, XNNPACK's
    static form (default: its weight is stored dequantized and XNNPACK runs it as an fp32 GEMM on its quantized
    input, so the logits are the integer model's to float rounding; int8 logits can swap a near tie).
    """
    from intqat._version import __version__

    require("pte")
    from importlib.metadata import version

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    args = _args(example_inputs)
    if isinstance(args[0], Tensor) and args[0].dim() and args[0].shape[0] > max_batch:
        raise ValueError(f"the example's batch {args[0].shape[0]} exceeds max_batch={max_batch}")
    calibration = [_inputs_of(b, len(args))[0] for b in calibration_data] if calibration_data is not None else []
    if not calibration:
        calibration = [args]
    calibration = [part for b in calibration for part in chunks(b, max_batch)]
    validation = list(validation_data) if validation_data is not None else [b for b in calibration]
    autocast = None if low_precision_type is None else {"low_precision_type": low_precision_type, **autocast_options}
    if autocast is None and autocast_options:
        raise ValueError(f"autocast options {sorted(autocast_options)} need low_precision_type (bf16 or fp16)")

    from intqat.deploy.qdq import _integer_copy  # the integer model the .pte is measured against

    reference = _integer_copy(model).eval()
    census_of = to_qdq(model)
    # static layers whose output is the model's output: the fp32 logits of the integer model, not int8 ones
    static = any(getattr(m, "input_qdq", None) is not None and not m.input_qdq.dynamic
                 for m in qdq_layers(census_of).values())
    fp32w = model_output_layers(_export(census_of, args, max_batch), qdq_layers(census_of)) \
        if static and not int8_model_outputs else []
    early = _xnnpack_cannot(census_of)  # what XNNPACK's serializer would assert on rather than refuse
    qdq = to_qdq(model, fp32_weights=fp32w, keep_float=early) if fp32w or early else census_of
    lowered, grids, autocast_report = _lower(qdq, args, max_batch, calibration, autocast)
    kept = {**early, **lowered.refused}
    if lowered.refused:  # refused by XNNPACK: kept float, lowered again, so nothing quantized runs outside it unnamed
        qdq = to_qdq(model, keep_float=kept, fp32_weights=[n for n in fp32w if n not in kept])
        lowered, grids, autocast_report = _lower(qdq, args, max_batch, calibration, autocast)
    buffer = _buffer(lowered)
    census = _census(census_of, lowered, kept, grids, fp32w)

    try:  # a program XNNPACK's runtime refuses fails here, before anything is written
        method = load_pte(buffer)
        validation_figures = _validate(method, reference, validation, len(args), max_batch, labels, grids, qdq)
    except RuntimeError as e:
        raise ValueError(f"the lowered program does not run in ExecuTorch's runtime ({e}; its log above names the "
                         "XNNPACK node); nothing was written") from None
    result = PteResult(buffer=buffer, census=census, validation=validation_figures)
    notes = []
    if autocast_report is not None:
        counts = autocast_report.counts()
        if autocast["low_precision_type"] in (torch.bfloat16, "bf16", "bfloat16") and counts.get("bf16"):
            notes.append(f"{counts['bf16']} float ops are bf16 by intqat's autocast rules; XNNPACK delegates fp32 and "
                         "fp16 only, so they run in ExecuTorch's portable kernels (low_precision_type=fp16 keeps them "
                         "in XNNPACK)")
    result.info = {
        "model": type(model).__name__, "max_batch": max_batch,
        "inputs": [f"{tuple(a.shape)} {a.dtype}" if isinstance(a, Tensor) else repr(a) for a in args],
        "float_regions": "fp32" if autocast is None else str(autocast["low_precision_type"]),
        "autocast_nodes": None if autocast_report is None else autocast_report.counts(),
        "float_ops_outside_xnnpack": dict(lowered.float_ops_outside), "notes": notes,
        "delegate_calls": lowered.delegate_calls, "graph_rewrites": dict(lowered.rewrites),
        "executorch": version("executorch"), "torch": torch.__version__, "intqat": __version__,
        "tested_with": TESTED,
    }
    if fp32_baseline:
        float_qdq = to_qdq(model, keep_float=list(qdq_layers(to_qdq(model))))
        fp32_lowered, _, _ = _lower(float_qdq, args, max_batch, calibration, None)
        fp32_buffer = _buffer(fp32_lowered)
        result.size = {"int8_bytes": len(buffer), "fp32_bytes": len(fp32_buffer),
                       "ratio": len(buffer) / len(fp32_buffer),
                       "int8_parts": pte_parts(buffer), "fp32_parts": pte_parts(fp32_buffer)}
        result.latency = measure_latency(buffer, fp32_buffer, args, latency_batches, latency_repeats, max_batch)
    if path is not None:
        result.save(path)
    return result


def _validate(method, reference: nn.Module, batches: list, n_args: int, max_batch: int, labels, grids, qdq) -> dict:
    max_diff, abs_sum, n, ref_amax, samples = 0.0, 0.0, 0, 0.0, 0
    preds, preds_ref, batch_labels = [], [], []
    nll, nll_ref, n_tokens, sequences = 0.0, 0.0, 0, False
    for item in batches:
        args, y = _inputs_of(item, n_args)
        got = run_pte(method, args, max_batch)
        want = _float_leaves(reference(*args))
        if len(got) != len(want):
            raise ValueError(f"the .pte returns {len(got)} tensors, the integer model {len(want)}")
        for g, w in zip(got, want):
            d = (g.double() - w.double()).abs()
            if d.numel():
                max_diff = max(max_diff, float(d.max()))
                ref_amax = max(ref_amax, float(w.abs().max()))
            abs_sum, n = abs_sum + float(d.sum()), n + d.numel()
        preds.append(got[0].argmax(-1).reshape(-1))
        preds_ref.append(want[0].argmax(-1).reshape(-1))
        if y is not None:
            y = torch.as_tensor(y)
            batch_labels.append(y.reshape(-1))
            if not y.is_floating_point() and got[0].dim() == y.dim() + 1 and got[0].shape[:-1] == y.shape:
                sequences = y.dim() > 1
                # cross-entropy of both on the labels: a language model's perplexity, a classifier's loss
                ce = torch.nn.functional.cross_entropy
                nll += float(ce(got[0].reshape(-1, got[0].shape[-1]).double(), y.reshape(-1), reduction="sum"))
                nll_ref += float(ce(want[0].reshape(-1, want[0].shape[-1]).double(), y.reshape(-1), reduction="sum"))
                n_tokens += y.numel()
        samples += got[0].shape[0]
    if not preds:
        raise ValueError("the validation data yielded no batch")
    pred, pred_ref = torch.cat(preds), torch.cat(preds_ref)
    out = {"batches": len(batches), "samples": samples, "top1_agreement": float((pred == pred_ref).float().mean()),
           "max_abs_diff": max_diff, "mean_abs_diff": abs_sum / max(n, 1), "reference_max_abs": ref_amax}
    # the error in steps of the output's int8 grid: the requantized output's own grid when the last layer is a
    # static one writing int8 for XNNPACK, else the step of a symmetric int8 grid over the output's range
    names = list(qdq_layers(qdq))
    grid = next((g for g in grids if names and g.layer == names[-1] and g.scale is not None and not g.exact), None)
    step = grid.scale if grid is not None else (ref_amax / 127 if ref_amax else 1.0)
    out["output_step"] = step
    out["output_step_is"] = (f"the int8 grid of the last layer's requantized output ({names[-1]})" if grid is not None
                             else "max |output| / 127: one step of a symmetric int8 grid over the output's range")
    out["max_diff_in_steps"] = max_diff / step
    if n_tokens:
        import math

        out["cross_entropy"], out["cross_entropy_integer"] = nll / n_tokens, nll_ref / n_tokens
        if sequences:  # next-token labels per position: a language model
            out["perplexity"], out["perplexity_integer"] = math.exp(nll / n_tokens), math.exp(nll_ref / n_tokens)
            out["perplexity_change"] = out["perplexity"] / out["perplexity_integer"] - 1
    if labels is None and batch_labels:
        labels = torch.cat(batch_labels)
    if labels is not None:
        labels = torch.as_tensor(labels).reshape(-1)
        if labels.numel() != pred.numel():
            raise ValueError(f"labels has {labels.numel()} entries but the validation batches hold {pred.numel()} "
                             "predictions; give one label per sample, in batch order")
        out["accuracy"] = float((pred == labels).float().mean())
        out["accuracy_integer"] = float((pred_ref == labels).float().mean())
    return out
