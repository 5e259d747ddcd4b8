"""Quantized modules: fake-quant (fp32 simulation), integer (int8 arithmetic), deployed (int8 weights)."""

from intqat.nn.attention import DeployedIntMultiheadAttention, FakeQuantMultiheadAttention, IntMultiheadAttention
from intqat.nn.conv import DeployedIntConv2d, FakeQuantConv2d, IntConv2d
from intqat.nn.fake_quantize import fake_quantize_ste
from intqat.nn.linear import DeployedIntLinear, FakeQuantLinear, IntLinear
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer

FAKE_QUANT_TYPES = (FakeQuantLinear, FakeQuantConv2d)
INTEGER_TYPES = (IntLinear, IntConv2d)
DEPLOYED_TYPES = (DeployedIntLinear, DeployedIntConv2d)
# Kept apart from the layer types above: those hold one weight and one input quantizer each (the callback's
# per-layer metrics read them); an attention module holds several projections.
ATTENTION_TYPES = (FakeQuantMultiheadAttention, IntMultiheadAttention, DeployedIntMultiheadAttention)

__all__ = [
    "FakeQuantLinear", "IntLinear", "DeployedIntLinear",
    "FakeQuantConv2d", "IntConv2d", "DeployedIntConv2d",
    "FakeQuantMultiheadAttention", "IntMultiheadAttention", "DeployedIntMultiheadAttention", "ATTENTION_TYPES",
    "ActivationQuantizer", "WeightQuantizer", "fake_quantize_ste",
    "FAKE_QUANT_TYPES", "INTEGER_TYPES", "DEPLOYED_TYPES",
]
