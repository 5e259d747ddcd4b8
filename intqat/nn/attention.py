"""Quantized nn.MultiheadAttention: its input and output projections run as fake-quant / integer /
deployed linear layers; everything between them (heads, masks, bias_k / bias_v, zero attention,
softmax, dropout, head averaging) is computed as torch's F.multi_head_attention_forward does, in float.

FakeQuantMultiheadAttention  projections F.linear(fq(x), fq(W)).
IntMultiheadAttention        projections through intqat::int_linear (int8 codes, int32 accumulation).
DeployedIntMultiheadAttention  int8 weight buffers, one DeployedIntLinear per projection GEMM (export).

The module keeps the MHA's own Parameters under their own names (`in_proj_weight` or `q_proj_weight` /
`k_proj_weight` / `v_proj_weight`, `in_proj_bias`, `bias_k`, `bias_v`, `out_proj.weight`, `out_proj.bias`):
the same objects (optimizer state survives) and the same state_dict keys, plus the quantizers.

The in-projection follows F._in_projection_packed's data flow: one GEMM per distinct input tensor, each
input with its own activation quantizer (packed weight: rows [0:E] query, [E:2E] key, [2E:3E] value):
    query is key is value   query @ in_proj_weight[0:3E]ᵀ                   (q quantizer)  self-attention
    key is value            query @ rows [0:E]ᵀ (q),  key @ rows [E:3E]ᵀ (k)                  cross-attention
    otherwise               query, key, value each with their rows / weight (q, k, v quantizers)
Each output row of a GEMM depends only on its own weight row, scale and bias, so the packed GEMM is the
three separate ones concatenated, bit for bit. A quantizer that never saw data (the k quantizer of a layer
only ever run as self-attention) makes a later cross-attention call fail with a message naming it.

No fast path: these modules are not nn.MultiheadAttention, so torch's native MHA kernel (which reads
in_proj_weight directly) is never taken; intqat.convert also turns off TransformerEncoderLayer's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn import eager_step
from intqat.nn.linear import DeployedIntLinear, FakeQuantLinear, IntLinear
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer
from intqat.ops.int_linear import int_linear, quantize_weight, rounded_zero_point

__all__ = ["FakeQuantMultiheadAttention", "IntMultiheadAttention", "DeployedIntMultiheadAttention", "mha_forward"]

_SHAPE = ("embed_dim", "kdim", "vdim", "_qkv_same_embed_dim", "num_heads", "dropout", "batch_first", "head_dim",
          "add_zero_attn")
_ROLES = ("q", "k", "v")
# IntMultiheadAttention._parts: the names it reads from nn.Module's dicts, by projection group ("q", "k", "v", "kv",
# "qkv": the first letter names the input quantizer)
_PROJ_WEIGHT = {g: f"{g}_proj_weight" for g in _ROLES}
_PROJ_QUANTIZER = {g: f"{g}_proj_weight_quantizer" for g in _ROLES}
_INPUT_QUANTIZER = {g: f"{g}_input_quantizer" for g in _ROLES}
_PARTS = ("in_proj_weight", "in_proj_bias", "out_proj", "in_proj_weight_quantizer",
          *_PROJ_WEIGHT.values(), *_PROJ_QUANTIZER.values(), *_INPUT_QUANTIZER.values())
_PLAIN_TYPES: dict[type, bool] = {}  # class -> none of _PARTS is a class attribute


def _groups(query: Tensor, key: Tensor, value: Tensor, packed: bool, E: int) -> list[tuple[str, Tensor, str, slice]]:
    """(group name, input, quantizer role, weight rows) for each in-projection GEMM; see the module docstring."""
    if packed and key is value and query is key:
        return [("qkv", query, "q", slice(0, 3 * E))]
    if packed and key is value:
        return [("q", query, "q", slice(0, E)), ("kv", key, "k", slice(E, 3 * E))]
    return [(r, x, r, slice(i * E, (i + 1) * E)) for i, (r, x) in enumerate(zip(_ROLES, (query, key, value)))]


def _split(outs: dict[str, Tensor], E: int) -> tuple[Tensor, Tensor, Tensor]:
    """GEMM outputs by group -> (q, k, v), laid out as F._in_projection_packed leaves them."""
    if "qkv" in outs:
        p = outs["qkv"].unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        return p[0], p[1], p[2]
    if "kv" in outs:
        p = outs["kv"].unflatten(-1, (2, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
        return outs["q"], p[0], p[1]
    return outs["q"], outs["k"], outs["v"]


def mha_forward(m: nn.Module, project, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Tensor | None = None, need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    """nn.MultiheadAttention.forward's slow path with the projections given: `project(group, x, rows)` -> x
    through that in-projection GEMM, `m.out_proj` the output projection. m carries MHA's attributes."""
    is_batched = query.dim() == 3
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                  target_type=query.dtype, check_other=False)
    if m.batch_first and is_batched:  # keep the identities the in-projection's data flow depends on
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
            else:
                query, key = (x.transpose(1, 0) for x in (query, key))
                value = key
        else:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    out, weights = _attention(m, project, query, key, value, key_padding_mask, need_weights, attn_mask,
                              average_attn_weights, is_causal)
    if m.batch_first and is_batched:
        return out.transpose(1, 0), weights
    return out, weights


