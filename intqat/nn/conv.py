"""Quantized Conv2d layers, sharing the Parameters of the nn.Conv2d (and BatchNorm2d) they replace.

BatchNorm folding (Conv2d followed by BatchNorm2d), with sf = gamma / sqrt(running_var + eps):
    w_fold = W * sf[o]            b_fold = beta + (b - running_mean) * sf[o]
The integer conv quantizes w_fold per output channel, so deployment needs no BatchNorm at all.
While BN statistics are live (fake-quant stage, before `freeze_bn_stats`), FakeQuantConv2d uses
torch.ao's ConvBn2d scheme: conv(fq(x), fq(w_fold)) / sf, then BatchNorm with batch statistics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.config import QuantConfig, resolve_config
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer, full_tensor
from intqat.nn.conv_step import conv_step, fused_conv
from intqat.nn.linear import in_input_dtype
from intqat.ops import backends, cpp_step
from intqat.ops.int_conv2d import conv_codes_forward, int_conv2d
from intqat.ops.int_linear import rounded_zero_point, weight_colsum
from intqat.ops.qparams import SCALE_EPS
from intqat.ops.quant import quantize

__all__ = ["FakeQuantConv2d", "IntConv2d", "DeployedIntConv2d", "conv_padding"]


@torch.library.custom_op("intqat::bn_inv_std", mutates_args=())
def _bn_inv_std(running_var: Tensor, eps: float) -> Tensor:
    """1 / sqrt(running_var + eps), as one opaque op.

    With live BN statistics, BatchNorm updates running_var in place later in the same step.
    torch 2.13's inductor partitioner would recompute a plain rsqrt(running_var + eps) in the
    backward, after that update, and get the gradients wrong; an opaque op's output is saved.
    """
    return torch.rsqrt(running_var + eps)


@_bn_inv_std.register_fake
def _(running_var, eps):
    return torch.empty_like(running_var)


def _fold_scale(bn: nn.BatchNorm2d, gamma: Tensor | None) -> Tensor:
    """sf = gamma / sqrt(running_var + eps), (O,); gamma is bn.weight (ones when not affine)."""
    gamma = gamma if bn.affine else torch.ones_like(bn.running_var)
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return gamma * _bn_inv_std(bn.running_var, bn.eps)
    # eager: the op's own expression (the same values), without torch.library's Python dispatch (~50 us a layer
    # and step); the opaque op matters only to the compiler's partitioner
    return gamma * torch.rsqrt(bn.running_var + bn.eps)


def _sync_bn_frozen(module, _incompatible_keys) -> None:
    module._bn_frozen = bool(module.bn_frozen)


def conv_padding(conv: nn.Conv2d) -> tuple[int, int] | None:
    """Numeric symmetric padding of a conv, or None when the integer path cannot express it."""
    if conv.padding_mode != "zeros":
        return None
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation):
            total = d * (k - 1)
            if total % 2:
                return None  # torch pads asymmetrically here
            pads.append(total // 2)
        return tuple(pads)
    return tuple(conv.padding)


class _QuantConvBase(nn.Module):
    grad_gemm = "int8x3"  # QuantConfig.grad_gemm: how IntConv2d's backward GEMMs run (set per instance)

    def __init__(self, conv: nn.Conv2d, bn: nn.BatchNorm2d | None, input_quantizer, weight_quantizer):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride, self.dilation, self.groups = conv.kernel_size, conv.stride, conv.dilation, conv.groups
        self.padding = conv_padding(conv)
        if self.padding is None:
            raise ValueError(
                f"cannot quantize {conv}: padding_mode={conv.padding_mode!r} / padding={conv.padding!r} has "
                "no symmetric zero padding"
            )
        self.weight = conv.weight
        self.bias = conv.bias
        self.bn = bn  # the original BatchNorm2d (same Parameters and running stats), or None
        # in a buffer for checkpoints, mirrored as a Python bool that forward branches on
        # (torch.compile guards on it instead of breaking the graph)
        self.register_buffer("bn_frozen", torch.zeros((), dtype=torch.bool))
        self._bn_frozen = False
        self.register_load_state_dict_post_hook(_sync_bn_frozen)
        self.input_quantizer = input_quantizer
        self.weight_quantizer = weight_quantizer

    def _bn_scale(self) -> Tensor:
        """sf = gamma / sqrt(running_var + eps), (O,)"""
        return _fold_scale(self.bn, self.bn.weight)

    def folded(self) -> tuple[Tensor, Tensor | None]:
        """(w_fold, b_fold) from running statistics; differentiable w.r.t. W, b, gamma and beta."""
        if self.bn is None:
            return self.weight, self.bias
        sf = self._bn_scale()
        w = self.weight * sf.reshape(-1, 1, 1, 1)
        b = self.bias if self.bias is not None else torch.zeros_like(sf)
        beta = self.bn.bias if self.bn.affine else torch.zeros_like(sf)
        return w, beta + (b - self.bn.running_mean) * sf

    def freeze_bn_stats(self, frozen: bool = True) -> None:
        self.bn_frozen.fill_(frozen)
        self._bn_frozen = bool(frozen)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.kernel_size)}, stride={tuple(self.stride)}, "
            f"padding={self.padding}, dilation={tuple(self.dilation)}, groups={self.groups}, bn_folded={self.bn is not None}"
        )


class FakeQuantConv2d(_QuantConvBase):
    @classmethod
    def from_conv(cls, conv: nn.Conv2d, config: QuantConfig | str | dict = "w8a8", bn: nn.BatchNorm2d | None = None) -> "FakeQuantConv2d":
        config = resolve_config(config)
        dev = conv.weight.device
        mod = cls(conv, bn, ActivationQuantizer(config.activation).to(dev), None)
        w_init = conv.weight.detach()
        if bn is not None and config.weight.learnable:  # a learned scale starts at the folded weight's min-max
            # (whole tensors: a sharded conv's Parameters are DTensors, its BN's running stats plain buffers)
            w_init = full_tensor(w_init) * _fold_scale(bn, full_tensor(bn.weight.detach())).reshape(-1, 1, 1, 1)
        mod.weight_quantizer = WeightQuantizer(config.weight, w_init).to(dev)
        if config.grad_gemm != mod.grad_gemm:
            mod.grad_gemm = config.grad_gemm  # carried to the IntConv2d that replaces it
        return mod

    def _conv(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        x = input
        x_hat = self.input_quantizer.fake_quant(x, per_tensor_dynamic=True)
        if self.bn is None or self._bn_frozen or not self.training:
            w, b = self.folded()
            return self._conv(x_hat, self.weight_quantizer.fake_quant(w), b)
        # live BN statistics: fold with running stats for quantization, undo the scaling, let BN
        # normalise with batch statistics (and update its running stats), as torch.ao's ConvBn2d
        sf = self._bn_scale()
        w = self.weight * sf.reshape(-1, 1, 1, 1)
        y = self._conv(x_hat, self.weight_quantizer.fake_quant(w), None) / sf.reshape(1, -1, 1, 1)
        if self.bias is not None:
            y = y + self.bias.reshape(1, -1, 1, 1)
        return self.bn(y)


class IntConv2d(_QuantConvBase):
    """Integer conv (im2col of int8 codes + int_mm). BN, if any, is folded with its running stats."""

    @classmethod
    def from_fake_quant(cls, fq: FakeQuantConv2d) -> "IntConv2d":
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        for name in ("in_channels", "out_channels", "kernel_size", "stride", "dilation", "groups", "padding"):
            setattr(mod, name, getattr(fq, name))
        mod.weight, mod.bias, mod.bn = fq.weight, fq.bias, fq.bn
        mod.register_buffer("bn_frozen", torch.ones((), dtype=torch.bool))  # integer convs fold running stats
        mod._bn_frozen = True
        mod.register_load_state_dict_post_hook(_sync_bn_frozen)
        mod.input_quantizer, mod.weight_quantizer = fq.input_quantizer, fq.weight_quantizer
        if fq.grad_gemm != mod.grad_gemm:
            mod.grad_gemm = fq.grad_gemm
        return mod

    def _op_args(self):
        aq, wq = self.input_quantizer, self.weight_quantizer
        return dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups,
                    x_qmin=aq.qmin, x_qmax=aq.qmax, w_qmin=wq.qmin, w_qmax=wq.qmax, x_dynamic=aq.dynamic,
                    w_clip_mask=wq.scale is not None,  # a min-max weight scale never clips
                    grad_gemm=self.grad_gemm)

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        x = input
        if type(self) is IntConv2d:  # (a subclass, such as a parametrized layer's, may read its tensors otherwise)
            y = fused_conv(self, x)  # observer, BN fold and the C++ step in one op call, decided once per input shape
            if y is not None:
                return y
        aq = self.input_quantizer
        aq.integer_input(x)  # observes (while observing), refuses NaN / inf in training, checks the scale
        autograd = _wants_autograd(x, self.weight)
        w, b = self._folded_eager() if autograd else self.folded()  # (no graph to save without autograd)
        wq = self.weight_quantizer
        if autograd:
            # a min-max scale per channel (no scale kept): the C++ step computes it from w itself (the same values)
            w_scale = None if wq.scale is None and wq.per_channel else wq.channel_scale(w)
            try:
                y = conv_step(self, x, w, b, aq, w_scale)  # the C++ step, decided once per input shape
                if y is None:
                    if w_scale is None:
                        w_scale = wq.channel_scale(w)
                    y = int_conv2d(x, w, b, aq.scale, aq.zero_point, w_scale, **self._op_args())
                return in_input_dtype(y, x)
            except ValueError as e:  # (a shape / dtype the op refuses: say which layer)
                raise ValueError(f"intqat: integer {aq._where()}: {e}") from None
        w_scale = wq.channel_scale(w)
        with torch.no_grad():
            q_w, z_x = self._codes(w, w_scale)
            colsum = weight_colsum(q_w.reshape(q_w.shape[0], -1))
            return in_input_dtype(_deployed_conv(x, q_w, colsum, w_scale.detach().reshape(-1),
                                                 None if b is None else b.detach(), aq.scale, z_x, aq.qmin, aq.qmax,
                                                 aq.dynamic, self.stride, self.padding, self.dilation, self.groups), x)

    def _folded_eager(self) -> tuple[Tensor, Tensor | None]:
        """folded(), as one C++ autograd op (intqat_train::bn_fold: the same aten calls in the same order, forward and
        backward, so the same bits) for eager float32 CPU tensors; ~26-29 us of 8 tensor ops and their autograd
        nodes per conv and step otherwise (Zen 4, 1 thread). Anything else (no BN, tracing, other dtypes or devices,
        the C++ ops off or unbuilt): folded()."""
        bn = self.bn
        if bn is None:
            return self.folded()
        weight, bias, running_mean, running_var = self.weight, self.bias, bn.running_mean, bn.running_var
        gamma, beta = (bn.weight, bn.bias) if bn.affine else (None, None)
        tensors = (weight, bias, gamma, beta, running_mean, running_var)
        if not backends.eager_cpu(tensors):  # (first: a tracer sees folded() only)
            return self.folded()
        for t in tensors:
            if t is not None and t.dtype is not _F32:
                return self.folded()
        if not cpp_step.available():
            return self.folded()
        global _bn_fold_op
        if _bn_fold_op is None:
            _bn_fold_op = torch.ops.intqat_train.bn_fold.default
        w, b = _bn_fold_op(weight, bias, gamma, beta, running_mean, running_var, bn.eps)
        return w, b

    def _codes(self, w: Tensor, w_scale: Tensor) -> tuple[Tensor, Tensor]:
        aq, wq = self.input_quantizer, self.weight_quantizer
        ws = w_scale.detach().reshape(-1).to(torch.float32)
        q_w = quantize(w.detach().reshape(w.shape[0], -1), ws, 0, wq.qmin, wq.qmax, axis=0).reshape(w.shape)
        z_x = torch.zeros(1, dtype=torch.int32, device=w.device) if aq.dynamic else rounded_zero_point(aq.zero_point, aq.qmin, aq.qmax)
        return q_w, z_x

    @torch.no_grad()
    def to_deployed(self) -> "DeployedIntConv2d":
        """Freeze: folded int8 weight codes as buffers."""
        if not self.input_quantizer.dynamic:
            self.input_quantizer._check_ready()
        aq = self.input_quantizer
        w, b = self.folded()
        w_scale = self.weight_quantizer.channel_scale(w).detach().reshape(-1).to(torch.float32)
        q_w, z_x = self._codes(w, w_scale)
        return DeployedIntConv2d(
            q_w, w_scale, None if b is None else b.detach().clone(), aq.scale.detach().clone(), z_x,
            aq.qmin, aq.qmax, aq.dynamic, self.stride, self.padding, self.dilation, self.groups,
        )


class DeployedIntConv2d(nn.Module):
    """Inference-only integer conv with int8 (BN-folded) weights: what `torch.export` packages."""

    def __init__(self, q_w, w_scale, bias, x_scale, x_zero_point, x_qmin, x_qmax, x_dynamic, stride, padding, dilation, groups):
        super().__init__()
        self.register_buffer("q_w", q_w)  # (O, C/g, kh, kw) int8
        self.register_buffer("w_colsum", weight_colsum(q_w.reshape(q_w.shape[0], -1)))
        self.register_buffer("w_scale", w_scale.to(torch.float32).contiguous())
        self.register_buffer("bias", bias)
        self.register_buffer("x_scale", x_scale.to(torch.float32).reshape(1))
        self.register_buffer("x_zero_point", x_zero_point.to(torch.int32).reshape(1))
        self.x_qmin, self.x_qmax, self.x_dynamic = x_qmin, x_qmax, x_dynamic
        self.stride, self.padding, self.dilation, self.groups = tuple(stride), tuple(padding), tuple(dilation), groups

    @property
    def weight(self) -> Tensor:
        """The dequantized weight q_w * s_w (O, C/g, kh, kw) float32, for model code that reads a layer's `.weight`
        (Hugging Face's ViT reads its dtype to cast the pixels). The layer computes with the int8 codes."""
        return self.q_w.to(torch.float32) * self.w_scale.reshape(-1, 1, 1, 1)

    def forward(self, input: Tensor) -> Tensor:  # `input`, like nn.Linear / nn.Conv2d: layer(input=x) works
        x = input
        return in_input_dtype(_deployed_conv(x, self.q_w, self.w_colsum, self.w_scale, self.bias, self.x_scale,
                                             self.x_zero_point, self.x_qmin, self.x_qmax, self.x_dynamic, self.stride,
                                             self.padding, self.dilation, self.groups), x)


_F32 = torch.float32
_bn_fold_op = None


def _wants_autograd(x: Tensor, weight: Tensor) -> bool:
    """Use the differentiable op whenever autograd needs it (in eval too), never while exporting."""
    return torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad) and not torch.compiler.is_exporting()


def _deployed_conv(x, q_w, w_colsum, w_scale, bias, x_scale, z_x, x_qmin, x_qmax, x_dynamic, stride, padding, dilation, groups):
    """The integer conv in plain aten ops: exactly what the op's forward computes."""
    x = x.to(torch.float32)
    if x_dynamic:
        s = torch.clamp(x.abs().amax() / x_qmax, min=SCALE_EPS).reshape(1, 1)
        q_x = quantize(x, s.reshape(()), 0, x_qmin, x_qmax)
        colsum = torch.zeros_like(w_colsum[:1])
    else:
        s = x_scale.detach().reshape(1, 1).to(torch.float32)
        q_x = quantize(x, s.reshape(()), z_x.reshape(()), x_qmin, x_qmax)
        colsum = w_colsum
    # a traced program cannot read z_x's value: pad through the tensor path there
    tracing = torch.compiler.is_exporting() or torch.compiler.is_compiling()
    pad_value = None if tracing else int(z_x.reshape(-1)[0])
    return conv_codes_forward(q_x, z_x, s, q_w, colsum, w_scale, bias, stride, padding, dilation, groups, pad_value)
