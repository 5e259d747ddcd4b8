"""export_mixed_precision: an intqat model -> one portable torch.export program, its autocast
report and the error it costs, saved as model.pt2 + report.json + report.md.

.. code-block:: python

    result = intqat.export_mixed_precision(model, (x[:2],), calibration_data=val_batches)
    print(result.validation["max_abs_error"], result.report.counts())
    result.save("runs/mlp/export")  # model.pt2, report.json, report.md, all or nothing

Pipeline (the user's model is never touched: everything runs on a copy):
  copy -> fake-quant modules to integer -> to_deployed (int8 weight buffers) -> eval
  -> torch.export (batch dimension dynamic) -> tidy (exact clean-up and constant folding)
  = the reference program: integer layers int8, every float op fp32
  -> intqat.autocast.convert = the mixed-precision program
  -> validation: the mixed program against the reference on the validation batches.

Integer layers become aten._int_mm and elementwise aten ops: model.pt2 loads with
torch.export.load and runs without intqat installed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
from torch.utils._pytree import tree_leaves

__all__ = [
    "ExportResult", "export_mixed_precision", "tidy_program", "write_program", "export_fn_for_callback",
    "MODEL_FILE", "REPORT_JSON", "REPORT_MD", "OUTPUT_FILES", "AOTI_FILE", "compile_aoti",
]

MODEL_FILE, REPORT_JSON, REPORT_MD = "model.pt2", "report.json", "report.md"
OUTPUT_FILES = (MODEL_FILE, REPORT_JSON, REPORT_MD)
# Optional: the same program compiled ahead of time by AOTInductor for this machine's CPU. Loads
# with torch._inductor.aoti_load_package (no intqat needed either) and skips the Python
# interpreter of the graph: per-call overhead is what dominates small models.
AOTI_FILE = "model.aoti.pt2"
# Provenance only (source lines, pass history): a quarter of a small program's file, and nothing
# torch.export.load or the graph needs. nn_module_stack stays: it names the layer of each node.
DEBUG_META = ("stack_trace", "from_node", "torch_fn", "source_fn_stack")

aten = torch.ops.aten


# -- tidy: exact clean-up of the exported graph ----------------------------------------------------
def _same_shape(a: Tensor, b: Tensor) -> bool:
    # str() compares symbolic sizes without adding guards to the shape environment
    return len(a.shape) == len(b.shape) and all(str(x) == str(y) for x, y in zip(a.shape, b.shape))


def _is_noop(node: torch.fx.Node) -> bool:
    """A node whose output is its first input, bit for bit (in a functional graph)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    if any(u.op == "output" for u in node.users):
        return False  # keeps output names (and the output specs) as export made them
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, Tensor) or not isinstance(out, Tensor):
        return False
    if node.target in (aten.detach.default, aten.alias.default, aten.clone.default):
        return node.target is not aten.clone.default or not node.kwargs
    if node.target is aten._to_copy.default:
        same = src.dtype == out.dtype and src.device == out.device and src.layout == out.layout
        return same and set(node.kwargs) <= {"dtype", "device", "layout"}
    if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return _same_shape(src, out)
    return False


