"""Converters from other libraries' fake-quant modules to intqat's integer modules.

Filled in by intqat's interop layer (torchao FakeQuantizedLinear, torch.ao eager QAT modules).
"""
