"""Test-wide set-up.

TRITON_INTERPRET must be set before triton is first imported: it lets the Triton kernels run on
CPU tensors (the interpreter), which is how this suite checks them on a machine without a GPU.

TORCHINDUCTOR_CACHE_DIR: one inductor cache per version of intqat's source. Inductor's on-disk
cache does not key on a custom op's fake implementation, so a cache written before a change to
intqat's ops (e.g. an output's memory format) hands back compiled code that asserts the old strides
(seen here: "expected size 8==8, stride 1==256" from intqat::int_conv2d). Keyed on the source, a
warm cache still speeds up repeated runs of the same code.
"""

import hashlib
import os
import tempfile
from pathlib import Path


def _source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted([*root.glob("intqat/**/*.py"), *root.glob("kernels/**/*.py"), *root.glob("kernels/**/*.c"), *root.glob("kernels/**/*.cpp"), *root.glob("kernels/**/*.h")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_intqat_{_source_digest()}"))

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_terminal_summary(terminalreporter):
    """Say which backends this machine ran and which it could not: a suite that passes on one CPU
    proves that CPU (tests/test_backends.py checks every runnable backend against the reference)."""
    from intqat.ops import backends
    from intqat.ops.cpu_features import cpu_class, cpu_info

    terminalreporter.write_sep("-", f"intqat backends on this CPU ({cpu_info()[0]}; class: {cpu_class()})")
    for name, needs, reason in backends.summary():
        status = "runs here" if reason is None else f"NOT RUN here: {reason}"
        terminalreporter.write_line(f"  {name:<11} {status}  (needs: {needs})")
    from intqat.ops.backends import self_check

    terminalreporter.write_line("  self-check of the library GEMMs backends rely on (intqat/ops/backends/self_check.py):")
    for gemm, reason, _ in self_check.verdicts():
        status = "exact on its worst cases" if reason is None else f"REFUSED: {reason}"
        terminalreporter.write_line(f"    {gemm.name:<14} {status}  (used by {gemm.users})")
    from intqat.ops import cpp_step

    reason = cpp_step.unavailable_reason()
    status = "runs here" if reason is None else f"NOT RUN here: {reason}"
    terminalreporter.write_line(f"  C++ training ops (int_linear / int_conv2d eager CPU steps and the observer, intqat/ops/cpp_step.py): {status}")
