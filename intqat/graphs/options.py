"""What one intqat-graphs run captures and validates (the command line parses into GraphsOptions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GraphsOptions", "STAGES", "MODEL_KEY"]

STAGES = ("float", "fake_quant", "integer")
MODEL_KEY = "<model>"  # the whole model's entry among a stage's layers in index.tsv


@dataclass
class GraphsOptions:
    recipe: str | None = None
    checkpoint: Path | None = None
    out: Path | None = None
    trials: int = 10
    stages: tuple[str, ...] = STAGES
    layers: bool = True
    calib_batches: int = 3
    backend: str = "inductor"
    rtol: float = 1e-5
    atol: float = 1e-5
    verbose: bool = False
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of the recipe
