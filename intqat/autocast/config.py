"""AutocastConfig: the arguments of convert(), checked once, with errors that name the
argument at fault and show a corrected call."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .ops import OpSet, default_fp32_ops, resolve_op, schema_arg_names

LOW_PRECISION_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_DTYPE_ALIASES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                  "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


def _as_tuple(value: Any, what: str) -> tuple:
    # A bare string is one entry, not a sequence of characters.
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"{what} must be a list/tuple, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True)
class ConditionalFP32:
    """(op, argument name, values): the node stays fp32 when the argument has one of them."""

    op: Any
    arg: str
    values: tuple

    @classmethod
    def parse(cls, entry: Any, index: int) -> "ConditionalFP32":
        what = f"conditional_fp32_ops[{index}]"
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise ValueError(
                f"{what} must be a tuple (op, argument_name, values), got {entry!r}; e.g. "
                "(torch.ops.aten.gelu.default, 'approximate', ['tanh'])"
            )
        op, arg, values = entry
        op = resolve_op(op, what)
        if not isinstance(arg, str):
            raise ValueError(f"{what}: argument name must be a str, got {arg!r}")
        names = schema_arg_names(op)
        if arg not in names:
            raise ValueError(f"{what}: {op} has no argument {arg!r} (it has {sorted(names)})")
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise ValueError(f"{what}: values must be a list/tuple of values, got {values!r}")
        return cls(op, arg, tuple(values))

    def matches(self, target: Any) -> bool:
        return target == self.op or getattr(target, "overloadpacket", None) == self.op


@dataclass
class AutocastConfig:
    low_precision_type: Any = torch.bfloat16
    calibration_data: Any = None
    nodes_to_exclude: Any = ()
    targets_to_exclude: Any = ()
    fp32_ops: Any = None  # None: DEFAULT_FP32_OP_NAMES
    low_precision_ops: Any = None  # None: every float op not sent to fp32 by a rule
    conditional_fp32_ops: Any = ()
    data_max: float = 512.0  # Torch-TensorRT / ModelOpt default
    max_depth_of_reduction: int | None = None
    cast_optional_params: bool = True
    integer_module_types: Any = ("IntLinear", "IntConv2d")
    # Filled by __post_init__.
    node_patterns: tuple[re.Pattern, ...] = field(init=False)
    excluded_targets: OpSet = field(init=False)
    fp32_targets: OpSet = field(init=False)
    low_targets: OpSet | None = field(init=False)
    conditionals: tuple[ConditionalFP32, ...] = field(init=False)

    def __post_init__(self):
        lp = _DTYPE_ALIASES.get(self.low_precision_type, self.low_precision_type) \
            if isinstance(self.low_precision_type, str) else self.low_precision_type
        if lp not in LOW_PRECISION_TYPES:
            raise ValueError(
                f"low_precision_type must be torch.bfloat16 or torch.float16, got "
                f"{self.low_precision_type!r}; e.g. convert(ep, low_precision_type=torch.bfloat16)"
            )
        self.low_precision_type = lp

        patterns = []
        for p in _as_tuple(self.nodes_to_exclude, "nodes_to_exclude"):
            if not isinstance(p, str):
                raise TypeError(f"nodes_to_exclude entries must be regex strings, got {p!r}")
            try:
                patterns.append(re.compile(p))
            except re.error as e:
                raise ValueError(f"nodes_to_exclude: bad regex {p!r}: {e}") from None
        self.node_patterns = tuple(patterns)

        self.excluded_targets = OpSet(_as_tuple(self.targets_to_exclude, "targets_to_exclude"),
                                      "targets_to_exclude")
        fp32 = default_fp32_ops() if self.fp32_ops is None else _as_tuple(self.fp32_ops, "fp32_ops")
        self.fp32_targets = OpSet(fp32, "fp32_ops")
        self.low_targets = None if self.low_precision_ops is None else OpSet(
            _as_tuple(self.low_precision_ops, "low_precision_ops"), "low_precision_ops")

        entries = self.conditional_fp32_ops
        if isinstance(entries, tuple) and len(entries) == 3 and isinstance(entries[1], str):
            raise ValueError(
                "conditional_fp32_ops must be a list of (op, argument_name, values) tuples; "
                f"got a single tuple {entries!r}: wrap it in a list"
            )
        self.conditionals = tuple(ConditionalFP32.parse(e, i) for i, e in
                                  enumerate(_as_tuple(entries, "conditional_fp32_ops")))

        if isinstance(self.data_max, bool) or not isinstance(self.data_max, (int, float)) \
                or not self.data_max > 0:
            raise ValueError(f"data_max must be a positive number, got {self.data_max!r}")
        mdr = self.max_depth_of_reduction
        if mdr is not None and (isinstance(mdr, bool) or not isinstance(mdr, int) or mdr <= 0):
            raise ValueError(f"max_depth_of_reduction must be None or a positive int, got {mdr!r}")
        if not isinstance(self.cast_optional_params, bool):
            raise TypeError(f"cast_optional_params must be a bool, got {self.cast_optional_params!r}")
        if isinstance(self.calibration_data, torch.Tensor):
            raise TypeError(
                "calibration_data must be a list of input tuples or a dataloader, got a bare "
                "Tensor; pass [(x,)] to calibrate on one batch"
            )
        if self.calibration_data is not None and not isinstance(self.calibration_data, Iterable):
            raise TypeError(f"calibration_data must be iterable, got {type(self.calibration_data).__name__}")
        types = _as_tuple(self.integer_module_types, "integer_module_types")
        if not all(isinstance(t, str) and t for t in types):
            raise TypeError(f"integer_module_types must be class names (str), got {types!r}")
        self.integer_module_types = types

    @property
    def low_name(self) -> str:
        return LOW_PRECISION_TYPES[self.low_precision_type]
