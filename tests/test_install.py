"""A plain (non-editable) `pip install .` gives a self-contained package with working console scripts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    # --no-deps --no-build-isolation: nothing is fetched; torch & co. come from this venv
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        check=True, cwd=build, env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    return target


def _run(installed, args, cwd):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_package_data_and_kernels_are_installed(installed, tmp_path):
    code = (
        "import intqat, intqat.kernels, intqat.conf, intqat.recipes, importlib.resources as r, pathlib;"
        "print(intqat.__file__);"
        "print(sorted(p.name for p in pathlib.Path(intqat.recipes.__path__[0]).glob('*.yaml')));"
        "print(sorted(p.name for p in r.files('intqat.conf').iterdir() if p.is_dir()));"
        "from intqat.ops import cpu_kernels; print('fused', *cpu_kernels._sources(), cpu_kernels.available())"
    )
    out = _run(installed, [sys.executable, "-c", code], tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(str(installed)), "imported the checkout instead of the installed copy"
    assert "mlp_digits_w8a8.yaml" in lines[1]
    for group in ("model", "data", "quant", "trainer"):
        assert group in lines[2]
    # the fused CPU kernels' C source ships in the package and builds from there
    fused = lines[3].split()
    assert fused[0] == "fused" and fused[-1] == "True", lines[3]
    assert [p.rsplit("/", 1)[-1] for p in fused[1:-1]] == ["fused.c", "amx_digits.c", "amx_linear.c", "int16_gemm.c"], lines[3]
    assert all(p.startswith(str(installed)) for p in fused[1:-1]), lines[3]


@pytest.mark.parametrize("script", ["intqat-train", "intqat-export", "intqat-graphs", "intqat-bench"])
def test_console_scripts_start(installed, tmp_path, script):
    exe = installed / "bin" / script
    assert exe.exists(), f"{script} was not installed"
    args = [str(exe), "--help"]
    out = _run(installed, args, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip()
