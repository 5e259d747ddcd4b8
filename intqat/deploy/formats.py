"""The export formats by name, shared by intqat-export (--format) and the IntQAT callback's end-of-fit export
(recipes' export.formats): which exist, what each needs installed, and writing the deploy ones.

    pt2       model.pt2: the torch.export program (intqat.export; written by its own callers)
    pte       model.pte + model_report.json / .md: ExecuTorch, XNNPACK (intqat.deploy.executorch)
    onnx      model.onnx, Q/DQ (intqat.deploy.onnx, form="qdq")
    onnx-int  model.int.onnx, integer ops (intqat.deploy.onnx, form="int")
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from intqat.deploy._require import require

__all__ = ["FORMATS", "DEFAULT_FORMATS", "FILES", "parse_formats", "check_formats", "onnx_exporter",
           "export_deploy_formats"]

FORMATS = ("pt2", "pte", "onnx", "onnx-int")
DEFAULT_FORMATS = ("pt2",)  # what every recipe wrote before the deploy formats: nothing changes unless asked
FILES = {"pt2": "model.pt2", "pte": "model.pte", "onnx": "model.onnx", "onnx-int": "model.int.onnx"}


def parse_formats(value: str | Iterable[str] | None) -> list[str]:
    """'pt2,pte' or ['pt2', 'pte'] -> ['pt2', 'pte'] (checked, in order, no repeats); None -> DEFAULT_FORMATS."""
    if value is None:
        return list(DEFAULT_FORMATS)
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    formats = [f.strip() for f in items if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"formats {value!r}: {'unknown ' + ', '.join(bad) if bad else 'none given'}; choose from "
                         f"{', '.join(FORMATS)} (e.g. 'pt2,pte')")
    return list(dict.fromkeys(formats))


def onnx_exporter():
    """intqat.deploy.onnx.export_onnx."""
    from intqat.deploy.onnx import export_onnx

    return export_onnx


def check_formats(formats: Sequence[str]) -> None:
    """Every format's packages (MissingDeployPackage names the extra), before anything is loaded."""
    for fmt in formats:
        require(fmt)


def export_deploy_formats(model, example_inputs: Any, out_dir: str | os.PathLike, formats: Sequence[str], *,
                          calibration_data=None, validation_data=None, max_batch: int = 64,
                          info: dict | None = None, **autocast_options: Any) -> dict[str, Any]:
    """Export and write every deploy format of `formats` (pt2 is its callers') into out_dir, each file atomically
    with its report beside it; -> format -> its result (PteResult, OnnxResult). All are exported before any is
    written: a failure writes nothing.
    autocast_options: intqat.autocast's, as for model.pt2 (low_precision_type applies to the float regions).
    info: entries for the reports (the source, the split)."""
    check_formats(formats)
    out = Path(out_dir)
    results: dict[str, Any] = {}
    if "pte" in formats:
        from intqat.deploy.executorch import export_pte

        results["pte"] = export_pte(model, example_inputs, None, calibration_data=calibration_data,
                                    validation_data=validation_data, max_batch=max_batch, **autocast_options)
    for fmt in [f for f in formats if f in ("onnx", "onnx-int")]:
        # (max_batch bounds the trace only: the file's batch axis is symbolic; bf16 float regions stay fp32 there,
        # onnxruntime's CPU provider has no bf16 kernels: the result's notes say so)
        results[fmt] = onnx_exporter()(model, example_inputs, None, form="qdq" if fmt == "onnx" else "int",
                                       calibration_data=calibration_data, validation_data=validation_data,
                                       max_batch=max_batch, fp32_baseline=True, **autocast_options)
    for fmt, result in results.items():
        result.info.update(info or {})
        result.save(out / FILES[fmt], report=True)
    return results
