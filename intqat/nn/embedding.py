"""Quantized embeddings: int8 / int4 codes per channel (one scale per row) or per group along the
embedding dim, holding the nn.Embedding's own weight Parameter.

FakeQuantEmbedding     F.embedding(idx, fq(W)): STE gradient to W (scales are the min-max of each group).
IntEmbedding           the integer form: the same codes; in eval a gather of codes and scales, then
                       w_hat = float(q_w[idx]) * s_w[idx, g]. Training gathers fq(W) rows, the same
                       bits (dequantization is elementwise, so it commutes with the gather).
DeployedIntEmbedding   codes (V, D) int8 + scales (V, G) as buffers; forward = dequantizing gather
                       (aten index + mul: portable through torch.export).

A lm_head tied to the embedding (the same weight Parameter) stays tied in training, and deployed it
shares the embedding's code and scale buffers when both quantize the weight alike
(intqat.nn.grouped_linear.frozen_group_codes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn.grouped_linear import GroupWeightQuantizer, frozen_group_codes
from intqat.nn.linear import weight_regathered

__all__ = ["FakeQuantEmbedding", "IntEmbedding", "DeployedIntEmbedding"]


class _QuantEmbeddingBase(nn.Module):

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, weight_quantizer: GroupWeightQuantizer):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.weight = weight
        self.padding_idx = padding_idx
        self.weight_quantizer = weight_quantizer

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, config: QuantConfig | str | dict) -> "FakeQuantEmbedding":
        config = resolve_config(config)
        if config.embedding is None:
            raise ValueError("the config has no embedding spec: give e.g. "
                             "{'preset': '8da4w', 'embedding': {'bits': 4, 'granularity': 'group', 'group_size': 32}}")
        unsupported = [k for k in ("max_norm", "sparse", "scale_grad_by_freq") if getattr(emb, k)]
        if unsupported:
            raise ValueError(f"nn.Embedding with {', '.join(unsupported)} is not supported by the quantized embeddings")
        wq = GroupWeightQuantizer(config.embedding, emb.weight).to(emb.weight.device)
        return cls(emb.weight, emb.padding_idx, wq)

    def _fake_quant_forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, self.weight_quantizer.fake_quant(self.weight), self.padding_idx)

    def to_embedding(self) -> nn.Embedding:
        """Back to a float nn.Embedding sharing the same Parameter."""
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, device="meta")
        emb.weight = self.weight
        return emb

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


class FakeQuantEmbedding(_QuantEmbeddingBase):
    """y = F.embedding(idx, fq(W)), fq per channel or per group of the embedding dim (config.embedding)."""

    def forward(self, input: Tensor) -> Tensor:
        return self._fake_quant_forward(input)


class IntEmbedding(_QuantEmbeddingBase):
    """The integer embedding: training gathers fq(W) rows (STE to W); eval gathers the cached codes
    and scales and dequantizes only the rows asked for. Both give the same bits."""

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantEmbedding) -> "IntEmbedding":
        return cls(fq.weight, fq.padding_idx, fq.weight_quantizer)

    def forward(self, input: Tensor) -> Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad and not torch.compiler.is_exporting():
            return self._fake_quant_forward(input)
        q_w, s_w = self._weight_codes()
        return dequantizing_gather(input, q_w, s_w)

    def _weight_codes(self) -> tuple[Tensor, Tensor]:
        # recomputed in traced programs and under FSDP2 (its all-gathers keep the weight's version: see weight_regathered)
        if torch.compiler.is_compiling() or torch.compiler.is_exporting() or weight_regathered(self):
            return self.weight_quantizer.codes(self.weight)
        key = (id(self.weight), self.weight._version)
        cache = self.__dict__.get("_codes_cache")
        if cache is None or cache[0] != key:
            cache = self.__dict__["_codes_cache"] = (key, self.weight_quantizer.codes(self.weight))
        return cache[1]

    @torch.no_grad()
    def to_deployed(self) -> "DeployedIntEmbedding":
        q_w, s_w = frozen_group_codes(self.weight, self.weight_quantizer)
        return DeployedIntEmbedding(q_w, s_w)


def dequantizing_gather(idx: Tensor, q_w: Tensor, s_w: Tensor) -> Tensor:
    """idx (...) int -> (..., D) fp32: float(q_w[idx]) * s_w[idx, g(d)] (one rounding per element)."""
    V, D = q_w.shape
    G = s_w.shape[1]
    q = q_w[idx].to(torch.float32)  # (..., D)
    s = s_w[idx]  # (..., G)
    return (q.reshape(*q.shape[:-1], G, D // G) * s.unsqueeze(-1)).reshape(q.shape)


class DeployedIntEmbedding(nn.Module):
    """Inference-only embedding: int8 codes (V, D) and fp32 scales (V, G); forward gathers and dequantizes."""

    def __init__(self, q_w: Tensor, w_scale: Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q_w.shape
        self.register_buffer("q_w", q_w)
        self.register_buffer("w_scale", w_scale)

    def forward(self, input: Tensor) -> Tensor:
        return dequantizing_gather(input, self.q_w, self.w_scale)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.embedding_dim // self.w_scale.shape[1]}"
