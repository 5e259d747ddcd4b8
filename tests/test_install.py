"""A plain (non-editable) `pip install .` gives a self-contained package with working console scripts;
its metadata names a torch range that pip keeps, and `make` installs the exact builds of constraints.txt."""

import json
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
    assert [p.rsplit("/", 1)[-1] for p in fused[1:-1]] == ["fused.c", "amx_digits.c", "amx_linear.c", "int16_gemm.c",
                                                          "grouped_linear.c", "amx_grouped.c", "depthwise_backward.c"], lines[3]
    assert all(p.startswith(str(installed)) for p in fused[1:-1]), lines[3]


# each script's --help, and a line of it that only that script's own help has
SCRIPTS = {"intqat-train": "recipe", "intqat-export": "recipe=NAME", "intqat-graphs": "--trials",
           "intqat-bench": "ops"}


def test_console_scripts_start(installed, tmp_path):
    """Every console script of the installed package starts and prints its help. The four start at once (each
    spends ~3 s importing torch; on 2 cores two at a time run in parallel)."""
    env = {**os.environ, "PYTHONPATH": str(installed)}
    procs = {}
    for script in SCRIPTS:
        exe = installed / "bin" / script
        assert exe.exists(), f"{script} was not installed"
        procs[script] = subprocess.Popen([str(exe), "--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{script}: {out}{err}"
        assert SCRIPTS[script] in out, f"{script} --help: {out}"


# -- the dependency spec: a torch range for users, the exact build for development -------------------


def _requirements(installed):
    from importlib.metadata import PathDistribution

    (info,) = installed.glob("intqat-*.dist-info")
    return PathDistribution(info).requires or []


def test_metadata_names_a_torch_range_and_leaves_triton_to_torch(installed):
    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in _requirements(installed)]
    base = {r.name: r for r in reqs if r.marker is None}
    torch_spec = base["torch"].specifier
    assert not any(s.operator in ("==", "===") for s in torch_spec), torch_spec
    for ok in ["2.13.0", "2.13.0+cpu", "2.13.1+cu128", "2.14.0", "2.20.0"]:
        assert torch_spec.contains(ok), (ok, torch_spec)
    for too_old_or_new in ["2.6.0", "2.12.1", "3.0.0"]:
        assert not torch_spec.contains(too_old_or_new), (too_old_or_new, torch_spec)
    # CUDA / ROCm torch builds pin the triton they were built with; intqat asks for it only as an extra
    assert "triton" not in base
    assert {str(r.marker) for r in reqs if r.name == "triton"} == {'extra == "triton"', 'extra == "dev"'}


def _stub_wheel(directory: Path, name: str, version: str) -> None:
    """An empty wheel that carries only a name and a version: what pip's resolver looks at."""
    import zipfile

    stem = f"{name.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: intqat-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(directory / f"{stem}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{info}/RECORD", "".join(f"{p},,\n" for p in [*files, f"{info}/RECORD"]))


def test_pip_keeps_another_supported_torch(tmp_path, installed):
    """`pip install intqat` into environments that hold another torch: a supported one stays, an
    older one is upgraded. pip's real resolver, over stub wheels (offline, nothing downloaded)."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    pip = [sys.executable, "-m", "pip"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    stubs, wheels = tmp_path / "stubs", tmp_path / "wheels"
    stubs.mkdir()
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, cwd=tmp_path, env=env, timeout=300)
    for r in map(Requirement, _requirements(installed)):
        if r.marker is None and r.name != "torch":
            _stub_wheel(stubs, r.name, version(r.name).split("+")[0])  # what this venv resolved
    for v in ["2.5.1", "2.13.0", "2.14.0"]:
        _stub_wheel(stubs, "torch", v)

    def plan(installed_torch: str) -> dict[str, str]:
        target = tmp_path / f"env-{installed_torch}"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True, timeout=120)
        where = ["--python", str(target / "bin" / "python"), "install", "--find-links", str(stubs)]
        subprocess.run([*pip, *where, "--quiet", f"torch=={installed_torch}"], check=True, env=env, timeout=300)
        report = tmp_path / f"report-{installed_torch}.json"
        subprocess.run([*pip, *where, "--find-links", str(wheels), "--dry-run", "--quiet", "--report", str(report),
                        "intqat"], check=True, env=env, timeout=300)
        items = json.loads(report.read_text())["install"]
        return {i["metadata"]["name"]: i["metadata"]["version"] for i in items}

    kept = plan("2.14.0")
    assert "intqat" in kept and "torch" not in kept, kept  # 2.14.0 stays as it is
    assert plan("2.5.1")["torch"] == "2.14.0"  # out of range: pip brings a supported one


def test_make_installs_the_pinned_development_build(tmp_path):
    """`make test` / `make run` install through constraints.txt, whose torch is the one running here."""
    pins = dict(
        line.split("#")[0].strip().split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line.split("#")[0]
    )
    assert pins["torch"] == "2.13.0"
    import torch

    assert torch.__version__.split("+")[0] == pins["torch"]  # the tests run on the pinned build
    venv = tmp_path / "venv"
    out = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.intqat-installed"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    pip_lines = [line for line in out.splitlines() if "pip install" in line]
    assert pip_lines and all("-c constraints.txt" in line for line in pip_lines), out
    assert not any("torch==" in line for line in pip_lines), out  # the pin lives in constraints.txt only


def test_version_is_pyprojects():
    """intqat.__version__ (intqat/_version.py, what checkpoints and reports record) is pyproject.toml's version."""
    import tomllib

    import intqat

    assert intqat.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
