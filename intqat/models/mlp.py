"""A multilayer perceptron for small images: flatten, (Linear, ReLU) per hidden width, Linear head."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """MLP(in_features=64, hidden=(128, 128), num_classes=10); flattens (N, C, H, W) inputs itself.

    forward(x, return_features=True) returns (logits, features of the last hidden layer).
    """

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128, 128), num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        hidden = [int(h) for h in hidden]  # Hydra hands over a ListConfig
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor, return_features: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        features = self.features(x)
        logits = self.head(features)
        return (logits, features) if return_features else logits