def tidy_program(program: ExportedProgram) -> ExportedProgram:
    """Functionalize (no in-place ops), drop what computes nothing (metadata asserts, detach,
    same-dtype casts, same-shape views) and fold what depends on stored tensors only. Exact:
    the same bits, with ~70% fewer nodes for an integer MLP (124 -> 38); each node costs a
    Python dispatch per call and ~1 KB of JSON in model.pt2."""
    from intqat.autocast.program import rebuild

    with warnings.catch_warnings():
        # torch 2.13's own TreeSpec deepcopy path warns about its deprecated LeafSpec
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        program = program.run_decompositions({})  # {}: functionalize only, keep aten.linear & co.
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.view.default:
            # export turns a model's `reshape` into `view` for the layouts it traced, but a kernel may return
            # another layout at run time (T5's scaled_dot_product_attention with a mask: `transpose(1, 2)` then
            # the view failed in the exported program), and autocast's low precision changes layouts too.
            # reshape is that view where it fits, a copy where not: the same values either way.
            node.target = aten.reshape.default
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
        elif _is_noop(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()
    state_dict, constants = _fold_constants(program, graph)
    graph = _renamed_copy(program, graph)
    graph.lint()
    return rebuild(program, graph, state_dict, constants)


_LAYOUT_OPS = (aten.t.default, aten.permute.default, aten.transpose.int)  # keep weights as stored


def _folded_name(node: torch.fx.Node) -> str:
    """c_<layer>_<op>, e.g. c_features_1_reciprocal: names the layer the constant belongs to."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    layer = stack[-1][0] if stack else ""
    op = node.target._schema.name.split("::")[-1].strip("_") if hasattr(node.target, "_schema") else node.name
    raw = f"c_{layer}_{op}" if layer else f"c_{op}"
    return "".join(ch if ch.isalnum() else "_" for ch in raw)


def _fold_constants(program: ExportedProgram, graph: torch.fx.Graph) -> tuple[dict, dict]:
    """Compute once what depends on stored tensors only (zero point x column sums, s_x * s_w,
    1 / s_x, ...): each folded value becomes a constant input, each folded node leaves the
    per-call graph. Exact: the same aten kernels on the same values, run now instead of per call.
    Returns the new (state_dict, constants); graph and input specs are edited in place."""
    sig = program.graph_signature
    state_dict, constants = dict(program.state_dict), dict(program.constants)
    mutated = set(sig.buffers_to_mutate.values()) | set(getattr(sig, "parameters_to_mutate", {}).values())
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    stored = {InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR}
    values: dict[torch.fx.Node, Tensor] = {}
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in stored and spec.target not in mutated:
            t = state_dict.get(spec.target, constants.get(spec.target))
            if isinstance(t, Tensor):
                values[node] = t.detach()
    folded = []
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target in _LAYOUT_OPS:
            continue
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            continue
        inputs = node.all_input_nodes
        if not inputs or not all(i in values for i in inputs):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
        with torch.no_grad():
            out = target(*args, **kwargs)
        # never trade a small stored tensor for a large one (an expand or repeat of a param)
        if isinstance(out, Tensor) and out.numel() <= max(values[i].numel() for i in inputs):
            values[node] = out
            folded.append(node)
    first_input = next((n for n, s in zip(placeholders, sig.input_specs) if s.kind == InputKind.USER_INPUT), None)
    folded_set = set(folded)
    taken = {n.name for n in graph.nodes}
    new_specs = []
    for node in folded:
        if all(u in folded_set for u in node.users):
            continue  # used only by other folded nodes
        name = base = _folded_name(node)
        for i in itertools.count(1):
            if name not in taken:
                break
            name = f"{base}_{i}"
        taken.add(name)
        with graph.inserting_before(first_input):
            ph = graph.placeholder(name)
        ph.meta.update({k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")})
        node.replace_all_uses_with(ph)
        constants[ph.name] = values[node].clone(memory_format=torch.contiguous_format)
        new_specs.append(InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name=ph.name), target=ph.name))
    for node in reversed(folded):
        if not node.users:
            graph.erase_node(node)
    # Stored tensors nobody reads any more leave the program (and model.pt2).
    kept = []
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in stored and not node.users:
            graph.erase_node(node)
            (state_dict if spec.target in state_dict else constants).pop(spec.target, None)
        else:
            kept.append(spec)
    user = [i for i, s in enumerate(kept) if s.kind == InputKind.USER_INPUT]
    at = user[0] if user else len(kept)
    sig.input_specs[:] = kept[:at] + new_specs + kept[at:]  # the placeholders' order
    return state_dict, constants


def _renamed_copy(program: ExportedProgram, graph: torch.fx.Graph) -> torch.fx.Graph:
    """The graph copied into a fresh fx.Graph, input specs renamed to match.

    A fresh graph renames placeholders that shadow Python builtins (nn.Sequential's `input`
    becomes `input_1`). intqat.autocast copies the graph that way but keeps the old input
    specs, which the verifier rejects; copying here first makes its copy keep every name.
    """
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda a: env[a])
    placeholders = [n for n in new.nodes if n.op == "placeholder"]
    for spec, node in zip(program.graph_signature.input_specs, placeholders):
        if getattr(spec.arg, "name", node.name) != node.name:
            spec.arg = dataclasses.replace(spec.arg, name=node.name)
    return new


# -- inputs and validation batches ------------------------------------------------------------------
def _as_args(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and example_inputs:
        # Own, compact copies: the program stores its example inputs, and a slice x[:2] would
        # drag the whole storage of x into model.pt2.
        return tuple(a.detach().clone() if isinstance(a, Tensor) else a for a in example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a tuple of forward()'s positional inputs, got "
        f"{type(example_inputs).__name__}; e.g. export_mixed_precision(model, (x[:2],))"
    )


def _split_item(item: Any, n_args: int, index: int) -> tuple[tuple, Tensor | None]:
    """One batch as (inputs, labels or None): a tensor, a tuple of inputs, or (inputs..., labels)."""
    if isinstance(item, Tensor):
        return (item,), None
    if isinstance(item, (tuple, list)):
        if len(item) == n_args:
            return tuple(item), None
        if len(item) == n_args + 1:
            return tuple(item[:n_args]), item[n_args]
    raise TypeError(
        f"batch {index}: expected a tensor, a tuple of {n_args} input(s) or (inputs..., labels) "
        f"as a DataLoader yields, got {type(item).__name__}"
        + (f" of length {len(item)}" if isinstance(item, (tuple, list)) else "")
    )


def _float_leaves(out: Any) -> list[Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]


def _logits(out: Any) -> Tensor:
    leaves = _float_leaves(out)
    if not leaves:
        raise ValueError("the model returns no floating-point tensor: there are no logits to score")
    return leaves[0]


@torch.no_grad()
def validate(
    program: ExportedProgram,
    reference: ExportedProgram,
    batches: Iterable,
    n_args: int,
    labels: Tensor | Sequence[int] | None = None,
    eager: nn.Module | None = None,
) -> dict[str, Any]:
    """Error of `program` against `reference` over `batches`; top-1 accuracy of both when labels
    are known (the `labels` argument, aligned with the batches concatenated, or per batch).

    With `eager` (the deployed integer model): whether `reference` equals it (reference_equals_integer_model,
    its backends as the table picks them), and whether it equals the definition (integer_program_exact: the
    eager model on the reference backend, whose integer GEMMs are exact int64 sums sharing no kernel with
    aten._int_mm). The program runs aten._int_mm of this process's torch: where that is wrong
    (int_mm_self_check says why, e.g. ONEDNN_MAX_CPU_ISA=AVX2), the program is not exact here."""
    from intqat.ops import backends, check_int_mm

    run, run_ref = program.module(), reference.module()
    max_err, abs_sum, n_elems, ref_amax, samples, n_batches = 0.0, 0.0, 0, 0.0, 0, 0
    eager_exact = definition_exact = True
    preds, preds_ref, batch_labels = [], [], []
    for i, item in enumerate(batches):
        args, y = _split_item(item, n_args, i)
        out, ref = run(*args), run_ref(*args)
        if eager is not None:
            eager_exact &= all(torch.equal(a, b) for a, b in zip(_float_leaves(eager(*args)), _float_leaves(ref)))
            with backends.use_backend("reference"):
                definition = eager(*args)
            definition_exact &= all(torch.equal(a, b) for a, b in zip(_float_leaves(definition), _float_leaves(ref)))
        for o, r in zip(_float_leaves(out), _float_leaves(ref)):
            diff = (o.to(torch.float64) - r.to(torch.float64)).abs()
            if diff.numel():
                max_err = max(max_err, float(diff.max()))
                ref_amax = max(ref_amax, float(r.abs().max()))
            abs_sum += float(diff.sum())
            n_elems += diff.numel()
        logits, logits_ref = _logits(out), _logits(ref)
        preds.append(logits.argmax(-1).reshape(-1))
        preds_ref.append(logits_ref.argmax(-1).reshape(-1))
        if y is not None:
            batch_labels.append(torch.as_tensor(y).reshape(-1))
        samples += logits.shape[0] if logits.dim() else 1
        n_batches += 1
    if n_batches == 0:
        raise ValueError("the validation data yielded no batch")
    pred, pred_ref = torch.cat(preds), torch.cat(preds_ref)
    result: dict[str, Any] = {
        "reference": "the same program before autocast: integer layers int8, every float op fp32",
        "batches": n_batches,
        "samples": samples,
        "max_abs_error": max_err,
        "mean_abs_error": abs_sum / max(n_elems, 1),
        "reference_max_abs": ref_amax,  # the scale the errors are relative to
        "top1_agreement": float((pred == pred_ref).float().mean()),
    }
    if eager is not None:
        result["reference_equals_integer_model"] = eager_exact
        result["integer_program_exact"] = definition_exact
        result["int_mm_self_check"] = check_int_mm() or "exact"
        if not definition_exact:
            warnings.warn(
                "intqat export: the exported integer program, run by this torch, differs from the integer model's "
                f"exact sums (aten._int_mm here: {result['int_mm_self_check']}). The program is what it should be; "
                "the torch that runs it must pass intqat.ops.check_int_mm().", RuntimeWarning, stacklevel=3)
    if labels is None and batch_labels:
        labels = torch.cat(batch_labels)
    if labels is not None:
        labels = torch.as_tensor(labels).reshape(-1).to(pred.device)
        if labels.numel() != pred.numel():
            raise ValueError(
                f"labels has {labels.numel()} entries but the validation batches hold {pred.numel()} "
                "samples; give one label per sample, in batch order"
            )
        acc, acc_ref = float((pred == labels).float().mean()), float((pred_ref == labels).float().mean())
        result.update(accuracy=acc, accuracy_reference=acc_ref, accuracy_delta_points=100.0 * (acc - acc_ref))
    return result


# -- the result and its atomic save -----------------------------------------------------------------
@contextlib.contextmanager
def _without_debug_meta(program: ExportedProgram) -> Iterator[None]:
    saved = []
    for module in program.graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                popped = {k: node.meta.pop(k) for k in DEBUG_META if k in node.meta}
                saved.append((node, popped))
    try:
        yield
    finally:
        for node, popped in saved:
            node.meta.update(popped)


def _deflate(src: Path, dst: Path) -> None:
    """Repack a .pt2 archive with deflate: the graph JSON shrinks ~10x; torch.export.load reads it."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            # a fresh header: torch's 64-byte alignment padding only serves mmap of stored records
            fresh = zipfile.ZipInfo(info.filename, date_time=info.date_time)
            zout.writestr(fresh, zin.read(info.filename), compress_type=zipfile.ZIP_DEFLATED)


def write_program(program: ExportedProgram, path: str | os.PathLike, *, compress: bool = True) -> int:
    """torch.export.save without the debug metadata (DEBUG_META), deflate-packed if `compress`;
    returns the file's bytes. Not atomic by itself: ExportResult.save writes it in a temp dir."""
    path = Path(path)
    raw = path.with_name(path.stem + ".uncompressed.pt2") if compress else path
    try:
        with _without_debug_meta(program):
            torch.export.save(program, raw)
        if compress:
            _deflate(raw, path)
    finally:
        if compress and raw.exists():
            raw.unlink()
    return path.stat().st_size


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@dataclass
class ExportResult:
    """program: the mixed-precision ExportedProgram; report: the autocast decisions;
    validation: error figures (and accuracy); reference: the program before autocast."""

    program: ExportedProgram
    report: Any  # intqat.autocast.AutocastReport
    validation: dict[str, Any]
    reference: ExportedProgram
    info: dict[str, Any] = field(default_factory=dict)  # inputs, versions, stages: goes into report.json
    check_inputs: tuple = ()  # one validation batch's inputs: what an AOTInductor package is checked on

    def to_dict(self) -> dict[str, Any]:
        return {"export": self.info, "validation": self.validation, "autocast": self.report.to_dict()}

    def to_markdown(self, files: dict[str, Any] | None = None) -> str:
        v, info = self.validation, self.info
        lines = [f"# intqat export: {info.get('model', 'model')}", ""]
        if info.get("source"):
            lines += [f"Source: {info['source']}", ""]
        lines += ["## Error of the mixed-precision program", "",
                  f"Against {v['reference']}, on {v['samples']} samples ({v['batches']} batches).", "",
                  "| figure | value |", "|---|---|"]
        keys = ("max_abs_error", "mean_abs_error", "reference_max_abs", "top1_agreement", "accuracy",
                "accuracy_reference", "accuracy_delta_points", "reference_equals_integer_model", "integer_program_exact",
                "int_mm_self_check")
        lines += [f"| {k} | {_fmt(v[k])} |" for k in keys if k in v]
        if v.get("integer_program_exact") is False:
            lines += ["", "**The integer program is not exact on this machine**: run here, it differs from the definition "
                      "(the integer model's exact int64 sums). aten._int_mm of this torch: "
                      f"{v.get('int_mm_self_check')}. Check the torch that will run model.pt2 with "
                      "intqat.ops.check_int_mm() (docs/backends.md)."]
        counts = ", ".join(f"{n} {p}" for p, n in sorted(self.report.counts().items()))
        lines += ["", "## Program", "",
                  f"- low precision type: {self.report.low_precision_type}; nodes: {counts}",
                  f"- casts inserted: {self.report.casts_inserted}; params stored low: {len(self.report.cast_params)}",
                  f"- stored tensor bytes: {self.report.stored_bytes_before} before autocast, "
                  f"{self.report.stored_bytes_after} after",
                  f"- inputs: {info.get('inputs')}, batch dimension {'dynamic' if info.get('dynamic_batch') else 'static'}",
                  f"- torch {info.get('torch')}, intqat {info.get('intqat')}"]
        if files:
            lines += [f"- {name}: {meta['bytes']} bytes, sha256 {meta['sha256']}" for name, meta in files.items()]
        lines += ["", "## Nodes", "", "Precision and the rule that chose it (intqat.autocast.RULES), in graph order.", "",
                  self.report.to_markdown(), ""]
        return "\n".join(lines)

    def save(self, out_dir: str | os.PathLike, *, compress: bool = True, aoti: bool = False) -> dict[str, Path]:
        """Write model.pt2 (torch.export.save; `compress`: deflate-packed, still loaded by
        torch.export.load), report.json and report.md into out_dir, all or nothing; with `aoti`
        also model.aoti.pt2 (`compile_aoti`: checked equal to the program before it is kept).

        Everything is written into a temporary directory next to out_dir, then moved in with
        os.replace: a failure part way leaves out_dir as it was and no temporary files behind.
        """
        out = Path(out_dir)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"export output {out} exists and is not a directory")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            model_path = tmp / MODEL_FILE
            write_program(self.program, model_path, compress=compress)
            files = {MODEL_FILE: {"bytes": model_path.stat().st_size, "sha256": _sha256(model_path),
                                  "compressed": compress}}
            names = OUTPUT_FILES
            if aoti:
                check = compile_aoti(self.program, tmp / AOTI_FILE, self.check_inputs)
                files[AOTI_FILE] = {"bytes": (tmp / AOTI_FILE).stat().st_size, "sha256": _sha256(tmp / AOTI_FILE),
                                    **check}
                names = (*OUTPUT_FILES, AOTI_FILE)
            (tmp / REPORT_JSON).write_text(json.dumps({**self.to_dict(), "files": files}, indent=2) + "\n")
            (tmp / REPORT_MD).write_text(self.to_markdown(files))
            for name in names:
                _fsync(tmp / name)
            if not out.exists():
                os.replace(tmp, out)  # one rename: the directory appears complete
                return {name: out / name for name in names}
            for name in names:  # each file replaced whole; report.json holds model.pt2's hash
                os.replace(tmp / name, out / name)
            return {name: out / name for name in names}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# -- AOTInductor --------------------------------------------------------------------------------------
