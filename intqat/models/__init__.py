"""Models for the recipes. Every forward takes keyword arguments (`return_features=True`)."""

from intqat.models.cnn import Cifar10CNN, SmallCNN
from intqat.models.gpt import GPT
from intqat.models.mlp import MLP

__all__ = ["MLP", "SmallCNN", "Cifar10CNN", "GPT"]
