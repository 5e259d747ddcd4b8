"""Smoke test of `intqat-bench ops --quick` and `modules --quick`: the tables have their rows and
every number is finite and positive. Speed is never asserted (it depends on the machine)."""

import importlib.util
import json
import math

import pytest
import torch

from intqat.bench.memory import peak_transient_bytes
from intqat.bench.saved import saved_bytes
from intqat.bench.timing import speed_ratio, time_interleaved
from intqat.cli.bench import main
from intqat.ops.cpu_features import cpu_has_int8_dot

HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None

OPS_ROWS = [
    "torch._int_mm [anchor]", "intqat int_mm", "torch._int_mm, B = Wᵀ view", "intqat int_mm, B = Wᵀ view", "fp32 torch.mm",
    "nn.Linear fp32 [anchor]", "intqat int_linear static w8a8", "intqat int_linear static, grad_gemm=fp32",
    "intqat int_linear dynamic per-token",
    "intqat IntLinear w8a8", "intqat FakeQuantLinear w8a8", "torchao FakeQuantizedLinear",
    "torchao int8 mixed-precision", "torch.ao.nn.qat.Linear x86",
]
MODULE_ROWS = ["fp32", "intqat fake-quant w8a8", "intqat integer w8a8", "torchao QAT",
               "torchao int8 mixed-precision", "torch.ao QAT x86"]
PEERS = ("torchao",)  # rows that need the optional torchao


