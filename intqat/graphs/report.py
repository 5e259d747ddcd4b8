"""Writing an intqat-graphs run: one directory per distinct graph, index.json / index.tsv, the text report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from intqat.graphs.options import MODEL_KEY
from intqat.graphs.stages import StageReport

__all__ = ["write_graphs", "stage_text", "validation_table", "INDEX_JSON", "INDEX_TSV", "REPORT"]

INDEX_JSON, INDEX_TSV, REPORT = "index.json", "index.tsv", "report.txt"


def _clear_previous(out: Path) -> None:
    """Remove the hash directories a previous run wrote here (listed in its index.json), nothing else."""
    index = out / INDEX_JSON
    if not index.is_file():
        return
    try:
        previous = json.loads(index.read_text()).get("graphs", {})
    except (json.JSONDecodeError, AttributeError):
        return
    for dirname in previous:
        d = out / dirname
        if d.is_dir() and (d / "graph_hash.txt").is_file():
            shutil.rmtree(d)


def write_graphs(reports: list[StageReport], out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Dedupe every capture by hash, save one directory per graph, write index.json / index.tsv."""
    from intqat.graphs import dedupe, save_groups

    captures: dict[str, Any] = {}
    for rep in reports:
        if rep.capture is not None:
            captures[f"{rep.stage}/{MODEL_KEY}"] = rep.capture
        for fqn, cap in rep.layers.items():
            captures[f"{rep.stage}/{fqn}"] = cap
    out.mkdir(parents=True, exist_ok=True)
    _clear_previous(out)
    groups = dedupe(captures)
    save_groups(groups, out)
    dir_of = {name: g.dirname for g in groups for name in g.names}

    tsv = ["stage\tlayer\tmodule\thash_dir"]
    stages: dict[str, Any] = {}
    for rep in reports:
        entry: dict[str, Any] = {
            "model_type": rep.model_type,
            "model": dir_of.get(f"{rep.stage}/{MODEL_KEY}"),
            "layers": {fqn: dir_of[f"{rep.stage}/{fqn}"] for fqn in rep.layers},
            "layer_types": rep.layer_types,
            "error": rep.error,
            "layer_errors": rep.layer_errors,
            "graph_breaks": rep.breaks,
        }
        if rep.capture is not None:
            s = rep.capture.summary
            entry["summary"] = {
                "regions": s.regions, "forward_nodes": s.forward_nodes, "backward_nodes": s.backward_nodes,
                "integer_ops": len(s.integer_ops), "ste_kernels": len(s.ste_kernels),
                "integer_grads": s.integer_grads, "saved_bytes": s.saved_bytes, "activation_bytes": s.activation_bytes,
            }
            tsv.append(f"{rep.stage}\t{MODEL_KEY}\t{rep.model_type}\t{entry['model']}")
        for fqn in rep.layers:
            tsv.append(f"{rep.stage}\t{fqn}\t{rep.layer_types[fqn]}\t{entry['layers'][fqn]}")
        v = rep.validation
        if v is not None:
            entry["validation"] = {
                "passed": v.passed, "status": v.status, "backend": v.backend, "rtol": v.rtol, "atol": v.atol,
                "trial_status": v.trial_status, "errors": v.errors,
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "max_abs": t.max_abs,
                             "max_rel": t.max_rel, "eager_fluctuation": t.eager_fluctuation, "status": t.status}
                            for t in v.tensors],
                "referee": None if rep.referee is None else {
                    "cleared": rep.referee.cleared, "error": rep.referee.error,
                    "rows": [r.__dict__ for r in rep.referee.rows]},
                "stage_passed": rep.validated,
            }
        entry["ok"] = rep.ok
        entry["problems"] = rep.problems
        stages[rep.stage] = entry
    index = {
        **meta,
        "captured_graphs": len(captures),
        "distinct_graphs": len(groups),
        "stages": stages,
        "graphs": {g.dirname: g.names for g in groups},
    }
    (out / INDEX_JSON).write_text(json.dumps(index, indent=1, default=str) + "\n")
    (out / INDEX_TSV).write_text("\n".join(tsv) + "\n")
    return index


def _fmt_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB"


def stage_text(rep: StageReport, dir_of: dict[str, str], verbose: bool) -> str:
    lines = [f"== stage {rep.stage} ({rep.model_type}) " + "=" * max(0, 60 - len(rep.stage) - len(rep.model_type))]
    if rep.capture is None:
        lines.append(f"extraction FAILED: {rep.error}")
    else:
        s = rep.capture.summary
        text = s.to_text().splitlines()
        lines.append(f"graph {dir_of.get(f'{rep.stage}/{MODEL_KEY}')}  " + text[0])
        lines.append(f"integer ops: {len(s.integer_ops)} (forward {sum(o.graph == 'forward' for o in s.integer_ops)}, "
                     f"backward {sum(o.graph == 'backward' for o in s.integer_ops)}); "
                     f"STE kernels in backward: {len(s.ste_kernels)}; "
                     f"integer tensors requiring grad: {', '.join(s.integer_grads) or 'none'}")
        lines.append(f"saved for backward: {len(s.saved)} tensors, {_fmt_bytes(s.saved_bytes)} "
                     f"({_fmt_bytes(s.activation_bytes)} activations)")
        if verbose:
            lines += text[4:]
    if rep.breaks:
        lines.append(f"graph breaks ({len(rep.capture.regions) - 1}):")
        lines += [f"  {b}" for b in rep.breaks]
    if rep.layers or rep.layer_errors:
        rows = [("layer", "module", "graph", "int ops", "STE", "saved")]
        for fqn, cap in rep.layers.items():
            s = cap.summary
            regions = f" ({s.regions} regions)" if s.regions > 1 else ""
            rows.append((fqn, rep.layer_types[fqn], dir_of[f"{rep.stage}/{fqn}"] + regions, str(len(s.integer_ops)),
                         str(len(s.ste_kernels)), _fmt_bytes(s.saved_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip())
        lines += [f"  {fqn}: extraction FAILED: {err}" for fqn, err in rep.layer_errors.items()]
    if rep.validation is not None:
        v = rep.validation
        lines.append(f"validation: one train step, eager vs torch.compile ({v.backend}); output, loss, every grad "
                     "and buffer (a fresh copy of the model per run):")
        lines.append(validation_table(v, verbose))
        if rep.referee is not None:
            lines.append(rep.referee.to_table())
            lines.append(f"stage verdict: {'PASSED' if rep.validated else 'FAILED'} "
                         + ("(every failed tensor is fp32 rounding, as accurate as eager's: not the compiler)" if rep.validated
                            else "(the compiled step computes something else than eager)"))
    return "\n".join(lines)


def validation_table(v, verbose: bool = False) -> str:
    """ValidationResult.to_table(); unless verbose, buffers equal to eager's bit for bit in every
    trial are folded into one line (a fake-quant model has a dozen per layer, all exact)."""
    table = v.to_table().splitlines()
    if verbose:
        return "\n".join(table)
    exact = {t.name for t in v.tensors if t.name.startswith("buffer.") and t.status == "pass" and t.max_abs == 0.0}
    kept = [line for line in table if line.split(" ", 1)[0] not in exact]
    if exact:
        kept.append(f"{'buffer.* (' + str(len(exact)) + ' tensors)':<36} {'':<9} {'':<16} {0.0:>10.3e} {0.0:>10.3e} "
                    f"{'':>11}  pass (bit-identical; verbose=true lists them)")
    return "\n".join(kept)
