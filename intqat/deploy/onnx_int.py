"""The integer ONNX form (`export_onnx(..., form="int")`): each integer layer as ONNX integer ops into int32 and
intqat's fp32 epilogue after them, in intqat's order, so onnxruntime computes the integer model's numbers.

Each deployed integer layer becomes a module of this file, written in the ops whose ONNX translations compute
the same float values as intqat's kernels (NUMERICS.md, "ONNX forms"):

    quantize   static:  q = Cast<int8>(Clip(Round(x * fp32(1/s_x)) + z_x, qmin, qmax))   (s_x, z_x constants)
               dynamic: s = Max(Max(ReduceMax(x), -ReduceMin(x)) / qmax, eps)             per token (linear, last
                        q = Cast<int8>(Clip(Round(x * Reciprocal(s)), qmin, qmax))         dim) or per tensor (conv)
    product    MatMulInteger(q_x, q_wᵀ, z_x) / ConvInteger(q_x, q_w, z_x)                int32, exact: the
               zero point is the op's own input, so acc = sum (q_x - z_x) q_w (intqat's acc - z_x * colsum)
    epilogue   y = Cast<float>(acc) * (s_x * s_w) + b                                    one rounding per step
per group (8da4w): MatMulInteger per group (a batched (G, M, gs) x (G, gs, N) product), p_g = float(acc_g) *
s_w[:, g], the G sums added left to right (G - 1 Adds), y = t * s_x + b. Embeddings: Gather of the int8 table and
of its scales, y = float(q) * s.

The integer products are two custom ops of this file (`intqat_onnx::matmul_integer`, `conv_integer`) that the
exporter's translation table (`TRANSLATIONS`) maps to MatMulInteger / ConvInteger; everything else is plain aten.
The ops' own torch implementations are exact (int64 arithmetic) but slow: they exist for tracing, not to run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from intqat.ops.qparams import SCALE_EPS

__all__ = ["to_int_form", "int_layers", "INT_TYPES", "TRANSLATIONS", "OnnxIntLinear", "OnnxIntConv2d",
           "OnnxGroupedIntLinear", "OnnxIntEmbedding"]


# -- the integer products as custom ops (one node each for the exporter) -----------------------------------------
@torch.library.custom_op("intqat_onnx::matmul_integer", mutates_args=())
def matmul_integer(a: Tensor, b: Tensor, a_zero_point: Tensor) -> Tensor:
    """(a - a_zero_point) @ b: a (..., M, K) int8, b (..., K, N) int8, a_zero_point () int8 -> int32, exact."""
    return torch.matmul(a.to(torch.int64) - a_zero_point.to(torch.int64), b.to(torch.int64)).to(torch.int32)


@matmul_integer.register_fake
def _(a, b, a_zero_point):
    return torch.empty(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                       dtype=torch.int32, device=a.device)


@torch.library.custom_op("intqat_onnx::conv_integer", mutates_args=())
def conv_integer(x: Tensor, w: Tensor, x_zero_point: Tensor, stride: Sequence[int], padding: Sequence[int],
                 dilation: Sequence[int], groups: int) -> Tensor:
    """conv2d of (x - x_zero_point) (zero padding: the padded code is the zero point) with w, int32, exact
    (float64 holds every partial sum: |sum| < 2^15 * C * kh * kw)."""
    xz = x.to(torch.float64) - x_zero_point.to(torch.float64)
    return F.conv2d(xz, w.to(torch.float64), None, stride, padding, dilation, groups).to(torch.int32)


@conv_integer.register_fake
def _(x, w, x_zero_point, stride, padding, dilation, groups):
    out = [x.shape[0], w.shape[0]]
    for i in range(2):
        out.append((x.shape[2 + i] + 2 * padding[i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1)
    return torch.empty(out, dtype=torch.int32, device=x.device)


def _translations() -> dict:
    """torch op -> onnxscript function, for torch.onnx.export(custom_translation_table=...)."""
    from onnxscript import opset21 as op

    def matmul_integer_onnx(a, b, a_zero_point):
        return op.MatMulInteger(a, b, a_zero_point)

    def conv_integer_onnx(x, w, x_zero_point, stride: Sequence[int], padding: Sequence[int],
                          dilation: Sequence[int], groups: int):
        pads = list(padding) + list(padding)  # ONNX: (begin_h, begin_w, end_h, end_w)
        return op.ConvInteger(x, w, x_zero_point, strides=list(stride), pads=pads, dilations=list(dilation),
                              group=groups)

    return {torch.ops.intqat_onnx.matmul_integer.default: matmul_integer_onnx,
            torch.ops.intqat_onnx.conv_integer.default: conv_integer_onnx}


TRANSLATIONS = _translations  # (a function: onnxscript is imported only when an ONNX file is made)


# -- quantize, in the ops whose ONNX forms round as intqat's kernels do ------------------------------------------
def _quantize_static(x: Tensor, inv_scale: Tensor, zero_point: float, qmin: int, qmax: int) -> Tensor:
    """q = clamp(round(x * fp32(1/s)) + z, qmin, qmax) as int8: intqat.ops.quant's formula (round, then add z)."""
    r = torch.round(x * inv_scale)
    if zero_point:
        r = r + zero_point
    return torch.clamp(r, qmin, qmax).to(torch.int8)


