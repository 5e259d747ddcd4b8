"""A small decoder-only transformer (GPT-2 layout, pre-norm) for byte-level language modelling.

    model = GPT(vocab_size=256, context=128, d_model=128, n_layers=4, n_heads=4)
    logits = model(idx)        # idx (B, T) int64 -> (B, T, vocab_size) fp32

Every projection is an nn.Linear (prepare_qat quantizes them: q/k/v in one `qkv`, the attention
output `proj`, the MLP `fc` / `fc2`, and the `lm_head`); attention, softmax, GELU and LayerNorm stay
float (export's autocast pass assigns them bf16 or fp32 by its rules). With tie_embeddings the
lm_head's weight *is* the token embedding's Parameter: quantized, they stay one tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT"]


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)  # each (B, T, D)
        q, k, v = (t.reshape(B, T, h, D // h).transpose(1, 2) for t in (q, k, v))  # (B, h, T, D / h)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT(vocab_size=256, context=128, d_model=128, n_layers=4, n_heads=4, mlp_ratio=4)."""

    def __init__(self, vocab_size: int = 256, context: int = 128, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, mlp_ratio: int = 4, dropout: float = 0.0, tie_embeddings: bool = True):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"GPT(d_model={d_model}, n_heads={n_heads}): d_model must be a multiple of n_heads")
        self.context = context
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if T > self.context:
            raise ValueError(f"GPT: sequence of {T} tokens exceeds the context of {self.context}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
