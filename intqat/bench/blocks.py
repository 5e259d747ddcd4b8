"""The real-model blocks `intqat-bench modules` times beside its MLP and CNN (issue 14):

Encoder   a BERT-tiny-like transformer encoder layer: nn.TransformerEncoderLayer(d_model 128, 2 heads,
          FFN 512, GELU, post-norm, batch_first), batch 8 x sequence 32 = 256 tokens, then mean pooling and
          a linear head (the loss needs (batch, classes)). intqat: integer MHA projections and both FFN layers.
DW-sep    a MobileNet-style depthwise-separable stack on 3x32x32, batch 32: conv3x3 s2 3->32, then two blocks
          of depthwise 3x3 (groups = channels) -> BN -> ReLU6 -> pointwise 1x1 -> BN -> ReLU6 (32->64, 64->128,
          the second with stride 2), average pool, linear head. intqat: every conv integer, BN folded.

`python -m intqat.bench.blocks` times intqat.export_mixed_precision of a full-size MobileNet-V2 (torchvision's
architecture, written out here: 52 convs, 17 of them depthwise) after prepare_qat / calibrate / to_integer.

Each block is timed by every flavour of intqat.bench.modules.FLAVOURS (fp32, intqat fake quant, intqat integer,
torchao QAT, ...): a peer that cannot train a block is reported as such in the table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["block_models", "EncoderClassifier", "make_encoder", "make_dw_separable", "make_mobilenet_v2",
           "export_seconds"]


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


class _InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True)]
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
                   nn.ReLU6(inplace=True), nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


def make_mobilenet_v2(classes: int = 1000) -> nn.Module:
    """torchvision's mobilenet_v2() (width 1.0): the (expand, channels, repeats, stride) table of the paper."""
    table = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True)]
    c_in = 32
    for t, c, n, stride in table:
        for i in range(n):
            layers.append(_InvertedResidual(c_in, c, stride if i == 0 else 1, t))
            c_in = c
    layers += [nn.Conv2d(c_in, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU6(inplace=True),
               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


def export_seconds(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """prepare_qat, calibrate on x, to_integer, then time export_mixed_precision(model, (x,)) (wall clock, s)."""
    import time

    import intqat

    intqat.prepare_qat(model, "w8a8")
    intqat.calibrate(model, [x])
    intqat.to_integer(model)
    model.eval()
    t0 = time.perf_counter()
    result = intqat.export_mixed_precision(model, (x,))
    seconds = time.perf_counter() - t0
    nodes = result.info["graph_nodes"]
    return {"seconds": seconds, "exported_nodes": nodes["exported"], "tidied_nodes": nodes["tidied"],
            "reference_equals_integer_model": result.validation["reference_equals_integer_model"]}


if __name__ == "__main__":
    torch.manual_seed(0)
    mb = make_mobilenet_v2()
    n_conv = sum(isinstance(m, nn.Conv2d) for m in mb.modules())
    n_dw = sum(isinstance(m, nn.Conv2d) and m.groups > 1 for m in mb.modules())
    print(f"MobileNet-V2: {n_conv} convs ({n_dw} depthwise), input (2, 3, 224, 224):",
          export_seconds(mb, torch.randn(2, 3, 224, 224)))
