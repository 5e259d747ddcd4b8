"""The deploy formats' packages: a clear error naming the extra when one is missing, before anything is written."""

from __future__ import annotations

import importlib.util

__all__ = ["MissingDeployPackage", "require", "FORMAT_PACKAGES"]

EXTRA = "pip install 'intqat[deploy]'"

# format -> the modules it imports (their PyPI names are in the `deploy` extra of pyproject.toml)
FORMAT_PACKAGES = {
    "pt2": (),
    "pte": ("executorch", "torchao"),
    "onnx": ("onnx", "onnxscript", "onnxruntime", "torchao"),
    "onnx-int": ("onnx", "onnxscript", "onnxruntime"),
}


class MissingDeployPackage(ImportError):
    """A deploy format was asked for without the package it needs."""


def require(fmt: str) -> None:
    """Raise MissingDeployPackage naming the format, the missing modules and the extra, if any is missing."""
    if fmt not in FORMAT_PACKAGES:
        raise ValueError(f"unknown deploy format {fmt!r}; formats: {', '.join(FORMAT_PACKAGES)}")
    missing = [m for m in FORMAT_PACKAGES[fmt] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingDeployPackage(f"the {fmt!r} format needs {', '.join(missing)}, not installed here: {EXTRA}")
