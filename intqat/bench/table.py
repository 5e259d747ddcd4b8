"""One plain-text, aligned table per subcommand (and the same data as a dict for --json)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Table", "fmt_num", "fmt_ratio", "fmt_bytes", "NA"]

NA = "n/a"


def fmt_num(v: float | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return NA
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def fmt_ratio(v: float | None) -> str:
    return NA if v is None else f"{v:.2f}x"


def fmt_bytes(n: int | None, unit: str = "MiB") -> str:
    if n is None:
        return NA
    div = {"KiB": 2**10, "MiB": 2**20}[unit]
    return f"{n / div:.2f}"


@dataclass
class Table:
    """Rows of cells under a header; `groups` start a titled block of rows."""

    title: str
    header_lines: list[str]
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    footnotes: list[str] = field(default_factory=list)
    data: list[dict[str, Any]] = field(default_factory=list)  # the raw numbers, for --json
    meta: dict[str, Any] = field(default_factory=dict)  # machine and settings, for --json
    _group_at: dict[int, str] = field(default_factory=dict)

    def group(self, title: str) -> None:
        self._group_at[len(self.rows)] = title

    def add(self, cells: list[str], record: dict[str, Any] | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells for {len(self.columns)} columns: {cells}")
        self.rows.append(cells)
        if record is not None:
            self.data.append(record)

    def render(self) -> str:
        widths = [max(len(c), *(len(r[i]) for r in self.rows)) if self.rows else len(c) for i, c in enumerate(self.columns)]

        def line(cells):  # first column left-aligned (names), numbers right-aligned
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        rule = "-" * len(line(["-" * w for w in widths]))
        out = [self.title, *self.header_lines, rule, line(self.columns), rule]
        for i, r in enumerate(self.rows):
            if i in self._group_at:
                if i:
                    out.append("")
                out.append(f"[{self._group_at[i]}]")
            out.append(line(r))
        out.append(rule)
        out += self.footnotes
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "header": self.header_lines,
            "columns": self.columns,
            "rows": self.rows,
            "footnotes": self.footnotes,
            "data": self.data,
            **self.meta,
        }
