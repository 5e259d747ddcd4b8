"""Quantized modules: fake-quant (fp32 simulation), integer (int8 arithmetic), deployed (int8 weights)."""

from intqat.nn.attention import DeployedIntMultiheadAttention, FakeQuantMultiheadAttention, IntMultiheadAttention
from intqat.nn.conv import DeployedIntConv2d, FakeQuantConv2d, IntConv2d
from intqat.nn.fake_quantize import fake_quantize_ste
from intqat.nn.linear import DeployedIntLinear, FakeQuantLinear, IntLinear
from intqat.nn.quantizers import ActivationQuantizer, WeightQuantizer
from intqat.nn.grouped_linear import DeployedGroupedIntLinear, FakeQuantGroupedLinear, GroupedIntLinear  # noqa: E402
from intqat.nn.embedding import DeployedIntEmbedding, FakeQuantEmbedding, IntEmbedding  # noqa: E402

# Which float layer becomes which of these, and the type groups (FAKE_QUANT_TYPES, ...): intqat.registry.

__all__ = [
    "FakeQuantLinear", "IntLinear", "DeployedIntLinear",
    "FakeQuantConv2d", "IntConv2d", "DeployedIntConv2d",
    "FakeQuantMultiheadAttention", "IntMultiheadAttention", "DeployedIntMultiheadAttention",
    "FakeQuantGroupedLinear", "GroupedIntLinear", "DeployedGroupedIntLinear",
    "FakeQuantEmbedding", "IntEmbedding", "DeployedIntEmbedding",
    "ActivationQuantizer", "WeightQuantizer", "fake_quantize_ste",
]
