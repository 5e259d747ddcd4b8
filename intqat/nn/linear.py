"""Quantized linear layers, all holding the very same `weight` / `bias` Parameters as the nn.Linear
they replace (an optimizer built before a swap keeps its state):

FakeQuantLinear    fp32 simulation: F.linear(fq(x), fq(W)) with STE / LSQ gradients.
IntLinear          the integer layer: int8 codes, int32 int_mm, float epilogue, in training and eval.
DeployedIntLinear  frozen for export: int8 weight codes stored as buffers, no fp32 weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer
from intqat.ops.int_linear import (
    int_linear,
    integer_epilogue,
    quantize_activation,
    quantize_weight,
    rounded_zero_point,
)
from intqat.ops.int_mm import int_mm

__all__ = ["FakeQuantLinear", "IntLinear", "DeployedIntLinear"]


class _QuantLinearBase(nn.Module):
    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, input_quantizer, weight_quantizer):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.input_quantizer = input_quantizer
        self.weight_quantizer = weight_quantizer

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def to_linear(self) -> nn.Linear:
        """Back to a float nn.Linear sharing the same Parameters."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight, lin.bias = self.weight, self.bias
        return lin


class FakeQuantLinear(_QuantLinearBase):
    """y = F.linear(fq(x), fq(W), b): the fake-quant stage that warms up scales."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: QuantConfig | str | dict = "w8a8") -> "FakeQuantLinear":
        config = resolve_config(config)
        return cls(
            linear.weight,
            linear.bias,
            ActivationQuantizer(config.activation).to(linear.weight.device),
            WeightQuantizer(config.weight, linear.weight).to(linear.weight.device),
        )

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.input_quantizer.fake_quant(x), self.weight_quantizer.fake_quant(self.weight), self.bias)


class IntLinear(_QuantLinearBase):
    """The integer layer. Training: the differentiable `intqat::int_linear` op. Eval: the same
    functions composed of aten ops (portable through torch.export), so both give the same bits."""

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantLinear) -> "IntLinear":
        return cls(fq.weight, fq.bias, fq.input_quantizer, fq.weight_quantizer)

    def _op_args(self):
        aq, wq = self.input_quantizer, self.weight_quantizer
        # a min-max weight scale (not learned) never clips: no weight mask to keep for backward
        return dict(x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax, x_dynamic=aq.dynamic,
                    w_clip_mask=wq.scale is not None)

    def forward(self, x: Tensor) -> Tensor:
        aq = self.input_quantizer
        if aq.observing:
            aq.observe(x)
        if not aq.dynamic:
            aq._check_ready()
        w_scale = self.weight_quantizer.channel_scale(self.weight)
        # the differentiable op whenever autograd needs it (eval-mode training too); both paths
        # run the same functions, so they give the same bits
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad) and not torch.compiler.is_exporting():
            return int_linear(x, self.weight, self.bias, aq.scale, aq.zero_point, w_scale, **self._op_args())
        return self._integer_forward(x, w_scale)

    def _integer_forward(self, x: Tensor, w_scale: Tensor) -> Tensor:
        """The deploy arithmetic in plain aten ops: exactly what the op's forward runs."""
        aq, wq = self.input_quantizer, self.weight_quantizer
        q_w, _ = quantize_weight(self.weight, w_scale, wq.qmin, wq.qmax)
        if aq.dynamic:
            z_x = torch.zeros(1, dtype=torch.int32, device=x.device)
            w_colsum = torch.zeros(1, dtype=torch.int32, device=x.device)
        else:
            z_x = rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
            w_colsum = q_w.sum(dim=1, dtype=torch.int32)
        return _apply(x, q_w, w_colsum, w_scale.detach(), self.bias, aq.scale, z_x, aq.qmin, aq.qmax, aq.dynamic)

    @torch.no_grad()
    def to_deployed(self) -> "DeployedIntLinear":
        """Freeze: int8 weight codes as buffers (1 byte per weight instead of 4)."""
        aq, wq = self.input_quantizer, self.weight_quantizer
        if not aq.dynamic:
            aq._check_ready()
        w_scale = wq.channel_scale(self.weight).detach().contiguous().clone()
        q_w, _ = quantize_weight(self.weight, w_scale, wq.qmin, wq.qmax)
        z_x = torch.zeros(1, dtype=torch.int32) if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        return DeployedIntLinear(
            q_w=q_w,
            w_scale=w_scale,
            bias=None if self.bias is None else self.bias.detach().clone(),
            x_scale=aq.scale.detach().clone(),
            x_zero_point=z_x.to(q_w.device),
            x_qmin=aq.qmin,
            x_qmax=aq.qmax,
            x_dynamic=aq.dynamic,
        )


def _apply(x, q_w, w_colsum, w_scale, bias, x_scale, z_x, x_qmin, x_qmax, x_dynamic) -> Tensor:
    """x (..., K) -> y (..., N) through int8 codes; shared by IntLinear (eval) and DeployedIntLinear."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(torch.float32)
    q_x, _, s_x = quantize_activation(x2d, x_scale, z_x, x_qmin, x_qmax, x_dynamic, need_mask=False)
    acc = int_mm(q_x, q_w.t())
    y = integer_epilogue(acc, z_x, w_colsum, s_x, w_scale, None if bias is None else bias.detach())
    return y.reshape(*lead, q_w.shape[0])


class DeployedIntLinear(nn.Module):
    """Inference-only integer linear layer with int8 weights: what `torch.export` packages."""

    def __init__(self, q_w, w_scale, bias, x_scale, x_zero_point, x_qmin, x_qmax, x_dynamic):
        super().__init__()
        self.out_features, self.in_features = q_w.shape
        self.register_buffer("q_w", q_w)  # (N, K) int8
        self.register_buffer("w_colsum", q_w.sum(dim=1, dtype=torch.int32))  # (N,) int32
        self.register_buffer("w_scale", w_scale.to(torch.float32).contiguous())  # (N,)
        self.register_buffer("bias", bias)
        self.register_buffer("x_scale", x_scale.to(torch.float32).reshape(1))
        self.register_buffer("x_zero_point", x_zero_point.to(torch.int32).reshape(1))
        self.x_qmin, self.x_qmax, self.x_dynamic = x_qmin, x_qmax, x_dynamic

    def forward(self, x: Tensor) -> Tensor:
        colsum = torch.zeros_like(self.w_colsum[:1]) if self.x_dynamic else self.w_colsum
        return _apply(
            x, self.q_w, colsum, self.w_scale, self.bias, self.x_scale, self.x_zero_point,
            self.x_qmin, self.x_qmax, self.x_dynamic,
        )

    def extra_repr(self) -> str:
        kind = "dynamic per-token" if self.x_dynamic else "static"
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={kind}"