@pytest.fixture
def one_thread():
    """The smoke runs use one thread. On a 2-core machine shared with other jobs, OpenMP threads
    spin-wait for a descheduled sibling at every parallel region: the same run takes ~5x longer
    with 2 threads. Nothing here asserts speed, so the thread count changes no assertion."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def _expected_available(name: str) -> bool:
    return HAVE_TORCHAO or not name.startswith(PEERS)


def test_ops_quick(tmp_path, capsys, one_thread):
    out = tmp_path / "ops.json"
    assert main(["ops", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "intqat-bench ops" in text and "machine:" in text and "torch 2." in text
    data = json.loads(out.read_text())["ops"]
    by_name = {r["name"]: r for r in data["data"]}
    for row in OPS_ROWS:
        name = row.replace(" [anchor]", "")
        assert row in text, f"row {row!r} missing from the table"
        rec = by_name[name]
        if not _expected_available(name):
            assert rec.get("unavailable")
            continue
        assert "unavailable" not in rec, rec
        assert _positive(rec["median_s"]) and _positive(rec["gops"]) and _positive(rec["speed_vs_anchor"])
        assert all(_positive(t) for t in rec["times_s"])
        if rec["group"] == "linear":
            assert _positive(rec["saved_bytes"])
            assert rec["saved_vs_torchao_fq"] is None or _positive(rec["saved_vs_torchao_fq"])


def test_modules_quick(tmp_path, capsys, one_thread):
    out = tmp_path / "modules.json"
    assert main(["modules", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "intqat-bench modules" in text and "MLP" in text and "CNN" in text
    data = json.loads(out.read_text())["modules"]
    recs = data["data"]
    for model in ("MLP", "CNN"):
        rows = {r["name"]: r for r in recs if r["model"].startswith(model)}
        assert set(rows) == set(MODULE_ROWS)
        for name, rec in rows.items():
            if not _expected_available(name):
                assert rec.get("unavailable")
                continue
            assert "unavailable" not in rec, rec
            for key in ("median_s", "speed_vs_fp32", "eval_median_s", "eval_speed_vs_fp32", "peak_bytes", "peak_vs_fp32",
                        "saved_bytes"):
                assert _positive(rec[key]), (model, name, key, rec[key])
            if name == "fp32":
                assert rec["mismatch_max_abs"] is None
                continue
            if rec["deploy_error"] is None:
                assert math.isfinite(rec["mismatch_max_abs"]) and rec["mismatch_max_abs"] >= 0
        # intqat's integer training forward is its deployed program: the exported program agrees exactly
        assert rows["intqat integer w8a8"]["mismatch_exact_zero"] is True


def test_deploy_cells_name_a_refused_int_mm_as_the_cause():
    """A nonzero deploy mismatch of an intqat row, where the self-check refused torch._int_mm (the deployed program
    multiplies with it), is footnoted as that GEMM's; an exact one, a peer's row, or a trusted _int_mm is not."""
    from intqat.bench.modules import _DEPLOYED_INT_MM, deploy_cells

    marks: dict[str, str] = {}

    def mark(reason: str) -> str:
        return marks.setdefault(reason, f"[{len(marks) + 1}]")

    wrong, exact = (0.99, 0.083, False, None), (0.0, 0.0, True, None)
    assert deploy_cells("intqat integer w8a8", wrong, True, mark) == ("9.90e-01 [1]", "8.3e-02")
    assert marks == {_DEPLOYED_INT_MM: "[1]"} and "aten._int_mm" in _DEPLOYED_INT_MM
    assert deploy_cells("intqat integer w8a8", wrong, False, mark) == ("9.90e-01", "8.3e-02")
    assert deploy_cells("torchao QAT", wrong, True, mark) == ("9.90e-01", "8.3e-02")
    assert deploy_cells("intqat integer w8a8", exact, True, mark) == ("0", "0")
    assert deploy_cells("fp32", None, True, mark) == ("-", "-")
    failed = deploy_cells("torch.ao QAT x86", (None, None, False, "boom"), True, mark)
    assert failed[0] == failed[1] == "n/a [2]" and marks["torch.ao QAT x86: deploy path failed: boom"] == "[2]"


def test_timer_and_counters_on_toy_inputs():
    calls = {"a": 0, "b": 0}

    def a():
        calls["a"] += 1

    def b():
        calls["b"] += 1

    t = time_interleaved({"a": a, "b": b}, repeats=4, warmup=1, min_time=0.0)
    assert len(t["a"].times) == len(t["b"].times) == 4 and calls["a"] == calls["b"]
    assert _positive(speed_ratio(t["a"], t["b"]))

    w = torch.nn.Parameter(torch.randn(8, 4))
    x = torch.randn(3, 4, requires_grad=True)
    nbytes, y = saved_bytes(lambda: x @ w.t(), exclude=[w])
    assert nbytes == x.numel() * 4  # mm keeps x (and w, a parameter: not counted)
    peak = peak_transient_bytes(lambda: torch.empty(1 << 20, dtype=torch.uint8))
    if peak is not None:
        assert peak >= 1 << 20


def test_models_flag_names_the_unknown(capsys):
    assert main(["modules", "--quick", "--models", "resnet,vgg"]) == 2
    err = capsys.readouterr().err
    assert "vgg" in err and "resnet" in err and "llama" in err


def test_profile_blocks_quick(tmp_path, capsys, one_thread):
    """`profile --models`: per block, every flavour's step split into the op classes; the classes add up to the wall
    time (the last class is defined as the remainder), and the integer step ran an int8 GEMM or conv."""
    from intqat.bench.profile import OP_CLASSES

    out = tmp_path / "profile.json"
    assert main(["profile", "--quick", "--models", "mbconv", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MBConv" in text and "int8 GEMM / conv" in text
    (rows,) = json.loads(out.read_text())["profile"].values()
    assert {"fp32", "intqat integer w8a8"} <= set(rows)
    for name, rec in rows.items():
        assert set(rec["classes_ms"]) == set(OP_CLASSES)
        assert math.isclose(sum(rec["classes_ms"].values()), rec["wall_ms"], rel_tol=1e-6) or \
            rec["classes_ms"][OP_CLASSES[-1]] == 0
    # (without int8 dot products the integer GEMMs are intqat's own AVX2 kernels, inside its C++ ops)
    assert rows["intqat integer w8a8"]["classes_ms"]["int8 GEMM / conv" if cpu_has_int8_dot() else "intqat C kernels"] > 0