def _dynamic_scale(x: Tensor, qmax: int, dim: int | None) -> Tensor:
    """max(max|x| / qmax, eps) over the last dim (keepdim, per token) or the whole tensor (dim None)."""
    if dim is None:  # (every dim named: the ONNX translation of amax takes no "all dims" form)
        dims = list(range(x.dim()))
        amax = torch.maximum(x.amax(dim=dims), x.amin(dim=dims).neg())
    else:
        amax = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg())
    return torch.clamp(amax / qmax, min=SCALE_EPS)


def _quantize_dynamic(x: Tensor, s: Tensor, qmin: int, qmax: int) -> Tensor:
    return torch.clamp(torch.round(x * torch.reciprocal(s)), qmin, qmax).to(torch.int8)


def _fp32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float32 else x.to(torch.float32)


def _in_dtype(y: Tensor, x: Tensor) -> Tensor:
    """As the integer layers: the epilogue in fp32, the output in the input's float dtype."""
    return y if y.dtype == x.dtype or not x.is_floating_point() else y.to(x.dtype)


def _outer(s: Tensor, w_scale: Tensor) -> Tensor:
    """s_x[m] * s_w[n] (..., N) from s (..., 1) and w_scale (N,), as a MatMul with K = 1: one product per element,
    the same fp32 value as a Mul. Not a Mul because onnxruntime fuses MatMulInteger -> Cast -> Mul(acc, Mul(a, b))
    into MatMulIntegerToFloat, which reads a_scale as one scale per tensor: a per-token scale there gave wrong
    outputs (measured: off by 0.18 on outputs of ~1, onnxruntime 1.32)."""
    return torch.matmul(s, w_scale.reshape(1, -1))


class _Input(nn.Module):
    """The activation quantizer of one integer layer: static constants or the dynamic formula."""

    def __init__(self, src, per_token: bool):
        super().__init__()
        self.qmin, self.qmax, self.dynamic, self.per_token = int(src.x_qmin), int(src.x_qmax), bool(src.x_dynamic), per_token
        s = src.x_scale.detach().to(torch.float32).reshape(())
        self.register_buffer("inv_scale", torch.reciprocal(s))  # fp32(1/s), as intqat multiplies by it
        self.register_buffer("scale", s.clone())
        z = 0 if self.dynamic else int(src.x_zero_point.reshape(-1)[0])
        self.zero_point = z
        self.register_buffer("zero_point_code", torch.tensor(z, dtype=torch.int8))  # MatMulInteger's a_zero_point

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """x fp32 -> (q_x int8, s_x: None for static (a constant of the layer), (..., 1) per token, () per tensor)."""
        if not self.dynamic:
            return _quantize_static(x, self.inv_scale, float(self.zero_point), self.qmin, self.qmax), None
        s = _dynamic_scale(x, self.qmax, -1 if self.per_token else None)
        return _quantize_dynamic(x, s, self.qmin, self.qmax), s


