"""The real-model blocks `intqat-bench modules` times beside its MLP and CNN (issues 14 and 27), written out here
(no torchvision / timm / transformers): each is one or two blocks of a model family between a small stem and a
classification head, so the loss needs (batch, classes).

Encoder   a BERT-tiny-like transformer encoder layer: nn.TransformerEncoderLayer(d_model 128, 2 heads,
          FFN 512, GELU, post-norm, batch_first), batch 8 x sequence 32 = 256 tokens, then mean pooling and
          a linear head (the loss needs (batch, classes)). intqat: integer MHA projections and both FFN layers.
DW-sep    a MobileNet-style depthwise-separable stack on 3x32x32, batch 32: conv3x3 s2 3->32, then two blocks
          of depthwise 3x3 (groups = channels) -> BN -> ReLU6 -> pointwise 1x1 -> BN -> ReLU6 (32->64, 64->128,
          the second with stride 2), average pool, linear head. intqat: every conv integer, BN folded.
ResNet    ResNet-18's first stages: stem conv3x3 s2 3->64 + BN + ReLU on 3x32x32, a BasicBlock 64->64 and a
          BasicBlock 64->128 (stride 2, 1x1 downsample), batch 16. Regular 3x3 convs: the GEMM-bound case.
MBConv    EfficientNet-B0's inverted residual with squeeze-excitation: stem 3->32 s2, then two MBConv blocks
          (1x1 expand x4, depthwise 3x3, SE: pool -> 1x1 conv -> SiLU -> 1x1 conv -> sigmoid -> scale, 1x1
          project, residual where shapes allow), batch 16. Many small layers: the per-layer-overhead case.
ConvNeXt  a ConvNeXt block: patchify stem conv4x4 s4 3->96 + LayerNorm, then depthwise 7x7 -> LayerNorm ->
          Linear 96->384 -> GELU -> Linear 384->96 -> layer scale -> residual, twice; batch 16 on 3x32x32.
Llama     a Llama-style decoder block under 8da4w (per-group int4 weights, group 32; per-token int8
          activations): RMSNorm, causal attention with grouped-query heads (4 query, 2 key/value heads, d 256),
          RMSNorm, SwiGLU MLP (hidden 768: 2/3 of 4d rounded up to a multiple of 256, as Llama sizes it);
          batch 4 x sequence 32 = 128 tokens. intqat: the seven linear
          layers as per-group integer layers; torchao QAT: int4 per-group weights, int8 per-token activations.

`python -m intqat.bench.blocks` times intqat.export_mixed_precision of a full-size MobileNet-V2 (torchvision's
architecture, written out here: 52 convs, 17 of them depthwise) after prepare_qat / calibrate / to_integer.

Each block is timed by every flavour of intqat.bench.modules.FLAVOURS (fp32, intqat fake quant, intqat integer,
torchao QAT, ...): a peer that cannot train a block is reported as such in the table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["block_models", "BLOCKS", "EncoderClassifier", "make_encoder", "make_dw_separable", "make_mobilenet_v2",
           "make_resnet_blocks", "make_mbconv", "make_convnext", "make_llama_block", "export_seconds"]


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


class BasicBlock(nn.Module):
    """ResNet's basic block: conv3x3-BN-ReLU-conv3x3-BN + identity (or a 1x1 conv-BN downsample), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


def make_resnet_blocks(width: int = 64, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         BasicBlock(width, width), BasicBlock(width, 2 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))


class SqueezeExcite(nn.Module):
    """EfficientNet's SE: x * sigmoid(conv1x1(silu(conv1x1(mean over H, W)))), (B, C, 1, 1) in the middle."""

    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(s))))