def _attention(m, project, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
               is_causal):
    """F.multi_head_attention_forward (torch 2.13), in-projection and out-projection replaced."""
    num_heads, E = m.num_heads, m.embed_dim
    is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask, num_heads)
    if not is_batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                         other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                         target_type=query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                           "method `generate_square_subsequent_mask` to create this mask.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
    else:
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        if key_padding_mask is not None:
            is_causal = False
    if embed_dim != E:
        raise AssertionError(f"was expecting embedding dimension of {E}, but got {embed_dim}")
    head_dim = E // num_heads
    if m._qkv_same_embed_dim and key.shape != value.shape:
        raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
    if not m._qkv_same_embed_dim and key.shape[:2] != value.shape[:2]:
        raise AssertionError(f"key's sequence and batch dims {key.shape[:2]} do not match value's {value.shape[:2]}")

    outs = {g: project(g, x, rows) for g, x, _, rows in _groups(query, key, value, m._qkv_same_embed_dim, E)}
    q, k, v = _split(outs, E)

    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(tgt_len, src_len)}.")
            attn_mask = attn_mask.unsqueeze(0)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (bsz * num_heads, tgt_len, src_len):
                raise RuntimeError(f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                                   f"{(bsz * num_heads, tgt_len, src_len)}.")
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
    if m.bias_k is not None and m.bias_v is not None:
        k = torch.cat([k, m.bias_k.repeat(1, bsz, 1)])
        v = torch.cat([v, m.bias_v.repeat(1, bsz, 1)])
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    q = q.view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    if m.add_zero_attn:
        zeros = (bsz * num_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zeros, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zeros, dtype=v.dtype, device=v.device)], dim=1)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, 1))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1))
    src_len = k.size(1)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(f"expecting key_padding_mask shape of {(bsz, src_len)}, but got "
                                 f"{key_padding_mask.shape}")
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                            .reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    dropout_p = m.dropout if m.training else 0.0

    if need_weights:
        _B, _Nt, Eh = q.shape
        q_scaled = q * math.sqrt(1.0 / float(Eh))
        if is_causal and attn_mask is None:
            # torch's own F.multi_head_attention_forward refuses this combination the same way (it raises
            # AssertionError "FIXME: is_causal not implemented for need_weights"): same semantics, clearer words
            raise AssertionError("MultiheadAttention: is_causal=True needs attn_mask when need_weights=True "
                                 "(torch's nn.MultiheadAttention refuses it too); pass the causal attn_mask")
        if attn_mask is not None:
            weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            weights = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        out = m.out_proj(out).view(tgt_len, bsz, -1)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            out, weights = out.squeeze(1), weights.squeeze(0)
        return out, weights
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
    out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
    out = m.out_proj(out).view(tgt_len, bsz, -1)
    if not is_batched:
        out = out.squeeze(1)
    return out, None


class _QuantMHABase(nn.Module):
    """MHA's attributes and Parameters (same objects, same names), the quantizers, and forward."""

    def _take(self, mha: nn.Module) -> None:
        for name in _SHAPE:
            setattr(self, name, getattr(mha, name))
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"):
            self.register_parameter(name, getattr(mha, name))
        self.bias_k, self.bias_v = mha.bias_k, mha.bias_v

    def _weight(self, group: str) -> tuple[Tensor, str, slice | None]:
        """(the Parameter a group's GEMM reads, its weight quantizer's name, rows of it; None: all)."""
        if self._qkv_same_embed_dim:
            return self.in_proj_weight, "in_proj_weight_quantizer", None
        return getattr(self, f"{group}_proj_weight"), f"{group}_proj_weight_quantizer", slice(None)

    def _bias(self, rows: slice) -> Tensor | None:
        return None if self.in_proj_bias is None else self.in_proj_bias[rows]

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        """nn.MultiheadAttention.forward's signature and semantics."""
        return mha_forward(self, self._project, query, key, value, key_padding_mask, need_weights, attn_mask,
                           average_attn_weights, is_causal)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}, packed={self._qkv_same_embed_dim}")


