"""Small conv nets built from Conv2d -> BatchNorm2d -> ReLU blocks.

Conv and BatchNorm sit next to each other inside an nn.Sequential, which is the pattern
`intqat.prepare_qat` folds (the BN moves into the fake-quant conv); the convs have no bias
because the BN that follows would cancel it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["SmallCNN", "Cifar10CNN", "conv_bn_relu"]


def conv_bn_relu(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]


class _ConvClassifier(nn.Module):
    """features (conv stages) -> global average pool -> Linear head."""

    features: nn.Module
    head: nn.Module

    def forward(self, x: Tensor, return_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        features = self.features(x).mean(dim=(2, 3))  # (N, C): global average pool
        logits = self.head(features)
        return (logits, features) if return_features else logits


class SmallCNN(_ConvClassifier):
    """One conv-BN-ReLU + 2x2 max-pool block per entry of `channels`; 8x8 digits -> 2x2 after two."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, channels: Sequence[int] = (16, 32)):
        super().__init__()
        blocks, c_in = [], in_channels
        for c in (int(c) for c in channels):
            blocks.append(nn.Sequential(*conv_bn_relu(c_in, c), nn.MaxPool2d(2)))
            c_in = c
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)


class Cifar10CNN(_ConvClassifier):
    """A VGG-style net for 3x32x32: per stage two conv-BN-ReLU then a 2x2 max-pool (32 -> 16 -> 8 -> 4)."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, channels: Sequence[int] = (32, 64, 128), dropout: float = 0.1
    ):
        super().__init__()
        stages, c_in = [], in_channels
        for c in (int(c) for c in channels):
            stages.append(nn.Sequential(*conv_bn_relu(c_in, c), *conv_bn_relu(c, c), nn.MaxPool2d(2)))
            c_in = c
        self.features = nn.Sequential(*stages)
        head = nn.Linear(c_in, num_classes)
        self.head = nn.Sequential(nn.Dropout(dropout), head) if dropout > 0 else head
