"""Deploy an integer model where quantized models run: ExecuTorch (.pte, XNNPACK) and ONNX (Q/DQ and integer forms).

    intqat.deploy.to_qdq(model)                                   # the Q/DQ form every runtime's quantizer emits
    intqat.deploy.executorch.export_pte(model, (x,), "model.pte")  # ExecuTorch, lowered with XNNPACK
    intqat.deploy.onnx.export_onnx(model, (x,), "model.onnx", form="qdq")     # QuantizeLinear / DequantizeLinear
    intqat.deploy.onnx.export_onnx(model, (x,), "model.int.onnx", form="int") # MatMulInteger / ConvInteger, exact

A format whose packages are missing raises MissingDeployPackage naming them: pip install 'intqat[deploy]'.
"""

from intqat.deploy._require import FORMAT_PACKAGES, MissingDeployPackage, require
from intqat.deploy.qdq import qdq_layers, to_qdq

__all__ = ["to_qdq", "qdq_layers", "require", "MissingDeployPackage", "FORMAT_PACKAGES"]