class OnnxIntLinear(nn.Module):
    """DeployedIntLinear (nn.Linear, HF Conv1D, attention projections; chained int8 producers and consumers) as
    MatMulInteger + intqat's epilogue."""

    def __init__(self, src):
        super().__init__()
        self.in_features, self.out_features = src.in_features, src.out_features
        self.input_codes = bool(src.input_codes)
        self.input = _Input(src, per_token=True)
        self.register_buffer("q_w_t", src.q_w.t().contiguous())  # (K, N) int8: MatMulInteger's b
        self.register_buffer("w_scale", src.w_scale.detach().to(torch.float32).reshape(-1).clone())
        # static: s_x * s_w, the fp32 product the integer epilogue multiplies by (one rounding, as there)
        self.register_buffer("xw_scale", (self.input.scale.reshape(1, 1) * self.w_scale.reshape(1, -1)).reshape(-1))
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).clone())
        self.out = None
        if src.out_codes:  # a chained producer: int8 codes on its consumer's grid (ReLU as max(q, z))
            self.out = (float(src.out_scale), int(src.out_zero_point), src.out_qmin, src.out_qmax, bool(src.out_relu))
            self.register_buffer("out_inv_scale", torch.reciprocal(src.out_scale.detach().to(torch.float32).reshape(())))

    def forward(self, input: Tensor) -> Tensor:
        if self.input_codes:  # codes from a chained producer, on this layer's grid
            q, s = input, None
        else:
            q, s = self.input(_fp32(input))
        acc = matmul_integer(q, self.q_w_t, self.input.zero_point_code)  # (..., N) int32
        y = acc.to(torch.float32) * (self.xw_scale if s is None else _outer(s, self.w_scale))
        if self.bias is not None:
            y = y + self.bias
        if self.out is not None:
            _, z, qmin, qmax, relu = self.out
            q = _quantize_static(y, self.out_inv_scale, float(z), qmin, qmax)
            return torch.clamp(q, min=z) if relu else q
        return _in_dtype(y, input)


class OnnxIntConv2d(nn.Module):
    """DeployedIntConv2d (BN folded; grouped and depthwise too) as ConvInteger + intqat's epilogue."""

    def __init__(self, src):
        super().__init__()
        self.stride, self.padding, self.dilation, self.groups = (list(src.stride), list(src.padding),
                                                                 list(src.dilation), int(src.groups))
        self.input = _Input(src, per_token=False)
        self.register_buffer("q_w", src.q_w.contiguous())  # (O, C/g, kh, kw) int8
        self.register_buffer("w_scale", src.w_scale.detach().to(torch.float32).reshape(-1).clone())
        o = self.q_w.shape[0]
        self.register_buffer("xw_scale", (self.input.scale.reshape(1, 1) * self.w_scale.reshape(1, -1)).reshape(1, o, 1, 1))
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).reshape(1, o, 1, 1).clone())

    def forward(self, input: Tensor) -> Tensor:
        q, s = self.input(_fp32(input))
        acc = conv_integer(q, self.q_w, self.input.zero_point_code, self.stride, self.padding, self.dilation,
                           self.groups)  # (B, O, Ho, Wo) int32
        scale = self.xw_scale if s is None else (s.reshape(1, 1) * self.w_scale.reshape(1, -1)).reshape(self.xw_scale.shape)
        y = acc.to(torch.float32) * scale
        if self.bias is not None:
            y = y + self.bias
        return _in_dtype(y, input)


