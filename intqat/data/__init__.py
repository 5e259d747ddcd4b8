"""LightningDataModules for the recipes: digits (inside scikit-learn) and CIFAR-10 (local files)."""

from intqat.data.cifar10 import Cifar10DataModule
from intqat.data.digits import DigitsDataModule

__all__ = ["DigitsDataModule", "Cifar10DataModule"]
