"""Test-wide set-up.

TRITON_INTERPRET must be set before triton is first imported: it lets the Triton kernels run on
CPU tensors (the interpreter), which is how this suite checks them on a machine without a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
