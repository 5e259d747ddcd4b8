"""The run report: `report.md` and `curves.png` from a Lightning CSVLogger `metrics.csv`.

    write_report("runs/mlp_digits_w8a8/2026-01-01_12-00-00", title="mlp_digits_w8a8",
                 boundaries=qat_callback.boundaries)

Where the QAT stages start, in order of preference:
1. `boundaries`: IntQAT's record, {stage: {"epoch": e, "step": s}} with stage in prepare,
   freeze_bn, freeze_observers, integer and s = optimizer steps done when it started (exact).
2. the `quant/stage` column (STAGE_COLUMN) IntQAT logs: 0 float, 1 fake quant, 2 integer. At
   every swap IntQAT logs a row holding the stage alone, at the exact step (steps done then).
   Without such a row, a change between two logged training steps is placed at the start of the
   epoch when they lie in different epochs, otherwise halfway between them (resolution:
   log_every_n_steps). The freeze stages do not show in this column.
Files are written to a temporary name in the same directory, then os.replace'd: a reader never
sees half a file.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["STAGE_COLUMN", "STAGE_NAMES", "read_metrics", "stage_boundaries", "write_report"]

STAGE_COLUMN = "quant/stage"  # logged by intqat.IntQAT
STAGE_NAMES = ("fp32", "fake-quant", "integer")  # the values of STAGE_COLUMN
SQNR_TEST = "quant_test/sqnr_db"  # IntQAT: mean SQNR of the quantized layers' outputs on the test split
BOUNDARY_NAMES = {"prepare": "fake-quant", "freeze_bn": "BN frozen", "freeze_observers": "observers frozen", "integer": "integer"}


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of metrics.csv as {column: float}, empty cells left out."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]


def _train_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    # test rows come last with a step past the end of training: keep them out of the curves;
    # rows without an epoch (LearningRateMonitor's) cannot be placed on the epoch axis
    return [r for r in rows if "epoch" in r and "step" in r and not any(k.startswith("test/") for k in r)]


def _epoch_axis(rows: list[dict[str, float]]):
    """steps done -> fractional epochs, piecewise linear through the epoch ends seen in the log."""
    end: dict[int, float] = {}
    for r in rows:
        e = int(r["epoch"])
        end[e] = max(end.get(e, -1.0), r["step"])
    xp, fp = [0.0], [0.0]
    for e in sorted(end):
        if end[e] + 1 > xp[-1]:
            xp.append(end[e] + 1)
            fp.append(e + 1.0)

    def to_epoch(steps_done: float) -> float:
        if len(xp) < 2:
            return 0.0
        if steps_done > xp[-1]:  # past the last epoch end: extrapolate with the last epoch's length
            return fp[-1] + (steps_done - xp[-1]) / (xp[-1] - xp[-2]) * (fp[-1] - fp[-2])
        return float(np.interp(steps_done, xp, fp))

    return to_epoch, end


def _is_swap_row(row: dict[str, float]) -> bool:
    """IntQAT logs a row of its own, holding the stage alone, at the exact step of every swap."""
    return set(row) - {"epoch", "step"} == {STAGE_COLUMN}


def stage_boundaries(
    rows: list[dict[str, float]], boundaries: Mapping[str, Mapping[str, int]] | None = None
) -> list[dict[str, Any]]:
    """[{name, step (optimizer steps done before it), epoch (fractional)}] per stage start, in order."""
    to_epoch, end = _epoch_axis(_train_rows(rows))
    found: dict[float, list[str]] = {}
    if boundaries:
        for stage, where in boundaries.items():
            found.setdefault(float(where["step"]), []).append(BOUNDARY_NAMES.get(stage, stage))
    else:
        logged = sorted((r for r in rows if STAGE_COLUMN in r and "step" in r), key=lambda r: r["step"])
        if logged and int(logged[0][STAGE_COLUMN]) > 0:  # quantized from the start (prepare_at=0)
            found.setdefault(logged[0]["step"] if _is_swap_row(logged[0]) else 0.0, []).append(
                STAGE_NAMES[int(logged[0][STAGE_COLUMN])])
        for prev, new in zip(logged, logged[1:]):
            if int(prev[STAGE_COLUMN]) == int(new[STAGE_COLUMN]):
                continue
            if _is_swap_row(new):
                steps_done = new["step"]
            elif "epoch" in prev and "epoch" in new and int(prev["epoch"]) < int(new["epoch"]) and (int(new["epoch"]) - 1) in end:
                steps_done = end[int(new["epoch"]) - 1] + 1  # switched when that epoch began
            else:  # a training-step row's step is the batch's index: the swap came after prev's batch
                steps_done = (prev["step"] + 1 + new["step"]) / 2
            found.setdefault(steps_done, []).append(STAGE_NAMES[int(new[STAGE_COLUMN])])
    return [{"name": " + ".join(names), "step": step, "epoch": to_epoch(step)} for step, names in sorted(found.items())]


def _per_epoch(rows: list[dict[str, float]]) -> dict[int, dict[str, float]]:
    table: dict[int, dict[str, float]] = {}
    for r in _train_rows(rows):
        t = table.setdefault(int(r["epoch"]), {})
        for k, v in r.items():
            if k == STAGE_COLUMN:
                t[k] = max(t.get(k, v), v)
            elif k not in ("epoch", "step") and not k.endswith("_step"):
                t[k] = v
    return table


# -- atomic writes ------------------------------------------------------------------------------
def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # same directory: os.replace is atomic
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def plot_curves(rows: list[dict[str, float]], path: Path, stages: list[dict[str, Any]] = ()) -> None:
    """Loss and accuracy against epochs; a dashed line where each of `stages` (stage_boundaries) starts."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training box
    import matplotlib.pyplot as plt

    rows = _train_rows(rows)
    to_epoch, _ = _epoch_axis(rows)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    series = [
        (ax_loss, "train/loss_step", "train loss (step)", dict(alpha=0.3, lw=0.8)),
        (ax_loss, "train/loss_epoch", "train loss", dict(marker=".")),
        (ax_loss, "val/loss", "val loss", dict(marker=".")),
        (ax_acc, "train/acc", "train acc", dict(marker=".")),
        (ax_acc, "val/acc", "val acc", dict(marker=".")),
    ]
    for ax, key, label, style in series:
        pts = [(to_epoch(r["step"] + 1), r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), label=label, **style)
    for b in stages:
        for ax in (ax_loss, ax_acc):
            ax.axvline(b["epoch"], color="gray", ls="--", lw=1)
        ax_acc.annotate(b["name"], (b["epoch"], 0.02), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=8, color="gray", ha="right", va="bottom")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    _atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def _fmt(v: float | None, digits: int = 4) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def write_report(
    run_dir: str | os.PathLike,
    *,
    metrics_csv: str | os.PathLike | None = None,
    title: str = "intqat run",
    summary: Mapping[str, Any] | None = None,
    config_yaml: str | None = None,
    boundaries: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, Path]:
    """Write run_dir/report.md and run_dir/curves.png; returns their paths.

    `summary` adds rows (e.g. wall time, checkpoint, export paths) to the table at the top;
    `config_yaml` is appended so the report alone says how the run was made; `boundaries` is
    IntQAT's record of where its stages started (see the module docstring).
    """
    run_dir = Path(run_dir)
    rows = read_metrics(metrics_csv or run_dir / "metrics.csv")
    per_epoch = _per_epoch(rows)
    stages = stage_boundaries(rows, boundaries)
    test = {k: v for r in rows for k, v in r.items() if k.startswith("test/")}
    val = [(e, t["val/acc"]) for e, t in sorted(per_epoch.items()) if "val/acc" in t]
    curves = run_dir / "curves.png"
    plot_curves(rows, curves, stages)

    lines = [f"# {title}", "", "| | |", "|---|---|"]
    if "test/acc" in test:
        lines.append(f"| test accuracy | {_fmt(test['test/acc'])} |")
    if "test/loss" in test:
        lines.append(f"| test loss | {_fmt(test['test/loss'])} |")
    sqnr = [r[SQNR_TEST] for r in rows if SQNR_TEST in r]
    if sqnr:
        lines.append(f"| test SQNR, mean over quantized layers | {sqnr[-1]:.1f} dB |")
    if val:
        best_e, best = max(val, key=lambda ev: ev[1])
        lines.append(f"| best val accuracy | {_fmt(best)} (epoch {best_e}) |")
        lines.append(f"| final val accuracy | {_fmt(val[-1][1])} (epoch {val[-1][0]}) |")
    for k, v in (summary or {}).items():
        lines.append(f"| {k} | {v} |")

    lines += ["", "## QAT stages", ""]
    if stages:
        lines += ["| stage | starts at epoch | after optimizer step |", "|---|---|---|"]
        lines += ["| fp32 | 0 | 0 |"] if stages[0]["step"] > 0 else []
        lines += [f"| {b['name']} | {b['epoch']:.2f} | {b['step']:.0f} |" for b in stages]
    else:
        seen = {int(t[STAGE_COLUMN]) for t in per_epoch.values() if STAGE_COLUMN in t}
        only = STAGE_NAMES[seen.pop()] if len(seen) == 1 else "fp32"
        lines.append(f"No stage change: the whole run trained {only}.")

    lines += ["", "## Curves", "", "![loss and accuracy](curves.png)", "",
              "Dashed lines: where a QAT stage starts.", "", "## Per epoch", "",
              "| epoch | stage | train loss | train acc | val loss | val acc |", "|---|---|---|---|---|---|"]
    for e, t in sorted(per_epoch.items()):
        stage = STAGE_NAMES[int(t[STAGE_COLUMN])] if STAGE_COLUMN in t else ""
        lines.append(
            f"| {e} | {stage} | {_fmt(t.get('train/loss_epoch'))} | {_fmt(t.get('train/acc'))} "
            f"| {_fmt(t.get('val/loss'))} | {_fmt(t.get('val/acc'))} |"
        )
    if config_yaml:
        lines += ["", "## Config", "", "```yaml", config_yaml.rstrip(), "```"]
    report = run_dir / "report.md"
    text = "\n".join(lines) + "\n"
    _atomic_write(report, lambda f: f.write(text.encode()))
    return {"report": report, "curves": curves}
