"""Forward/backward graphs of a training step: capture, summarize, deduplicate, validate.

.. code-block:: python

    from intqat.graphs import dedupe, extract, save_groups, validate

    captures = {name: extract(stage, (x,), train=True) for name, (stage, x) in stages.items()}
    save_groups(dedupe(captures), "outputs/graphs")   # one directory per distinct graph
    for name, capture in captures.items():
        print(name, capture.summary.to_text(), sep="\n")
    print(validate(model, (x,), trials=10, train=True).to_table())
"""

from intqat.graphs.capture import GraphCapture, GraphPair, extract
from intqat.graphs.compare import Diff, compare
from intqat.graphs.dedupe import GraphGroup, dedupe, save_groups
from intqat.graphs.hashing import code_hash, normalize_code
from intqat.graphs.summary import INT_NAMESPACES, GraphSummary, IntegerOp, SavedTensor, SteKernel
from intqat.graphs.validate import TensorReport, ValidationResult, validate

__all__ = [
    "INT_NAMESPACES",
    "Diff",
    "GraphCapture",
    "GraphGroup",
    "GraphPair",
    "GraphSummary",
    "IntegerOp",
    "SavedTensor",
    "SteKernel",
    "TensorReport",
    "ValidationResult",
    "code_hash",
    "compare",
    "dedupe",
    "extract",
    "normalize_code",
    "save_groups",
    "validate",
]
