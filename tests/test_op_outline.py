"""op_outline.IntegerOp: one definition gives the custom op, its fake, its autograd and the eager path; the ops
built with it keep the schemas (and so the graphs) their hand-written versions had."""

from __future__ import annotations

from typing import NamedTuple

import torch

import intqat.ops  # noqa: F401  (registers the ops)
from intqat.ops.op_outline import IntegerOp


def test_the_schemas_are_the_hand_written_ones():
    """What exported and compiled programs hold: these strings change only by an argument appended with a default
    (tests/test_golden.py checks graphs)."""
    assert str(torch.ops.intqat.int_linear.default._schema) == (
        "intqat::int_linear(Tensor x, Tensor weight, Tensor? bias, Tensor x_scale, Tensor x_zero_point, Tensor? w_scale, "
        "SymInt x_qmin, SymInt x_qmax, SymInt w_qmin, SymInt w_qmax, bool x_dynamic, bool x_clip_mask, "
        'bool w_clip_mask, str grad_gemm="int8x3") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)')
    assert str(torch.ops.intqat.int_linear_grouped.default._schema) == (
        "intqat::int_linear_grouped(Tensor x, Tensor weight, Tensor? bias, Tensor x_scale, Tensor x_zero_point, "
        "Tensor? w_scale, SymInt group_size, SymInt x_qmin, SymInt x_qmax, SymInt w_qmin, SymInt w_qmax, "
        "bool x_dynamic, bool w_clip_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert str(torch.ops.intqat.int_conv2d.default._schema) == (
        "intqat::int_conv2d(Tensor x, Tensor weight, Tensor? bias, Tensor x_scale, Tensor x_zero_point, Tensor w_scale, "
        "SymInt[] stride, SymInt[] padding, SymInt[] dilation, SymInt groups, SymInt x_qmin, SymInt x_qmax, "
        "SymInt w_qmin, SymInt w_qmax, bool x_dynamic, bool w_clip_mask, str grad_gemm=\"int8x3\") -> (Tensor, Tensor, "
        "Tensor, Tensor, Tensor, Tensor, Tensor)")
    # (grad_gemm was appended with its default, as int_linear's was: programs exported before it still load and run)


class _ScaleSpec(NamedTuple):
    factor: int
    clip: bool = True


def _forward(x, s, spec):  # y = clamp(x * factor * s, -1, 1) if clip; second output: a non-differentiable mask
    y = x * spec.factor * s
    mask = (y.abs() <= 1) if spec.clip else torch.ones_like(y, dtype=torch.bool)
    return y.clamp(-1, 1) if spec.clip else y, mask


def _fake(x, s, spec):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def _save(ctx, tensors, spec, output):
    ctx.save_for_backward(tensors[0], tensors[1], output[1])
    ctx.factor = spec.factor


def _backward(ctx, g, _gmask):
    x, s, mask = ctx.saved_tensors
    if g is None:
        return None, None
    gm = torch.where(mask, g, 0.0)
    return gm * ctx.factor * s, (gm * ctx.factor * x).sum().reshape(s.shape)


TOY = IntegerOp("intqat_test::scaled_clip", tensors=("x", "s"), spec=_ScaleSpec, outputs=2, forward=_forward,
                fake=_fake, save=_save, backward=_backward, eager_name="_ScaledClipEager")


def test_an_op_from_its_formulas_runs_eager_and_traced_with_the_same_gradients():
    assert TOY.schema == "(Tensor x, Tensor s, SymInt factor, bool clip=True) -> (Tensor, Tensor)"
    x = torch.linspace(-1, 1, 12, requires_grad=True)
    s = torch.tensor([0.7], requires_grad=True)
    spec = _ScaleSpec(3)
    y = TOY(x, s, spec=spec)[0]
    assert y.grad_fn.name() == "_ScaledClipEagerBackward"
    gx, gs = torch.autograd.grad(y.square().sum(), (x, s))
    y_op = TOY.op(x, s, *spec)[0]  # the custom op (what a tracer records), autograd through register_autograd
    assert torch.equal(y, y_op)
    gx_op, gs_op = torch.autograd.grad(y_op.square().sum(), (x, s))
    assert torch.equal(gx, gx_op) and torch.equal(gs, gs_op)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x, s: TOY(x, s, spec=spec)[0])(x.detach(), s.detach())
    assert "intqat_test.scaled_clip.default" in str(gm.graph)
    assert torch.equal(gm(x.detach(), s.detach()), y.detach())
    torch.library.opcheck(TOY.op, (x.detach(), s.detach(), 2, False))
