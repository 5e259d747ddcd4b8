"""Small versions of the model families intqat must handle (no torchvision / timm here: written out),
shared by tests/test_real_models.py and the `intqat-bench modules` blocks' tests.

ResNet-style   BasicBlock with conv1/bn1/conv2/bn2 attributes and a downsample Sequential (the BN pairs
               are not nn.Sequential neighbours: only a data-flow trace finds them).
MobileNet-V2   inverted residuals: 1x1 expand, 3x3 depthwise, 1x1 project, BN after each, ReLU6(inplace=True),
               down to a 1x1 feature map (the in-place-after-view case).
ViT-style      patch-embedding conv, cls token, pre-norm blocks of nn.MultiheadAttention + MLP.
GPT-2 / BERT   transformers' own classes from tiny configs, random init (no download).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def conv_bn_relu6(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers = [conv_bn_relu6(cin, hidden, 1)] if expand != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class TinyMobileNetV2(nn.Module):
    """16x16 input -> 1x1 after four stride-2 stages: the last blocks run on 1x1 maps."""

    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            conv_bn_relu6(3, w, 3, 2),                                          # 8x8
            InvertedResidual(w, w, 1, 1),
            InvertedResidual(w, 2 * w, 2, 6), InvertedResidual(2 * w, 2 * w, 1, 6),  # 4x4
            InvertedResidual(2 * w, 3 * w, 2, 6),                               # 2x2
            InvertedResidual(3 * w, 4 * w, 2, 6), InvertedResidual(4 * w, 4 * w, 1, 6),  # 1x1
            conv_bn_relu6(4 * w, 8 * w, 1),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(8 * w, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, classes: int = 10, dim: int = 32, depth: int = 2, patch: int = 4, image: int = 16):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, 4, 2 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class HFLogits(nn.Module):
    """A transformers model as logits = f(input_ids): one tensor in, one out (what export and a loss take)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False) if hasattr(self.model.config, "use_cache") else \
            self.model(input_ids=input_ids)
        return out.logits


def tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return HFLogits(GPT2LMHeadModel(cfg))


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=4)
    return HFLogits(BertForSequenceClassification(cfg))