class MBConv(nn.Module):
    """EfficientNet's inverted residual: 1x1 expand-BN-SiLU, depthwise kxk-BN-SiLU, SE, 1x1 project-BN."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, expand: int = 4, k: int = 3):
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(hidden, hidden, k, stride, k // 2, groups=hidden, bias=False),
                                nn.BatchNorm2d(hidden), nn.SiLU())
        self.se = SqueezeExcite(hidden, max(1, c_in // 4))
        self.project = nn.Sequential(nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.project(self.se(self.dw(self.expand(x))))
        return x + out if self.use_res else out


def make_mbconv(width: int = 32, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.SiLU(),
                         MBConv(width, width), MBConv(width, 2 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes))


class ChannelsLastNorm(nn.Module):
    """LayerNorm over the channels of a (B, C, H, W) map (ConvNeXt's stem / downsampling norm)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-6)

    def forward(self, x):
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """dwconv7x7 -> (B, H, W, C) -> LayerNorm -> Linear C->4C -> GELU -> Linear 4C->C -> gamma -> (B, C, H, W) + x."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def make_convnext(dim: int = 96, depth: int = 2, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, dim, 4, 4), ChannelsLastNorm(dim), *(ConvNeXtBlock(dim) for _ in range(depth)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, classes))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then h + swiglu(rmsnorm(h)); attention causal with grouped-query heads (GQA:
    each key/value head serves heads / kv_heads query heads). No rotary embedding: it has no weights."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, L, D = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        x = x + self.wo(a)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaClassifier(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, classes: int):
        super().__init__()
        self.block = LlamaBlock(dim, heads, kv_heads, hidden)
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.norm(self.block(x)).mean(dim=1))


def make_llama_block(dim: int = 256, heads: int = 4, kv_heads: int = 2, hidden: int = 768,
                     classes: int = 10) -> nn.Module:
    return LlamaClassifier(dim, heads, kv_heads, hidden, classes)


# name -> (title, model factory (classes) -> nn.Module, input shape, preset), full size and quick (smoke) size
BLOCKS: dict[str, tuple] = {
    "encoder": (lambda q: f"Encoder layer (BERT-tiny-like) d {32 if q else 128}, 2 heads, FFN {64 if q else 512}, "
                          f"batch {4 if q else 8} x seq {8 if q else 32}",
                lambda q, c: make_encoder(32 if q else 128, 2, 64 if q else 512, c),
                lambda q: (4, 8, 32) if q else (8, 32, 128), "w8a8"),
    "dwsep": (lambda q: f"Depthwise-separable 3x{16 if q else 32}x{16 if q else 32}, dw3x3+pw1x1 x 2 "
                        f"({8 if q else 32}->{16 if q else 64}->{32 if q else 128} ch), batch {4 if q else 32}",
              lambda q, c: make_dw_separable(8 if q else 32, c),
              lambda q: (4, 3, 16, 16) if q else (32, 3, 32, 32), "w8a8"),
    "resnet": (lambda q: f"ResNet basic blocks 3x32x32, stem s2 + BasicBlock {8 if q else 64}->{8 if q else 64} "
                         f"+ BasicBlock ->{16 if q else 128} s2, batch {4 if q else 16}",
               lambda q, c: make_resnet_blocks(8 if q else 64, c),
               lambda q: (4, 3, 16, 16) if q else (16, 3, 32, 32), "w8a8"),
    "mbconv": (lambda q: f"MBConv+SE (EfficientNet) 3x32x32, stem s2 + MBConv x4 {8 if q else 32}->"
                         f"{8 if q else 32} + MBConv ->{16 if q else 64} s2, batch {4 if q else 16}",
               lambda q, c: make_mbconv(8 if q else 32, c),
               lambda q: (4, 3, 16, 16) if q else (16, 3, 32, 32), "w8a8"),
    "convnext": (lambda q: f"ConvNeXt blocks 3x32x32, patchify s4 + 2 x (dw7x7, LN, MLP x4) d {16 if q else 96}, "
                           f"batch {4 if q else 16}",
                 lambda q, c: make_convnext(16 if q else 96, 2, c),
                 lambda q: (4, 3, 16, 16) if q else (16, 3, 32, 32), "w8a8"),
    "llama": (lambda q: f"Llama block 8da4w (GQA 4q/2kv heads, SwiGLU) d {64 if q else 256}, "
                        f"batch {2 if q else 4} x seq {8 if q else 32}",
              lambda q, c: make_llama_block(64 if q else 256, 4, 2, 160 if q else 768, c),
              lambda q: (2, 8, 64) if q else (4, 32, 256), "8da4w"),
}


def block_models(s: Any, g: torch.Generator, quick: bool = False,
                 names: tuple[str, ...] = ("encoder", "dwsep")) -> list[tuple[str, Any, torch.Tensor, str]]:
    """(title, model factory, input batch, preset) for the named blocks (BLOCKS), in intqat.bench.modules' format."""
    out = []
    for name in names:
        title, make, shape, preset = BLOCKS[name]
        out.append((title(quick), lambda make=make: make(quick, s.classes), torch.randn(*shape(quick), generator=g),
                    preset))
    return out


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