AOTI_INT_MM = ("auto", "native", "fp32")


def compile_aoti(program: ExportedProgram, path: str | os.PathLike, check_inputs: tuple = (),
                 int_mm: str = "auto") -> dict[str, Any]:
    """Compile `program` with AOTInductor into the package `path` (this CPU's native code; ~15 s
    for the digits MLP here) and check it: on `check_inputs` its outputs must equal the program's
    (torch.equal), else ValueError and nothing is left at `path`. -> what was checked, for the report.

    int_mm: how the package runs aten._int_mm. "native": as is (oneDNN / the int8 units). "fp32":
    decomposed into exact fp32 GEMMs of K slices <= 1024 (`int_mm_via_fp32`, same bits): on a CPU
    without int8 dot products, where _int_mm is a scalar loop ~50x slower than an fp32 GEMM.
    "auto" (default): "fp32" exactly where this CPU has no int8 dot-product units (the package is
    this CPU's code anyway). The portable model.pt2 always keeps aten._int_mm.

    The integer steps stay exact, and the float epilogue is compiled without contracting multiply
    and add (the check holds the package to that)."""
    import torch._inductor

    from intqat.ops.backends.fp32_exact import int_mm_via_fp32
    from intqat.ops.cpu_features import cpu_has_int8_dot

    if int_mm not in AOTI_INT_MM:
        raise ValueError(f"compile_aoti: int_mm={int_mm!r}; choose one of {AOTI_INT_MM}")
    decompose = int_mm == "fp32" or (int_mm == "auto" and not cpu_has_int8_dot())
    path = Path(path)
    try:
        if decompose:
            program = program.run_decompositions({torch.ops.aten._int_mm.default: int_mm_via_fp32})
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        if not check_inputs:
            return {"checked_equal_on": None,
                    "int_mm": "exact fp32 GEMMs (no int8 dot-product units)" if decompose else "aten._int_mm"}
        runner = torch._inductor.aoti_load_package(str(path))
        with torch.no_grad():
            expected, got = program.module()(*check_inputs), runner(*check_inputs)
        pairs = list(zip(tree_leaves(expected), tree_leaves(got)))
        if not pairs or not all(torch.equal(a, b) for a, b in pairs):
            worst = max(float((a.float() - b.float()).abs().max()) for a, b in pairs) if pairs else float("nan")
            raise ValueError(f"AOTInductor package differs from the exported program (max |Δ| {worst:.3g}); not kept")
        return {"checked_equal_on": [f"{tuple(a.shape)} {a.dtype}" for a in check_inputs if isinstance(a, Tensor)],
                "int_mm": "exact fp32 GEMMs (no int8 dot-product units)" if decompose else "aten._int_mm"}
    except BaseException:
        path.unlink(missing_ok=True)
        raise


