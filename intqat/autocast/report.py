"""AutocastReport: what convert() decided for each node and which rule decided it."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class NodeDecision:
    name: str  # node name in the input program ("hop/inner" for nodes inside a HOP region)
    op: str  # e.g. "aten.linear.default"
    precision: str  # "bf16"/"fp16", "fp32" or "unchanged"
    rule: str  # one of rules.RULES


@dataclass
class AutocastReport:
    low_precision_type: str
    nodes: list[NodeDecision] = field(default_factory=list)
    cast_params: list[str] = field(default_factory=list)  # state-dict keys now stored low
    casts_inserted: int = 0
    stored_bytes_before: int = 0  # params + buffers + constants
    stored_bytes_after: int = 0

    def __getitem__(self, name: str) -> NodeDecision:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in the report")

    def precisions(self) -> dict[str, str]:
        return {n.name: n.precision for n in self.nodes}

    def counts(self) -> dict[str, int]:
        return dict(Counter(n.precision for n in self.nodes))

    def to_dict(self) -> dict:
        return {
            "low_precision_type": self.low_precision_type,
            "counts": self.counts(),
            "casts_inserted": self.casts_inserted,
            "cast_params": list(self.cast_params),
            "stored_bytes": {"before": self.stored_bytes_before, "after": self.stored_bytes_after},
            "nodes": [asdict(n) for n in self.nodes],
        }

    def to_markdown(self) -> str:
        rows = ["| name | op | precision | rule |", "|---|---|---|---|"]
        rows += [f"| {n.name} | {n.op} | {n.precision} | {n.rule} |" for n in self.nodes]
        return "\n".join(rows)
