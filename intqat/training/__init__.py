"""Lightning training pieces: the classification LightningModule and the run report."""

from intqat.training.lit_module import ClassificationModule
from intqat.training.report import write_report

__all__ = ["ClassificationModule", "write_report"]
