"""The Triton kernels compiled for real NVIDIA GPUs (sm_80, sm_90) with no GPU: Triton's compiler and
the ptxas / cuobjdump its wheel ships (intqat.bench.kernels). The suite runs under TRITON_INTERPRET=1,
so the compiles run in one child process without it. A representative subset: the full matrix is
`intqat-bench kernels` (minutes)."""

import subprocess
import sys

import pytest
import torch

from intqat.bench import gpu
from intqat.bench.kernels import compile_records, problems

# (kernel, variant, shape) -> every GPU config the autotuner keeps for it, on sm_80 and sm_90
SUBSET = [
    ("int_gemm", "float float32 +bias", "aligned"),  # int_linear's forward: the heaviest epilogue in use
    ("int_gemm", "int8 +bias", "ragged"),  # requantizing epilogue on byte-wise loads
    ("ste_grad_input", "float32 mask", "ragged"),
    ("ste_grad_weight", "float32 mask lsq", "aligned"),
]
# 22 compiles in one child process: 62 s here (2 cores shared with other agents and a full
# `intqat-bench kernels` run), most of it ptxas; Triton's cache (keyed on the kernel source) skips
# unchanged kernels on the next run


@pytest.fixture(scope="module")
def records():
    return compile_records(["sm_80", "sm_90"], only=SUBSET)


def test_subset_compiles_without_spills_within_shared_memory(records):
    assert {(r["kernel"], r["variant"], r["shape"]) for r in records} == set(SUBSET)
    for r in records:
        where = f"{r['kernel']} {r['variant']} {r['shape']} {r['config']} {r['arch']}"
        assert r["error"] is None, f"{where}: {r['error']}"
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, f"{where} spills"
        assert 0 < r["registers"] <= 255, where
        assert 0 < r["shared"] <= r["smem_per_block"], f"{where}: {r['shared']} B of shared memory"
        assert r["problems"] == [], where


def test_gemm_uses_int8_tensor_cores_and_an_unfused_epilogue(records):
    gemm = [r for r in records if r["kernel"] == "int_gemm"]
    assert gemm
    for r in gemm:
        ops = set(op.split(".")[0] for op in r["int8_mma"])
        # sm_80: mma.sync (IMMA); sm_90: wgmma (IGMMA) where a warpgroup's tile is >= 64 rows
        want = {"IMMA"} if r["arch"] == "sm_80" else {"IGMMA", "IMMA"}
        assert ops and ops <= want, f"{r['config']} {r['arch']}: {r['int8_mma']}"
        assert r["ptx_fp32_fma"] == 0, f"{r['config']} {r['arch']}: float(acc) * scale + bias fused into an fma"
    assert any("IGMMA" in op for r in gemm if r["arch"] == "sm_90" for op in r["int8_mma"])


def test_problems_name_each_failed_check():
    ok = {"error": None, "spill_store_bytes": 0, "spill_load_bytes": 0, "shared": 1000, "smem_per_block": 2000,
          "tensor_cores": True, "int8_mma": {"IMMA.16832.S8.S8.SAT": 4}, "ptx_fp32_fma": 0}
    assert problems(ok) == []
    assert problems({**ok, "spill_load_bytes": 8}) == ["spills"]
    assert problems({**ok, "shared": 2001}) == ["shared memory"]
    assert problems({**ok, "int8_mma": {}}) == ["no int8 tensor cores"]
    assert problems({**ok, "ptx_fp32_fma": 16}) == ["fused fp32 epilogue (fma)"]
    assert problems({**ok, "int8_mma": {}, "tensor_cores": False}) == []  # fp32 STE kernels: FMA units by design
    assert problems({**ok, "error": "PTXASError: x"}) == ["compile error"]


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="unknown variant"):
        compile_records(["sm_80"], ["aligned"], ["int_gemm"], ["float float64"])


def test_unknown_arch_is_named():
    from intqat.bench.triton_target import parse_arch

    assert parse_arch("sm90").name == parse_arch("90").name == "sm_90"
    with pytest.raises(ValueError, match="unknown arch 'sm_75'"):
        parse_arch("sm_75")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed where no CUDA device exists")
def test_gpu_bench_without_a_gpu_says_so_and_exits_3():
    proc = subprocess.run([sys.executable, "-m", "intqat.cli.bench", "gpu"], capture_output=True, text=True)
    assert proc.returncode == gpu.NO_GPU_EXIT == 3, proc.stderr
    assert "needs a CUDA device" in proc.stderr and "Nothing was measured" in proc.stderr
    assert proc.stdout.strip().startswith("intqat-bench gpu:")  # the timing line; no table
