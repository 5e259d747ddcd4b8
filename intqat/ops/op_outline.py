"""An integer op, defined once from its formulas: the custom op, its fake, its autograd and the eager fast path.

Every differentiable integer op (int_linear, int_linear_grouped, int_conv2d) has the same outline: a torch.library custom op
(what torch.compile / torch.export / opcheck see: one node), a fake (shapes and dtypes for tracing), autograd
(setup_context + backward), and an eager path that runs the same forward and backward through an
autograd.Function without torch.library's Python dispatch around them (~0.1 ms a call). The op supplies only
its formulas; `IntegerOp` builds the rest:

    LINEAR = IntegerOp("intqat::int_linear", tensors=("x", "weight", "bias?", "x_scale", "x_zero_point", "w_scale?"),
                       spec=LinearSpec, outputs=8, forward=_forward, fake=_fake, save=_save, backward=_backward,
                       eager_name="_IntLinearEager")
    y = LINEAR(x, weight, bias, x_scale, x_zero_point, w_scale, spec=LinearSpec(...))[0]

- forward(*tensors, spec) -> outputs; fake(*tensors, spec) -> empty outputs of the same shapes;
  save(ctx, tensors, spec, outputs) keeps what backward needs; backward(ctx, *grads) -> one gradient per tensor
  (the spec's scalars get None here). Output 0 is differentiable, the rest (codes, masks, scales) are not.
- The scalar options travel as one frozen spec (a NamedTuple: ranges, dynamic, masks, ...). Only the op schema
  sees them as plain arguments, in field order, with the field defaults as schema defaults (int -> SymInt):
  so the schema, and every exported or compiled graph that holds the op, is what the hand-written op had.
- `__call__` is the reference backend's form of the op: while a tracer watches, the custom op (one node);
  else the eager autograd.Function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from intqat.ops.backends.base import tracing

__all__ = ["IntegerOp"]

_SCHEMA_TYPES = {"int": "SymInt", "bool": "bool", "str": "str", "float": "float", "list[int]": "SymInt[]"}


def _type_name(kind) -> str:
    """A NamedTuple field's annotation as written: a string, a ForwardRef (postponed annotations) or a type."""
    return kind if isinstance(kind, str) else getattr(kind, "__forward_arg__", None) or kind.__name__


def _schema(tensors: tuple[str, ...], spec: type, outputs: int) -> str:
    args = [f"Tensor{'?' if t.endswith('?') else ''} {t.rstrip('?')}" for t in tensors]
    for name, kind in spec.__annotations__.items():
        default = spec._field_defaults.get(name)
        arg = f"{_SCHEMA_TYPES[_type_name(kind)]} {name}"
        if name in spec._field_defaults:
            arg += "=" + (f'"{default}"' if isinstance(default, str) else str(default))
        args.append(arg)
    return f"({', '.join(args)}) -> ({', '.join(['Tensor'] * outputs)})"


class IntegerOp:
    """One integer op: `op` (the custom op), `eager` (the autograd.Function), and `__call__` picking between them."""

    def __init__(self, qualname: str, *, tensors: tuple[str, ...], spec: type, outputs: int,
                 forward: Callable, fake: Callable, save: Callable, backward: Callable, eager_name: str):
        n = len(tensors)
        n_scalars = len(spec._fields)
        self.spec, self.schema = spec, _schema(tensors, spec, outputs)

        def impl(*args):  # (a graph may leave out trailing arguments that have schema defaults: the spec's)
            return forward(*args[:n], spec(*args[n:]))

        self.op = torch.library.custom_op(qualname, impl, mutates_args=(), schema=self.schema)
        self.op.register_fake(lambda *args: fake(*args[:n], spec(*args[n:])))

        def setup_context(ctx, inputs, output):
            save(ctx, inputs[:n], spec(*inputs[n:]), output)

        def op_backward(ctx, *grads):
            return (*backward(ctx, *grads), *(None,) * n_scalars)

        self.op.register_autograd(op_backward, setup_context=setup_context)

        def eager_forward(ctx, *args):  # (ctx, *args): apply() binds no signature per call; args: tensors, spec
            output = forward(*args)
            save(ctx, args[:n], args[n], output)
            ctx.mark_non_differentiable(*output[1:])  # codes, masks, scales: no gradient flows back
            ctx.set_materialize_grads(False)  # and no zero tensors are made for them
            return output

        def eager_backward(ctx, *grads):
            return (*backward(ctx, *grads), None)

        # named per op: autograd shows the node as <eager_name>Backward
        self.eager = type(eager_name, (torch.autograd.Function,), {
            "__doc__": f"The eager path of {qualname}: its forward, context and backward without torch.library's "
                       "Python dispatch. Taken only outside tracing (IntegerOp.__call__).",
            "forward": staticmethod(eager_forward), "backward": staticmethod(eager_backward)})

    def __call__(self, *tensors: Tensor | None, spec) -> tuple[Tensor, ...]:
        if tracing(*tensors):
            return self.op(*tensors, *spec)  # (every scalar positional: the graphs the hand-written op made)
        return self.eager.apply(*tensors, spec)
