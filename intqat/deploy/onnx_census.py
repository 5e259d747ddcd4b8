"""The ONNX file's census: which of the integer model's layers became which ONNX ops (from the exporter's name
scopes), their schemes, the float layer a kept one becomes, and the layer an onnxruntime refusal names."""

from __future__ import annotations

import ast
from collections.abc import Iterable

import torch
from torch import nn

from intqat.deploy.onnx_report import OnnxLayer

__all__ = ["layer_ops", "census", "integer_layers", "float_of", "refused_layer"]

# the ONNX ops that name what a layer became, by form (Gather only for embeddings: a per-group layer's p[g] is one too)
_KEY_OPS = {"int": ("MatMulInteger", "ConvInteger"), "qdq": ("QuantizeLinear", "DequantizeLinear", "Gemm", "MatMul", "Conv")}


def layer_ops(model, layers: Iterable[str]) -> dict[str, list[str]]:
    """layer -> the ONNX op types of its nodes, in graph order (from the exporter's name scopes)."""
    names, out = set(layers), {}
    for node in model.graph:
        scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
        if not scopes:
            continue
        path = [s for s in ast.literal_eval(scopes)[:-1] if s]
        layer = next((p for p in reversed(path) if p in names), None)
        if layer is not None:
            out.setdefault(layer, []).append(node.op_type)
    return out


def _scheme(layer: nn.Module) -> str:
    """The integer model's scheme of one deployed layer."""
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntEmbedding

    q_w = layer.q_w
    bits = max(2, int(q_w.abs().max()).bit_length() + 1) if q_w.numel() else 8
    if isinstance(layer, DeployedIntEmbedding):
        return f"int{bits} table, {layer.w_scale.shape[1]} scale(s) per row"
    act = "dynamic per-token" if layer.x_dynamic and q_w.dim() == 2 else "dynamic per-tensor" if layer.x_dynamic \
        else "static"
    w = f"int{bits} per group ({layer.group_size})" if isinstance(layer, DeployedGroupedIntLinear) \
        else f"int{bits} per channel"
    return f"{act} int8 activations, {w} weights"


_NOTES = {
    "int": {"OnnxIntLinear": "int32 accumulators exact; epilogue float(acc) * (s_x s_w) + b as intqat's",
            "OnnxIntConv2d": "int32 accumulators exact (padding with the zero point's code); epilogue as intqat's",
            "OnnxGroupedIntLinear": "one MatMulInteger per group (batched), the group sums added in intqat's order",
            "OnnxIntEmbedding": "the int8 rows and their scales gathered, y = float(q) * s"},
    "qdq": {"QDQIntLinear": "", "QDQIntConv2d": "", "QDQIntEmbedding": "",
            "QDQGroupedIntLinear": "per-group weights: DequantizeLinear with block_size (opset 21)"},
}


def census(form: str, module: nn.Module, reference: nn.Module, ops: dict[str, list[str]],
            kept: dict[str, str]) -> list[OnnxLayer]:
    from intqat.deploy.onnx_int import int_layers
    from intqat.deploy.qdq import qdq_layers

    deployed = dict(reference.named_modules())
    layers = int_layers(module) if form == "int" else qdq_layers(module)
    rows = []
    for name in [n for n in deployed if n in layers or n in kept]:
        src = deployed[name]
        if name in kept:
            rows.append(OnnxLayer(name, type(src).__name__, _scheme(src), "kept float", kept[name]))
            continue
        if name not in ops:
            continue  # never called by forward (an attention projection for another input grouping): not in the file
        layer = layers[name]
        keys = _KEY_OPS[form] + (("Gather",) if "Embedding" in type(layer).__name__ else ())
        found = [o for o in dict.fromkeys(ops[name]) if o in keys]
        note = _NOTES[form].get(type(layer).__name__, "")
        aq = getattr(layer, "input_qdq", None)
        if form == "qdq" and aq is not None and aq.dynamic:
            note = ("activation scale computed at run time, written out (ReduceMax / ReduceMin / Div / Reciprocal / "
                    "Round / Clip: intqat's codes), then DequantizeLinear; runs as a float GEMM" + ("; " + note if note else ""))
        rows.append(OnnxLayer(name, type(src).__name__, _scheme(src), ", ".join(found), note))
    return rows


def integer_layers(reference: nn.Module) -> dict[str, nn.Module]:
    from intqat.nn import DeployedGroupedIntLinear, DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    kinds = (DeployedIntLinear, DeployedIntConv2d, DeployedGroupedIntLinear, DeployedIntEmbedding)
    return {n: m for n, m in reference.named_modules() if isinstance(m, kinds)}


@torch.no_grad()
def float_of(layer: nn.Module, whole: bool = False) -> nn.Module:
    """A deployed integer layer as the float layer a kept one becomes: its dequantized weight w_hat (the values the
    integer model's weights stand for), fp32, and no activation quantization. whole: every layer is kept float."""
    from intqat.nn import DeployedIntConv2d, DeployedIntEmbedding, DeployedIntLinear

    if not whole and (getattr(layer, "input_codes", False) or getattr(layer, "out_codes", False)):
        raise ValueError("a layer of an int8 chain (intqat.chain_int8) cannot be kept float alone: its neighbour "
                         "passes it int8 codes")
    if isinstance(layer, DeployedIntEmbedding):
        n, d = layer.q_w.shape
        w = (layer.q_w.to(torch.float32).reshape(n, layer.w_scale.shape[1], -1) * layer.w_scale.unsqueeze(-1))
        return nn.Embedding.from_pretrained(w.reshape(n, d), freeze=True)
    w = layer.q_w.to(torch.float32)
    if isinstance(layer, DeployedIntConv2d):
        w = w * layer.w_scale.reshape(-1, 1, 1, 1)
        o, cg, kh, kw = w.shape
        m = nn.Conv2d(cg * layer.groups, o, (kh, kw), layer.stride, layer.padding, layer.dilation, layer.groups,
                      bias=layer.bias is not None)
    else:  # DeployedIntLinear (nn.Linear layout whatever it came from) or DeployedGroupedIntLinear
        w = w * layer.w_scale.reshape(-1, 1) if isinstance(layer, DeployedIntLinear) else \
            (w.reshape(w.shape[0], layer.w_scale.shape[1], -1) * layer.w_scale.unsqueeze(-1)).reshape(w.shape)
        m = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None)
    m.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if layer.bias is not None:
        m.bias = nn.Parameter(layer.bias.detach().to(torch.float32).clone(), requires_grad=False)
    return m.eval()


def refused_layer(message: str, onnx_model, integer: dict, kept: dict) -> str | None:
    """The integer layer whose node onnxruntime names in its error, if any (and not already kept float)."""
    for node in onnx_model.graph:
        if node.name and f"'{node.name}'" in message:
            scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
            path = [s for s in ast.literal_eval(scopes)[:-1] if s] if scopes else []
            layer = next((p for p in reversed(path) if p in integer), None)
            if layer is not None and layer not in kept:
                return layer
    return None
