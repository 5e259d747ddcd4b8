"""Group captures by graph hash, so identical layers or stages get one graph directory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from intqat.graphs.capture import GraphCapture

MEMBERS_FILE = "members.txt"
# Directory names are hash prefixes; 16 hex digits make a collision among a model's graphs
# practically impossible while keeping paths short.
_DIR_HASH_CHARS = 16


@dataclass
class GraphGroup:
    graph_hash: str
    capture: GraphCapture  # the first capture seen with this hash stands for the group
    names: list[str] = field(default_factory=list)

    @property
    def dirname(self) -> str:
        return self.graph_hash[:_DIR_HASH_CHARS]


def dedupe(captures: Mapping[str, GraphCapture]) -> list[GraphGroup]:
    """{name: capture} -> one group per distinct graph hash, in first-seen order."""
    groups: dict[str, GraphGroup] = {}
    for name, capture in captures.items():
        group = groups.setdefault(capture.graph_hash, GraphGroup(capture.graph_hash, capture))
        group.names.append(name)
    return list(groups.values())


def save_groups(groups: list[GraphGroup], root: str | Path) -> list[Path]:
    """Write each group's graphs to root/<hash prefix>/ with members.txt naming who shares it."""
    dirs = []
    for group in groups:
        out = group.capture.save(Path(root) / group.dirname)
        (out / MEMBERS_FILE).write_text("\n".join(group.names) + "\n")
        dirs.append(out)
    return dirs
