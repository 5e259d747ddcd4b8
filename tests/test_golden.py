"""Golden test: intqat's numbers do not move when its code is reorganised.

For each model of tests/golden_cases.py (the recipes' MLP / CNN / GPT and the other layer kinds),
the fake-quant and integer training outputs, every gradient, the eval output and the exported
program (graph text before and after autocast, the hash of every stored constant, its output) are
compared with tests/golden/<case>.pt, written by an earlier commit.

Each file holds one recorded run per machine class (`machine_signature`: torch build, CPU model, instruction
sets), since torch's float kernels and intqat's own backward algorithm (the digit GEMMs run where they pay:
docs/backends.md) legitimately give other last bits on other CPUs.
- On a machine class the file has a run of, everything is compared **bit for bit** (SHA-256 of every
  tensor's bytes).
- Elsewhere (against the first run recorded), graphs, signatures, integer-valued results and the names of
  the stored constants compare exactly; float tensors within FLOAT_RTOL_ELSEWHERE of their max |value| plus
  FLOAT_ATOL (one activation code flipped by a last-bit difference upstream moves an output by one
  quantization step; a gradient that cancels to ~0 differs by float noise); constants' values are not
  compared (they are trained weights' codes). The test says which comparison it made: record this machine's
  run (below) on the code *before* a change to get the bitwise check here.

Record this machine's run (on unchanged numbers: before a refactor), or regenerate every run after a change
that is *meant* to change numbers (say so in the commit):
    INTQAT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py          # adds / replaces this machine's
    INTQAT_UPDATE_GOLDEN=all .venv/bin/python -m pytest tests/test_golden.py        # drops the other machines' runs
"""

from __future__ import annotations

import difflib
import os
import warnings
from pathlib import Path

import pytest
import torch

from golden_cases import CASES, Case, machine_signature, run_case

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("INTQAT_UPDATE_GOLDEN", "0") not in ("", "0")
FLOAT_RTOL_ELSEWHERE = 1e-3  # of max |golden|: see the docstring
FLOAT_ATOL = 1e-9            # absolute floor for tensors that are ~0 (an LSQ zero-point gradient: ~5e-11)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _compare_tensor(where: str, got: dict, want: dict, exact: bool) -> None:
    assert got["dtype"] == want["dtype"] and got["shape"] == want["shape"], (
        f"{where}: {got['dtype']} {got['shape']}, golden {want['dtype']} {want['shape']}")
    if exact or not want["dtype"].startswith("torch.float"):
        if got["sha256"] != want["sha256"]:
            detail = ""
            if "data" in want:
                d = (got["data"].double() - want["data"].double()).abs()
                detail = f": {int((d > 0).sum())} of {d.numel()} elements differ, max |diff| {float(d.max()):.3g}"
            pytest.fail(f"{where}: not bit-identical to the golden file{detail}")
        return
    key = "data" if "data" in want else "sample"
    a, b = got[key].double(), want[key].double()
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= FLOAT_RTOL_ELSEWHERE * scale + FLOAT_ATOL, (
        f"{where}: max |diff| {err:.3g} > {FLOAT_RTOL_ELSEWHERE} x max |golden| {scale:.3g} + {FLOAT_ATOL}")


def _compare_stage(case: str, stage: str, got: dict, want: dict, exact: bool) -> None:
    for key in ("y", "y_eval"):
        if key in want:
            _compare_tensor(f"{case} {stage} {key}", got[key], want[key], exact)
    if "grads" in want:
        assert sorted(got["grads"]) == sorted(want["grads"]), f"{case} {stage}: gradients of other parameters"
        for name in want["grads"]:
            _compare_tensor(f"{case} {stage} grad {name}", got["grads"][name], want["grads"][name], exact)


def _compare_program(case: str, which: str, got: dict, want: dict, exact: bool) -> None:
    for key in ("graph", "signature"):
        if got[key] != want[key]:
            diff = "\n".join(difflib.unified_diff(want[key].splitlines(), got[key].splitlines(), "golden", "now",
                                                  lineterm="", n=1))
            pytest.fail(f"{case} {which}: the exported {key} changed:\n{diff[:4000]}")
    if exact:
        assert got["constants"] == want["constants"], f"{case} {which}: stored constants changed (codes, scales)"
    else:
        assert sorted(got["constants"]) == sorted(want["constants"]), f"{case} {which}: other stored constants"
    if "y" in want:
        _compare_tensor(f"{case} {which} y", got["y"], want["y"], exact)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden(case: Case, one_thread) -> None:
    path = GOLDEN / f"{case.name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prepare_qat's census of float layers: not what this test is about
        got = run_case(case)
    signature = machine_signature()
    runs = _load_runs(path) if path.exists() and UPDATE != "all" else {}
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        runs[signature] = got
        tmp = path.with_suffix(".tmp")
        torch.save({"runs": runs}, tmp)
        os.replace(tmp, path)
        return
    assert path.exists(), f"{path} is missing: INTQAT_UPDATE_GOLDEN=1 writes it (see this file's docstring)"
    runs = _load_runs(path)
    exact = signature in runs
    machine = signature if exact else next(iter(runs))
    want = runs[machine]
    for stage in ("fake_quant", "integer"):
        _compare_stage(case.name, stage, got[stage], want[stage], exact)
    _compare_program(case.name, "program", got["program"], want["program"], exact)
    _compare_program(case.name, "reference program", got["reference_program"], want["reference_program"], exact)
    if not exact:
        print(f"\n{case.name}: no run of this machine class [{signature}] in {path.name}; compared with "
              f"[{machine}]: graphs and integers exactly, floats within {FLOAT_RTOL_ELSEWHERE} x max + {FLOAT_ATOL}")


def _load_runs(path: Path) -> dict[str, dict]:
    """signature -> recorded run (files of the one-machine format {"machine", "run"} read as one entry)."""
    golden = torch.load(path, weights_only=False)
    return golden["runs"] if "runs" in golden else {golden["machine"]: golden["run"]}
