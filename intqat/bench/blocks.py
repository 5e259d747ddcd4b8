"""The real-model blocks `intqat-bench modules` times beside its MLP and CNN (issue 14):

Encoder   a BERT-tiny-like transformer encoder layer: nn.TransformerEncoderLayer(d_model 128, 2 heads,
          FFN 512, GELU, post-norm, batch_first), batch 8 x sequence 32 = 256 tokens, then mean pooling and
          a linear head (the loss needs (batch, classes)). intqat: integer MHA projections and both FFN layers.
DW-sep    a MobileNet-style depthwise-separable stack on 3x32x32, batch 32: conv3x3 s2 3->32, then two blocks
          of depthwise 3x3 (groups = channels) -> BN -> ReLU6 -> pointwise 1x1 -> BN -> ReLU6 (32->64, 64->128,
          the second with stride 2), average pool, linear head. intqat: every conv integer, BN folded.

Each is timed by every flavour of intqat.bench.modules.FLAVOURS (fp32, intqat fake quant, intqat integer,
torchao QAT, ...): a peer that cannot train a block is reported as such in the table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["block_models", "EncoderClassifier", "make_encoder", "make_dw_separable"]


class EncoderClassifier(nn.Module):
    """x (B, L, d) -> one encoder layer -> mean over L -> linear head (B, classes)."""

    def __init__(self, d_model: int, heads: int, ffn: int, classes: int):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout=0.0, activation="gelu",
                                                batch_first=True)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


def make_encoder(d_model: int = 128, heads: int = 2, ffn: int = 512, classes: int = 10) -> nn.Module:
    return EncoderClassifier(d_model, heads, ffn, classes)


def _dw_block(c_in: int, c_out: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False), nn.BatchNorm2d(c_in), nn.ReLU6(inplace=True),
            nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU6(inplace=True)]


def make_dw_separable(width: int = 32, classes: int = 10) -> nn.Sequential:
    w = width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU6(inplace=True),
        *_dw_block(w, 2 * w, 1), *_dw_block(2 * w, 4 * w, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, classes),
    )


def block_models(s: Any, g: torch.Generator, quick: bool = False) -> list[tuple[str, Any, torch.Tensor]]:
    """(title, model factory, input batch) for the two blocks, in intqat.bench.modules' format."""
    d, ffn, batch, seq = (32, 64, 4, 8) if quick else (128, 512, 8, 32)
    width, hw, cnn_batch = (8, 16, 4) if quick else (32, 32, 32)
    enc_x = torch.randn(batch, seq, d, generator=g)
    dw_x = torch.randn(cnn_batch, 3, hw, hw, generator=g)
    return [
        (f"Encoder layer (BERT-tiny-like) d {d}, 2 heads, FFN {ffn}, batch {batch} x seq {seq}",
         lambda: make_encoder(d, 2, ffn, s.classes), enc_x),
        (f"Depthwise-separable 3x{hw}x{hw}, dw3x3+pw1x1 x 2 ({width}->{2 * width}->{4 * width} ch), batch {cnn_batch}",
         lambda: make_dw_separable(width, s.classes), dw_x),
    ]
