"""What a .pte's bytes are: ExecuTorch's program (flatbuffer: execution plan, values, the names of the data),
the delegates' payloads (XNNPACK's serialized graphs: tensors, quantization descriptors, nodes), the constant data
the delegates reference by name (weights, per-channel scales, biases), and the alignment padding between them.

Measured on the digits MLP (w8a8, executorch 1.5.1): 37.8 KiB = 24.0 KiB int8 weights + 5.0 KiB the fp32 head
(the model-output rule: fp32 logits) + 3.0 KiB per-channel scales and biases (XNNPACK stores each static layer's
bias as int32 with its own per-channel scale s_x s_w, beside the weight's scales) + 2.6 KiB XNNPACK graph + 2.1 KiB
program + padding. Nothing is duplicated and no fp32 copy of an int8 weight is kept.
"""

from __future__ import annotations

__all__ = ["pte_parts"]


def pte_parts(buffer: bytes) -> dict[str, int]:
    """{"total", "program", "delegate_payloads", "constant_data", "padding_and_header", "largest_constants"}
    in bytes (largest_constants: the sizes of the five largest named constants)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(bytes(buffer))
    delegates = sum(len(d.data) for d in pte.program.backend_delegate_data)
    named = pte.named_data
    consts = sorted((len(b.buffer) if hasattr(b, "buffer") else len(b) for b in (named.buffers if named else [])),
                    reverse=True)
    program = int.from_bytes(buffer[16:24], "little")  # the extended header's program size (ExecuTorch's "eh00")
    total = len(buffer)
    return {"total": total, "program": program, "delegate_payloads": delegates, "constant_data": sum(consts),
            "padding_and_header": total - program - delegates - sum(consts), "largest_constants": consts[:5]}