class FakeQuantMultiheadAttention(_QuantMHABase):
    """The fake-quant stage: projections F.linear(fq(x), fq(W[rows]), b[rows])."""

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention, config: QuantConfig | str | dict = "w8a8") -> "FakeQuantMultiheadAttention":
        config = resolve_config(config)
        dev = mha.out_proj.weight.device
        mod = cls()
        mod._take(mha)
        for r in _ROLES:
            setattr(mod, f"{r}_input_quantizer", ActivationQuantizer(config.activation).to(dev))
        if mha._qkv_same_embed_dim:
            mod.in_proj_weight_quantizer = WeightQuantizer(config.weight, mha.in_proj_weight).to(dev)
        else:
            for r in _ROLES:
                w = getattr(mha, f"{r}_proj_weight")
                setattr(mod, f"{r}_proj_weight_quantizer", WeightQuantizer(config.weight, w).to(dev))
        mod.out_proj = FakeQuantLinear.from_linear(mha.out_proj, config)
        return mod

    def _project(self, group: str, x: Tensor, rows: slice) -> Tensor:
        w, wq_name, w_rows = self._weight(group)
        aq = getattr(self, f"{group[0]}_input_quantizer")
        w_hat = getattr(self, wq_name).fake_quant(w)  # per-channel rows: quantizing all, then slicing, is the same
        return F.linear(aq.fake_quant(x), w_hat[rows if w_rows is None else w_rows], self._bias(rows))


class IntMultiheadAttention(_QuantMHABase):
    """The integer stage: each projection GEMM is intqat::int_linear on the weight rows it reads."""

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantMultiheadAttention) -> "IntMultiheadAttention":
        mod = cls()
        mod._take(fq)
        for name, child in fq.named_children():
            if name != "out_proj":
                setattr(mod, name, child)
        mod.out_proj = IntLinear.from_fake_quant(fq.out_proj)
        return mod

    def _parts(self, group: str) -> tuple:
        """(weight Parameter, its quantizer's name, rows or None, input quantizer, weight quantizer, in_proj_bias,
        out_proj) of a projection, read from nn.Module's own dicts where the class defines none of these names
        (each nn.Module.__getattr__ read ~0.5 us, Zen 4; six a projection: _QuantLinearBase._parts says why)."""
        cls = type(self)
        plain = _PLAIN_TYPES.get(cls)
        if plain is None:
            plain = _PLAIN_TYPES[cls] = not any(hasattr(cls, n) for n in _PARTS)
        if plain:
            d = self.__dict__
            p, m = d["_parameters"], d["_modules"]
            try:
                if self._qkv_same_embed_dim:
                    w, wq_name, w_rows = p["in_proj_weight"], "in_proj_weight_quantizer", None
                else:
                    w, wq_name, w_rows = p[_PROJ_WEIGHT[group]], _PROJ_QUANTIZER[group], slice(None)
                return (w, wq_name, w_rows, m[_INPUT_QUANTIZER[group[0]]], m[wq_name], p["in_proj_bias"],
                        m["out_proj"])
            except KeyError:
                pass
        w, wq_name, w_rows = self._weight(group)
        return (w, wq_name, w_rows, getattr(self, f"{group[0]}_input_quantizer"), getattr(self, wq_name),
                self.in_proj_bias, self.out_proj)

    def _project(self, group: str, x: Tensor, rows: slice) -> Tensor:
        w, wq_name, w_rows, aq, wq, in_proj_bias, out_proj = self._parts(group)
        rows_w = rows if w_rows is None else w_rows
        whole = rows_w == slice(None) or rows_w == slice(0, w.shape[0])  # no slice: no scatter of the gradient
        if whole and self._qkv_same_embed_dim:
            bias = in_proj_bias
        else:  # (_bias)
            bias = None if in_proj_bias is None else in_proj_bias[rows]
        minmax_w = wq.scale is None and wq.per_channel
        if minmax_w:  # (the path below calls the op too, grad or not)
            # as IntLinear: the observer and the C++ step in one op call (eager_step.fused_linear), or the path below
            y = eager_step.fused_linear(self, group, x, w if whole else w[rows_w], bias, aq, wq.qmin, wq.qmax,
                                        out_proj.grad_gemm)
            if y is not None:
                return y
        aq.integer_input(x)  # as IntLinear: observes (while observing), refuses NaN / inf in training, checks the scale
        # min-max per-channel scales: the op computes them per row, the same numbers as for the whole weight
        w_scale = None if minmax_w else wq.channel_scale(w)[rows_w]
        if w_scale is None:  # the C++ step, decided once per input shape (eager_step.py); else int_linear's path
            y = eager_step.linear_step(self, group, x, w if whole else w[rows_w], bias, aq, wq.qmin, wq.qmax,
                                       self.out_proj.grad_gemm)
            if y is not None:
                return y
        return int_linear(x, w if whole else w[rows_w], bias, aq.scale, aq.zero_point, w_scale,
                          x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax, x_dynamic=aq.dynamic,
                          w_clip_mask=wq.scale is not None, grad_gemm=self.out_proj.grad_gemm)

    @torch.no_grad()
    def to_deployed(self) -> "DeployedIntMultiheadAttention":
        """One DeployedIntLinear per in-projection GEMM whose input quantizer has a scale, and out_proj."""
        E = self.embed_dim
        groups = {"qkv": slice(0, 3 * E), "q": slice(0, E), "kv": slice(E, 3 * E), "k": slice(E, 2 * E),
                  "v": slice(2 * E, 3 * E)} if self._qkv_same_embed_dim else {r: None for r in _ROLES}
        projections = {}
        for g, rows in groups.items():
            aq = getattr(self, f"{g[0]}_input_quantizer")
            if not (aq.dynamic or aq._initialized or aq.spec.learnable):
                continue  # this input never reached the layer: no scale to deploy with
            w, wq_name, w_rows = self._weight(g)
            bias_rows = rows if rows is not None else slice(_ROLES.index(g) * E, (_ROLES.index(g) + 1) * E)
            projections[g] = _deploy_rows(w, self._bias(bias_rows), aq, getattr(self, wq_name),
                                          rows if w_rows is None else w_rows)
        return DeployedIntMultiheadAttention(self, projections, self.out_proj.to_deployed())


