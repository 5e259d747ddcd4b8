"""Golden test: intqat's numbers do not move when its code is reorganised.

For each model of tests/golden_cases.py (the recipes' MLP / CNN / GPT and the other layer kinds),
the fake-quant and integer training outputs, every gradient, the eval output and the exported
program (graph text before and after autocast, the hash of every stored constant, its output) are
compared with tests/golden/<case>.pt, written by an earlier commit.

- On the machine class that wrote the files (same torch build, same CPU model and instruction sets:
  `machine_signature`), everything is compared **bit for bit** (SHA-256 of every tensor's bytes).
- Elsewhere, integer-valued results and graphs still compare exactly, and float tensors within
  rtol 1e-5 of their max |value| (torch's float kernels pick other code paths on other CPUs, so
  their last bits legitimately differ); the test says which comparison it made.

Regenerate (only when a change is *meant* to change numbers, and say so in the commit):
    INTQAT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py
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
FLOAT_RTOL = 1e-5


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
    scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-30)
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= FLOAT_RTOL * scale, f"{where}: max |diff| {err:.3g} > {FLOAT_RTOL} x max |golden| {scale:.3g}"


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
    assert got["constants"] == want["constants"], f"{case} {which}: stored constants changed (codes, scales)"
    if "y" in want:
        _compare_tensor(f"{case} {which} y", got["y"], want["y"], exact)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden(case: Case, one_thread) -> None:
    path = GOLDEN / f"{case.name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prepare_qat's census of float layers: not what this test is about
        got = run_case(case)
    signature = machine_signature()
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"machine": signature, "run": got}, tmp)
        os.replace(tmp, path)
        return
    assert path.exists(), f"{path} is missing: INTQAT_UPDATE_GOLDEN=1 writes it (see this file's docstring)"
    golden = torch.load(path, weights_only=False)
    exact = golden["machine"] == signature
    want = golden["run"]
    for stage in ("fake_quant", "integer"):
        _compare_stage(case.name, stage, got[stage], want[stage], exact)
    _compare_program(case.name, "program", got["program"], want["program"], exact)
    _compare_program(case.name, "reference program", got["reference_program"], want["reference_program"], exact)
    if not exact:
        print(f"\n{case.name}: golden written on [{golden['machine']}], this machine is [{signature}]: "
              f"integers and graphs compared exactly, float tensors within rtol {FLOAT_RTOL}")
