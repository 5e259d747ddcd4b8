"""Graph identity: sha256 of the graph's code with run- and name-specific noise removed.

Two graphs hash equal when they run the same ops on the same shapes and dtypes, whatever
module they came from and whenever they were traced; that is what lets identical layers
(or identical stages of a recipe's model) share one graph directory.
"""

from __future__ import annotations

import hashlib
import re

import torch

# `<function f at 0x7f..>` and friends: an object's id, different on every run.
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def readable_code(gm: torch.fx.GraphModule) -> str:
    """The code written to forward.py / backward.py: every value annotated with dtype and shape."""
    return gm.print_readable(print_output=False)


def normalize_code(code: str) -> str:
    """Drop what differs between two traces of the same computation.

    Comments hold source locations (`# File: .../model.py:12 in forward`), which differ
    between two classes doing the same math; addresses differ between runs. Shapes and
    dtypes (in the annotations) are kept: a different shape is a different kernel.
    """
    lines = []
    for line in code.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        lines.append(_ADDRESS.sub("0x?", line.rstrip()))
    return "\n".join(lines) + "\n"


def code_hash(*codes: str) -> str:
    """sha256 over the normalized codes, in order (forward then backward for a capture)."""
    digest = hashlib.sha256()
    for code in codes:
        digest.update(normalize_code(code).encode())
        digest.update(b"\0")  # so (a, bc) and (ab, c) differ
    return digest.hexdigest()