def _deploy_rows(w: Tensor, bias: Tensor | None, aq: ActivationQuantizer, wq: WeightQuantizer,
                 rows: slice) -> DeployedIntLinear:
    """DeployedIntLinear for rows of w: what IntLinear.to_deployed makes, with the whole weight's scales."""
    w_scale = wq.channel_scale(w).detach()[rows].contiguous().clone()
    q_w = quantize_weight(w.detach()[rows], w_scale, wq.qmin, wq.qmax)[0]
    z_x = torch.zeros(1, dtype=torch.int32) if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
    return DeployedIntLinear(q_w=q_w, w_scale=w_scale, bias=None if bias is None else bias.detach().clone(),
                             x_scale=aq.scale.detach().clone(), x_zero_point=z_x.to(q_w.device),
                             x_qmin=aq.qmin, x_qmax=aq.qmax, x_dynamic=aq.dynamic)


class DeployedIntMultiheadAttention(nn.Module):
    """Inference-only integer MHA: `in_proj_<group>` DeployedIntLinear per GEMM, `out_proj`, the same float
    attention between them. What torch.export packages: the GEMMs are aten._int_mm."""

    # nn.MultiheadAttention's attribute, which TransformerEncoderLayer's fast-path checks read before any
    # other: the biases live in the in_proj GEMMs here (and None keeps that path off too)
    in_proj_bias = None

    def __init__(self, src: _QuantMHABase, projections: dict[str, DeployedIntLinear], out_proj: DeployedIntLinear):
        super().__init__()
        for name in _SHAPE:
            setattr(self, name, getattr(src, name))
        for name in ("bias_k", "bias_v"):
            t = getattr(src, name)
            self.register_buffer(name, None if t is None else t.detach().clone())
        self.in_proj = nn.ModuleDict(projections)
        self.out_proj = out_proj

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
        return mha_forward(self, self._project, query, key, value, key_padding_mask, need_weights, attn_mask,
                           average_attn_weights, is_causal)

    def _project(self, group: str, x: Tensor, rows: slice) -> Tensor:
        if group not in self.in_proj:
            raise RuntimeError(
                f"this attention's {group[0]}_input_quantizer had no scale when it was deployed (its input never "
                f"reached the layer in training or calibration: e.g. only self-attention ran), so the "
                f"'{group}' projection was not deployed; calibrate with the inputs it is called with"
            )
        return self.in_proj[group](x)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