class OnnxGroupedIntLinear(nn.Module):
    """DeployedGroupedIntLinear (8da4w: int4 codes per group, in int8) as a batched MatMulInteger over the groups
    and intqat's per-group epilogue (the groups added in increasing order)."""

    def __init__(self, src):
        super().__init__()
        self.in_features, self.out_features, self.group_size = src.in_features, src.out_features, src.group_size
        n, k = src.q_w.shape
        self.groups = k // self.group_size
        self.input = _Input(src, per_token=True)
        self.register_buffer("q_w_g", src.q_w.reshape(n, self.groups, self.group_size).permute(1, 2, 0).contiguous())  # (G, gs, N)
        self.register_buffer("w_scale_g", src.w_scale.detach().to(torch.float32).t().unsqueeze(1).contiguous())  # (G, 1, N)
        self.register_buffer("bias", None if src.bias is None else src.bias.detach().to(torch.float32).clone())

    def forward(self, input: Tensor) -> Tensor:
        lead = input.shape[:-1]
        x = _fp32(input).reshape(-1, self.in_features)  # (M, K)
        q, s = self.input(x)
        qg = q.reshape(-1, self.groups, self.group_size).transpose(0, 1)  # (G, M, gs)
        p = matmul_integer(qg, self.q_w_g, self.input.zero_point_code).to(torch.float32) * self.w_scale_g  # (G, M, N)
        t = p[0]
        for g in range(1, self.groups):  # G - 1 adds in increasing g: the order is part of the result
            t = t + p[g]
        y = t * (self.input.scale if s is None else s)
        if self.bias is not None:
            y = y + self.bias
        return _in_dtype(y.reshape(*lead, self.out_features), input)


class OnnxIntEmbedding(nn.Module):
    """DeployedIntEmbedding: Gather of the int8 codes (V, D) and of the scales (V, G), y = float(q) * s."""

    def __init__(self, src):
        super().__init__()
        self.num_embeddings, self.embedding_dim = src.q_w.shape
        self.register_buffer("q_w", src.q_w)
        self.register_buffer("w_scale", src.w_scale.detach().to(torch.float32))
        self.groups = self.w_scale.shape[1]

    def forward(self, input: Tensor) -> Tensor:
        q = F.embedding(input, self.q_w).to(torch.float32)  # (..., D)
        s = F.embedding(input, self.w_scale)  # (..., G)
        d = self.embedding_dim
        return (q.reshape(*q.shape[:-1], self.groups, d // self.groups) * s.unsqueeze(-1)).reshape(q.shape)


INT_TYPES = (OnnxIntLinear, OnnxIntConv2d, OnnxGroupedIntLinear, OnnxIntEmbedding)


def _int_of(child: nn.Module) -> nn.Module | None:
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    for deployed, form in ((DeployedIntLinear, OnnxIntLinear), (DeployedIntConv2d, OnnxIntConv2d),
                           (DeployedGroupedIntLinear, OnnxGroupedIntLinear), (DeployedIntEmbedding, OnnxIntEmbedding)):
        if isinstance(child, deployed):
            return form(child)
    return None


def _swap(parent: nn.Module, keep_float: dict[str, nn.Module], prefix: str = "") -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}.{name}" if prefix else name
        if fqn in keep_float:
            parent._modules[name] = keep_float[fqn]
            continue
        form = _int_of(child)
        if form is None:
            _swap(child, keep_float, fqn)
        else:
            parent._modules[name] = form


def to_int_form(model: nn.Module, keep_float: dict[str, nn.Module] | None = None) -> nn.Module:
    """The integer ONNX form of `model` (never modified): fake-quant layers converted to integer (their scales carry
    over), integer ones deployed, each then swapped for its module above. keep_float: fqn -> the float module to put
    there instead (a layer this form cannot take)."""
    from intqat.deploy.qdq import _integer_copy

    work = _integer_copy(model)
    _swap(work, keep_float or {})
    return work.eval()


def int_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> integer-form layer, in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, INT_TYPES)}