# -- the entry point ----------------------------------------------------------------------------------
def _integer_copy(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """A deployed copy of model: fake-quant modules become integer, integer ones deployed."""
    from intqat.convert import to_deployed, to_integer
    from intqat.nn import DeployedIntMultiheadAttention, FakeQuantMultiheadAttention
    from intqat.registry import DEPLOYED_TYPES, FAKE_QUANT_TYPES

    work = copy.deepcopy(model)
    n_fake = sum(isinstance(m, FAKE_QUANT_TYPES + (FakeQuantMultiheadAttention,)) for m in work.modules())
    if n_fake:
        to_integer(work)  # the learned scales carry over: what integer training would run
    deployed = to_deployed(work, inplace=True)
    # integer GEMM layers: DeployedIntLinear / Conv2d, including those inside a deployed attention
    n_dep = sum(isinstance(m, DEPLOYED_TYPES) for m in deployed.modules())
    n_attn = sum(isinstance(m, DeployedIntMultiheadAttention) for m in deployed.modules())
    return deployed, {"integer_layers": n_dep, "integer_attention": n_attn, "converted_from_fake_quant": n_fake}


def _dynamic_batch(module: nn.Module, args: tuple) -> tuple | dict:
    """dim 0 of every tensor input dynamic, in the structure torch.export wants for module.forward's signature:
    per positional argument, or by name with a tuple for a `*args` parameter (a wrapper's forward(*args))."""
    import inspect

    auto = torch.export.Dim.AUTO

    def spec(a):
        return {0: auto} if isinstance(a, Tensor) and a.dim() > 0 else None

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        params = ()
    var = next((p for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    if var is None:
        return tuple(spec(a) for a in args)
    bound = inspect.signature(module.forward).bind(*args).arguments
    return {name: tuple(spec(a) for a in value) if name == var.name else spec(value) for name, value in bound.items()}


def export_mixed_precision(
    model: nn.Module,
    example_inputs: Any,
    *,
    labels: Tensor | Sequence[int] | None = None,
    calibration_data: Iterable | None = None,
    validation_data: Iterable | None = None,
    dynamic_batch: bool = True,
    dynamic_shapes: Any = None,
    **autocast_options: Any,
) -> ExportResult:
    """Export `model` (never modified) as a mixed-precision program and measure what it costs.

    example_inputs: forward()'s positional inputs (a tensor or a tuple); a batch of >= 2 keeps
    the batch dimension dynamic. calibration_data: batches for autocast's data_max rule (a list
    of input tuples, or a DataLoader of (inputs, labels)); None skips data_max. validation_data:
    batches the errors (and accuracy) are measured on; default calibration_data, else the
    examples. labels: one per validation sample, in batch order (or let the batches carry them).
    dynamic_shapes: torch.export's, for dims beyond the batch, e.g. a sequence length:
    `({0: Dim.AUTO, 1: Dim.AUTO},)` (then dynamic_batch is not used); None: the batch only (dynamic_batch).
    autocast_options: intqat.autocast.convert's keywords (low_precision_type, data_max, ...).
    """
    from intqat._version import __version__
    from intqat.autocast import convert

    args = _as_args(example_inputs)
    if isinstance(calibration_data, Tensor) or isinstance(validation_data, Tensor):
        raise TypeError("calibration_data / validation_data must be lists of batches, not a Tensor; pass [(x,)]")
    calibration = list(calibration_data) if calibration_data is not None else None
    if validation_data is not None:
        validation_batches = list(validation_data)
    else:
        validation_batches = calibration if calibration is not None else [args]

    deployed, layers = _integer_copy(model)
    shapes = dynamic_shapes if dynamic_shapes is not None else _dynamic_batch(deployed, args) if dynamic_batch else None
    with torch.no_grad():
        exported = torch.export.export(deployed, args, dynamic_shapes=shapes)
    reference = tidy_program(exported)
    program, report = convert(reference, calibration_data=calibration, **autocast_options)
    validation = validate(program, reference, validation_batches, len(args), labels=labels, eager=deployed)

    nodes = lambda ep: sum(1 for n in ep.graph.nodes if n.op == "call_function")  # noqa: E731
    info = {
        "model": type(model).__name__,
        "inputs": [f"{tuple(a.shape)} {a.dtype}" if isinstance(a, Tensor) else repr(a) for a in args],
        "dynamic_batch": bool(program.range_constraints),
        "graph_nodes": {"exported": nodes(exported), "tidied": nodes(reference), "mixed": nodes(program)},
        **layers,
        "autocast_options": {k: str(v) for k, v in autocast_options.items()},
        "calibration_batches": None if calibration is None else len(calibration),
        "torch": torch.__version__,
        "intqat": __version__,
    }
    first = validation_batches[0] if validation_batches else args
    check_inputs = _split_item(first, len(args), 0)[0] if first is not args else args
    return ExportResult(program=program, report=report, validation=validation, reference=reference, info=info,
                        check_inputs=check_inputs)


# -- the IntQAT callback's export hook -------------------------------------------------------------
def export_fn_for_callback(
    pl_module: nn.Module,
    trainer: Any,
    export_dir: str | os.PathLike,
    *,
    calibration_batches: int = 4,
    validation_split: str = "test",
    aoti: bool = False,
    formats: Sequence[str] | str = ("pt2",),
    max_batch: int = 64,
    **autocast_options: Any,
) -> ExportResult | None:
    """IntQAT(export_fn=...) hook: export pl_module.model into export_dir at the end of fit.

    Calibrates on the first `calibration_batches` of the validation split and reports the error
    and accuracy on the whole `validation_split` ("test" or "val") of trainer.datamodule. Runs on
    global rank 0 only (returns None elsewhere). aoti: also write model.aoti.pt2 (see
    ExportResult.save). formats: what to write (intqat.deploy.formats: pt2, pte, onnx, onnx-int; a recipe's
    export.formats); the deploy ones go beside model.pt2 (max_batch: the .pte's largest batch); returns the pt2
    result, None without pt2. Bind options with functools.partial, or in a
    recipe: `export_fn: {_target_: intqat.export.export_fn_for_callback, _partial_: true}`.
    """
    from intqat.deploy.formats import check_formats, export_deploy_formats, parse_formats

    if not getattr(trainer, "is_global_zero", True):
        return None
    formats = parse_formats(formats)
    check_formats(formats)  # a missing package fails now, before anything is exported
    if validation_split not in ("test", "val"):
        raise ValueError(f"validation_split={validation_split!r}: use 'test' or 'val'")
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is None:
        raise ValueError("export_fn_for_callback needs trainer.datamodule (fit with datamodule=...)")
    datamodule.setup("test" if validation_split == "test" else "validate")
    model = copy.deepcopy(getattr(pl_module, "model", pl_module)).cpu()  # the program is for the CPU
    cpu = lambda b: tuple(t.cpu() if isinstance(t, Tensor) else t for t in b)  # noqa: E731
    calibration = [cpu(b) for b in itertools.islice(datamodule.val_dataloader(), calibration_batches)]
    loader = datamodule.test_dataloader() if validation_split == "test" else datamodule.val_dataloader()
    validation = [cpu(b) for b in loader]
    example = calibration[0][0][:2]
    source = f"end of fit, epoch {getattr(trainer, 'current_epoch', '?')}, step {getattr(trainer, 'global_step', '?')}"
    result = None
    if "pt2" in formats:
        result = export_mixed_precision(model, (example,), calibration_data=calibration,
                                        validation_data=validation, **autocast_options)
        result.info["source"] = source
        result.info["validation_split"] = validation_split
    deploy = [f for f in formats if f != "pt2"]
    if deploy:  # the float regions under the same autocast rules as model.pt2 (bf16 unless the options say)
        options = {"low_precision_type": torch.bfloat16, **autocast_options}
        export_deploy_formats(model, (example,), export_dir, deploy, calibration_data=calibration,
                              validation_data=validation, max_batch=max_batch,
                              info={"source": source, "validation_split": validation_split}, **options)
    if result is not None:
        result.save(export_dir, aoti=aoti)
    return result
