"""LightningDataModules for the recipes: digits (inside scikit-learn), CIFAR-10 (local files), stdlib text."""

from intqat.data.cifar10 import Cifar10DataModule
from intqat.data.digits import DigitsDataModule
from intqat.data.text import StdlibTextDataModule

__all__ = ["DigitsDataModule", "Cifar10DataModule", "StdlibTextDataModule"]
