"""Rule-based mixed precision (autocast) for exported intqat programs.

convert(ep) -> (ep_low, report): float ops run in bf16/fp16 unless a rule keeps them in
fp32; integer layers (IntLinear, IntConv2d) and every integer op are left exactly as they
are. See convert.py for the pipeline and rules.RULES for the rules in order.
"""

from .casts import remove_redundant_casts
from .config import AutocastConfig
from .convert import convert
from .ops import DEFAULT_FP32_OP_NAMES, WIDEST_TYPE_OP_NAMES, default_fp32_ops
from .report import AutocastReport, NodeDecision
from .rules import RULES, Decision, classify

__all__ = [
    "convert", "AutocastReport", "NodeDecision", "AutocastConfig", "Decision", "RULES",
    "classify", "remove_redundant_casts", "default_fp32_ops", "DEFAULT_FP32_OP_NAMES",
    "WIDEST_TYPE_OP_NAMES",
]
