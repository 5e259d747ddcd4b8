"""Deploy an integer model where quantized models run: ExecuTorch (.pte, XNNPACK) and ONNX (Q/DQ and integer forms)."""
