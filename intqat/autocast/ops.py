"""Op tables and op-target helpers shared by the classifier and the cast pass.

Tables name aten op *packets* ("softmax" matches every overload of aten.softmax). Both the
training IR that torch.export.export emits (aten.linear, aten.softmax.int) and the inference
IR that run_decompositions() emits (aten.addmm, aten._softmax.default) are listed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

aten = torch.ops.aten

# Ops kept in fp32 unless the caller passes its own fp32_ops. Why each group:
# - softmax family: exp of the max-shifted logits then a normalising sum; bf16's 8-bit
#   mantissa flattens near-equal probabilities and log-probs lose ~2 digits.
# - norms: mean/variance over a whole row or channel; cancellation in x - mean and the
#   rsqrt of a small variance amplify bf16 rounding.
# - exp/log/pow: relative error grows with the magnitude of the argument or exponent.
# - sum/mean/var/std/prod/cumsum/logsumexp: long accumulations; ulp(bf16) at 256 is 2, so
#   adding small terms to a large partial sum loses them. Reductions are memory-bound, so
#   fp32 costs little.
# - losses: reductions over log/exp of probabilities.
DEFAULT_FP32_OP_NAMES: tuple[str, ...] = (
    "softmax", "_softmax", "_safe_softmax", "log_softmax", "_log_softmax",
    "layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
    "batch_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "instance_norm", "rms_norm", "_fused_rms_norm",
    "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow",
    "sum", "nansum", "mean", "var", "std", "var_mean", "std_mean", "prod",
    "cumsum", "cumprod", "logsumexp", "norm", "linalg_vector_norm",
    "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "mse_loss", "kl_div",
)

# Precision follows the inputs (MXNet's widest_dtype_ops): the op gets the widest
# precision among its computed inputs, so fp32 + bf16 is computed in fp32 and never
# silently rounds the fp32 side. Pure data movement is here too, so a reshape between
# two ops never costs a cast of its own.
WIDEST_TYPE_OP_NAMES: tuple[str, ...] = (
    "add", "sub", "mul", "div", "maximum", "minimum", "where", "masked_fill",
    "cat", "concat", "concatenate", "stack", "hstack", "vstack",
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand",
    "expand_as", "view_as", "squeeze", "unsqueeze", "flatten", "unflatten", "slice",
    "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "clone",
    "contiguous", "alias", "detach", "repeat", "roll", "flip", "constant_pad_nd",
    "gather", "index_select", "index", "_unsafe_index", "take_along_dim",
)

# Ops whose integer/bool tensor arguments are indices or masks: these do not make the op
# an integer op, so where(mask, a, b) or an embedding lookup is still a float op.
INDEX_ARG_OP_NAMES: tuple[str, ...] = (
    "where", "masked_fill", "index_select", "gather", "index", "_unsafe_index",
    "index_put", "index_add", "index_copy", "scatter", "scatter_add", "scatter_reduce",
    "take_along_dim", "embedding", "embedding_bag", "masked_scatter",
)

# Recurrent layers' ops (nn.LSTM / nn.GRU / nn.RNN export as one aten.lstm / gru / rnn_* node): always fp32 (rule
# recurrent_op). Their state is carried from step to step, so a rounding compounds with the sequence length; intqat
# has no integer recurrent layer, and the census names them float. And the cast pass could not recompute such a
# node's output dtype on fake inputs: at::native::lstm calls numel() on its input, which a dynamic batch makes
# symbolic ("Cannot call numel() on tensor with symbolic sizes/strides"); an fp32 node keeps its inputs as they were
# and needs no recomputation.
RECURRENT_OP_NAMES: tuple[str, ...] = (
    "lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
)

# Elementwise ops without torch.Tag.pointwise (which covers relu, gelu, tanh, clamp, ...):
# an elementwise op kept between fp32 neighbours stays fp32 (rules: isolated_elementwise).
ELEMENTWISE_EXTRA_OP_NAMES: tuple[str, ...] = ("hardswish", "prelu", "_prelu_kernel", "dropout",
                                               "feature_dropout", "alpha_dropout")

# Explicit dtype conversions written by the user (or inserted by a previous pass): their
# output dtype is fixed by the op, so they take their input in whatever dtype it arrives.
CAST_OP_NAMES: tuple[str, ...] = ("_to_copy", "to", "type_as", "_autocast_to_reduced_precision",
                                  "_autocast_to_full_precision")


def _packets(names: tuple[str, ...]) -> frozenset[OpOverloadPacket]:
    # hasattr: a name missing from this torch build is skipped, not an import error.
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


WIDEST_TYPE_OPS = _packets(WIDEST_TYPE_OP_NAMES)
INDEX_ARG_OPS = _packets(INDEX_ARG_OP_NAMES)
CAST_OPS = _packets(CAST_OP_NAMES)
RECURRENT_OPS = _packets(RECURRENT_OP_NAMES)
ELEMENTWISE_EXTRA_OPS = _packets(ELEMENTWISE_EXTRA_OP_NAMES)


def is_elementwise(target: Any) -> bool:
    """Each output element is a function of the same element of each input."""
    if not isinstance(target, OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket in ELEMENTWISE_EXTRA_OPS


def packet_of(target: Any) -> Any:
    return target.overloadpacket if isinstance(target, OpOverload) else target


def resolve_op(spec: Any, what: str) -> Any:
    """An OpOverload/OpOverloadPacket/HigherOrderOperator from an op or a name such as
    "aten.softmax.int", "aten.softmax", "softmax" (aten assumed) or "torch.ops.aten.mm"."""
    if isinstance(spec, (OpOverload, OpOverloadPacket, HigherOrderOperator)):
        return spec
    if not isinstance(spec, str):
        raise ValueError(
            f"{what}: expected an aten op such as torch.ops.aten.softmax.int or the string "
            f"'aten.softmax', got {spec!r} ({type(spec).__name__})"
        )
    parts = spec.removeprefix("torch.ops.").split(".")
    ns, rest = ("aten", parts) if len(parts) == 1 else (parts[0], parts[1:])
    try:
        op = getattr(getattr(torch.ops, ns), rest[0])
        if len(rest) == 2:
            op = getattr(op, rest[1])
        elif len(rest) > 2:
            raise AttributeError(spec)
    except (AttributeError, RuntimeError):
        raise ValueError(f"{what}: unknown op {spec!r} (expected e.g. 'aten.softmax.int')") from None
    return op


class OpSet:
    """Targets matched exactly (an overload) or by packet (every overload of an op)."""

    def __init__(self, specs, what: str):
        ops = [resolve_op(s, what) for s in specs]
        self._packets = frozenset(o for o in ops if isinstance(o, OpOverloadPacket))
        self._exact = frozenset(o for o in ops if not isinstance(o, OpOverloadPacket))

    def __contains__(self, target: Any) -> bool:
        return target in self._exact or packet_of(target) in self._packets

    def __len__(self) -> int:
        return len(self._packets) + len(self._exact)


def default_fp32_ops() -> tuple[OpOverloadPacket, ...]:
    return tuple(sorted(_packets(DEFAULT_FP32_OP_NAMES), key=str))


def schema_arg_names(op: Any) -> set[str]:
    """All argument names of an overload, or of every overload of a packet."""
    if isinstance(op, OpOverload):
        return {a.name for a in op._schema.arguments}
    if isinstance(op, OpOverloadPacket):
        return {a.name for ov in op.overloads() for a in getattr(op, ov)._schema.arguments}
    return set()


_MISSING = object()


def arg_value(node: torch.fx.Node, name: str) -> Any:
    """The value bound to schema argument `name` (kwarg, positional, or schema default);
    _MISSING when the op has no such argument."""
    target = node.target
    if not isinstance(target, OpOverload):
        return _MISSING
    positional = 0
    for arg in target._schema.arguments:
        if arg.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            if not arg.kwarg_only and positional < len(node.args):
                return node.args[positional]
            return arg.default_value if arg.has_default_value() else _MISSING
        if not arg.kwarg_only:
            positional += 1
    return _MISSING


def with_arg(node: torch.fx.Node, name: str, value: Any) -> None:
    """Rebind schema argument `name` of `node` in place (positional or keyword)."""
    positional = 0
    for arg in node.target._schema.arguments:
        if arg.name == name:
            if not arg.kwarg_only and positional < len(node.args):
                args = list(node.args)
                args[positional] = value
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, name: value}
            return
        if not arg.kwarg_only:
            positional += 1


def target_name(target: Any) -> str:
    if isinstance(target, HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, (OpOverload, OpOverloadPacket)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', repr(target))}"


def tensors(val: Any) -> list[torch.Tensor]:
    """The tensors in a node's meta["val"] (a tensor, or a tuple/list of them)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for v in val for t in tensors(v)]
    return []


def node_dtype(node: Any) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None
