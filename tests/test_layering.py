"""The package's layering, read from the source with ast (nothing is imported):

(a) no import cycle among intqat's modules, function-level imports included (an import inside a function
    hides a cycle from the interpreter, not from the reader): the strongly connected components of the module
    graph are single modules, once the edges listed in EXPECTED_CYCLE_EDGES (each with its reason) are set aside;
(b) the backends (intqat/ops/backends/*) import nothing from the op files (int_linear, int_conv2d,
    int_linear_grouped): the ops call the table, the table never calls back up;
(c) no file in intqat/ (kernels/ included: it installs as intqat.kernels) is over MAX_LINES lines.

The graph: an edge m -> t for each `import t` / `from t import x` in m (t = the longest intqat module the name
names: `from intqat.ops import backends` is an edge to intqat.ops.backends, `from intqat import to_integer` one
to the package intqat itself). Imports under `if TYPE_CHECKING:` never run and are left out. The parent
packages an import runs first (intqat/__init__.py for any intqat.x) are not edges: every module would otherwise
be in a cycle with the package that re-exports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ((ROOT / "intqat", "intqat"), (ROOT / "kernels", "intqat.kernels"))  # (directory, its module name)
MAX_LINES = 700  # issue #25: small files with one purpose; ~500 lines wants a reason written at the file's top
OP_FILES = {"intqat.ops.int_linear", "intqat.ops.int_conv2d", "intqat.ops.int_linear_grouped"}

# importer -> imported: the only edges allowed to close a cycle, each with why it is still there. The four the
# backends had (reference / triton -> the op files, for split_digits, grouped_reference, mask packing and
# weight_colsum) went when those formulas moved to intqat/ops/backends/formulas.py. A stale entry fails
# test_expected_edges_exist.
EXPECTED_CYCLE_EDGES: dict[tuple[str, str], str] = {}  # none left: each entry would need its reason
# (b)'s exceptions: the same items, seen from the rule that backends import no op file.
EXPECTED_BACKEND_TO_OP = {edge for edge in EXPECTED_CYCLE_EDGES if edge[1] in OP_FILES}


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    found = {}
    for directory, package in SOURCES:
        for path in sorted(directory.rglob("*.py")):
            parts = [package, *path.relative_to(directory).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports that never run."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return skipped


def _graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, dict[str, int]]:
    """module -> {imported intqat module: the first line importing it}."""

    def known(name: str) -> str | None:  # the longest prefix of name that is an intqat module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        package = module if is_package else module.rpartition(".")[0]
        targets: dict[str, int] = {}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, up level - 1 packages
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else known(source)
                         for a in node.names]
            else:
                continue
            for name in names:
                if name is not None and name != module:
                    targets[name] = min(targets.get(name, node.lineno), node.lineno)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


@pytest.fixture(scope="module")
def graph():
    return _graph(_modules())


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"  {m}:{line} imports {t}" for m in component for t, line in sorted(graph[m].items())
             if t in component]
    return "cycle among " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_graph_sees_function_level_imports(graph):
    """The parser sees what the checks rely on: module-level, function-level and relative imports."""
    assert "intqat.ops.backends" in graph["intqat.ops.quant"]  # module level
    assert "intqat.ops.qparams" in graph["intqat.ops.backends.reference"]  # inside a method
    assert "intqat.callback" in graph["intqat"]  # inside intqat.__getattr__
    assert len(graph) > 80, "the module walk found too few files"


def test_no_import_cycle(graph):
    """(a) Once the expected edges are set aside, no two intqat modules import each other, even indirectly."""
    pruned = {m: {t: line for t, line in targets.items() if (m, t) not in EXPECTED_CYCLE_EDGES}
              for m, targets in graph.items()}
    cycles = _cycles(pruned)
    assert not cycles, "\n".join(_describe(c, pruned) for c in cycles)


def test_expected_edges_exist_and_close_a_cycle(graph):
    """Each entry of EXPECTED_CYCLE_EDGES is still an import that closes a cycle: otherwise delete it."""
    cyclic = {m for component in _cycles(graph) for m in component}
    stale = [edge for edge in EXPECTED_CYCLE_EDGES if edge[1] not in graph[edge[0]] or edge[0] not in cyclic]
    assert not stale, f"these imports no longer close a cycle: remove them from EXPECTED_CYCLE_EDGES: {stale}"


def test_backends_import_no_op_file(graph):
    """(b) intqat/ops/backends/* import nothing from int_linear.py, int_conv2d.py, int_linear_grouped.py."""
    found = {(m, t) for m, targets in graph.items() if m.startswith("intqat.ops.backends")
             for t in targets if t in OP_FILES}
    assert found - EXPECTED_BACKEND_TO_OP == set(), sorted(found - EXPECTED_BACKEND_TO_OP)
    assert EXPECTED_BACKEND_TO_OP - found == set(), f"gone: remove from the expected list: {EXPECTED_BACKEND_TO_OP - found}"


def test_no_file_over_max_lines():
    """(c) Every file of the package is at most MAX_LINES lines."""
    long = {str(path.relative_to(ROOT)): n for path, _ in _modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, split by purpose: {long}"


def test_cycle_finder_finds_a_planted_cycle():
    """The checker can fail: a three-module ring and a self-contained pair are both reported."""
    ring = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}, "e": {"f": 1}, "f": {"e": 1}}
    assert sorted(_cycles(ring)) == [["a", "b", "c"], ["e", "f"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []
