"""The package order of docs/ARCHITECTURE.md holds in src/mptrain: no upward import, no import cycle.

The order has one home, the "Package order" list of docs/ARCHITECTURE.md: each line
``- **L<n>** `name` ...`` puts a package (``config/``) or top-level module (``check.py``) at level n.
A module may import its own package and packages of lower levels only; packages of one level do not
import each other. Every ``import`` statement counts: module level, inside functions (a lazy import
is still a dependency) and under ``if TYPE_CHECKING:`` (a type from a higher package is a
dependency on it; a Protocol in the lower package is the way down, as
`mptrain.layers.grad_accumulation_fusion.FusesGradAccumulation`). The module graph (same imports)
has no cycle. ``config/`` imports nothing of mptrain but ``errors``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mptrain"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
ORDER_LINE = re.compile(r"^- \*\*L(\d+)\*\* `([A-Za-z_]\w*)(?:\.py|/)?`")

# Known module cycles, each entry naming all of its modules: a cycle found within one entry's
# modules is not reported, nor an upward import between two of them.
def read_order(text: str) -> dict[str, int]:
    """{package or top-level module name: level} from the "Package order" list of ARCHITECTURE.md."""
    order: dict[str, int] = {}
    for line in text.splitlines():
        m = ORDER_LINE.match(line)
        if m:
            assert m.group(2) not in order, f"{m.group(2)} is listed twice in the package order"
            order[m.group(2)] = int(m.group(1))
    return order


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """``mptrain.layers.linear`` -> ``layers``, ``mptrain.check`` -> ``check``, ``mptrain`` -> ``mptrain``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def read_imports(src: Path) -> dict[str, set[tuple[str, int]]]:
    """{module: {(imported mptrain module, line)}} over every import statement of every module.

    ``from pkg import name`` names the submodule ``pkg.name`` when there is one, else ``pkg``.
    """
    files = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    top = src.name
    edges: dict[str, set[tuple[str, int]]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolved against this module's package
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
            else:
                continue
            for target in targets:
                if (target == top or target.startswith(top + ".")) and target != module:
                    while target not in files and "." in target:  # `import mptrain.a.b` of a name in a module
                        target = target.rsplit(".", 1)[0]
                    if target in files and target != module:
                        edges[module].add((target, node.lineno))
    return edges


def upward_edges(edges: dict, order: dict[str, int]) -> list[str]:
    """Imports of a package of the same or a higher level, as ``module:line -> module (L<a> -> L<b>)``."""
    bad = []
    for module, targets in sorted(edges.items()):
        a = package_of(module)
        for target, line in sorted(targets):
            b = package_of(target)
            if a != b and order[b] >= order[a]:
                bad.append(f"{module}:{line} -> {target} ({a} L{order[a]} -> {b} L{order[b]})")
    return bad


def module_cycles(edges: dict) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: sorted({t for t, _ in ts}) for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _cycle_text(cycle: list[str], edges: dict) -> str:
    members = set(cycle)
    return "; ".join(f"{m}:{line} -> {t}" for m in cycle for t, line in sorted(edges[m]) if t in members)


@pytest.fixture(scope="module")
def order() -> dict[str, int]:
    return read_order(ARCHITECTURE.read_text())


@pytest.fixture(scope="module")
def edges() -> dict:
    return read_imports(SRC)


def test_every_package_is_in_the_documented_order(order, edges):
    packages = {package_of(m) for m in edges}
    assert not packages - set(order), (
        f"not in docs/ARCHITECTURE.md's package order: {sorted(packages - set(order))}; add a line for each")
    stale = sorted(set(order) - packages)
    assert not stale, f"listed in the package order but not in src/mptrain: {stale}"


def test_no_upward_import(order, edges):
    bad = upward_edges(edges, order)
    assert not bad, "imports against docs/ARCHITECTURE.md's package order:\n" + "\n".join(bad)


def test_no_module_cycle(edges):
    cycles = module_cycles(edges)
    assert not cycles, "import cycles between modules:\n" + "\n".join(_cycle_text(c, edges) for c in cycles)


def test_config_imports_only_errors(edges):
    bad = [f"{m}:{line} -> {t}" for m, ts in sorted(edges.items()) if package_of(m) == "config"
           for t, line in sorted(ts) if package_of(t) not in ("config", "errors")]
    assert not bad, "config/ is the schema: it imports nothing of mptrain but errors:\n" + "\n".join(bad)


def test_the_checks_see_every_kind_of_import(tmp_path):
    """The reader on a small tree: function-level, TYPE_CHECKING and relative imports are edges;
    an upward import and a cycle are reported with their lines."""
    pkg = tmp_path / "mptrain"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from mptrain.high import b\n")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high.b import X\n"
    (pkg / "low" / "c.py").write_text(type_only)
    (pkg / "high" / "b.py").write_text("from mptrain.low import a\nimport mptrain.low.c\n")
    order = read_order("- **L0** `mptrain`: root\n- **L1** `low/`: low\n- **L2** `high/`: high\n")
    assert order == {"mptrain": 0, "low": 1, "high": 2}
    edges = read_imports(pkg)
    assert edges["mptrain.low.a"] == {("mptrain.high.b", 2)}
    assert edges["mptrain.low.c"] == {("mptrain.high.b", 3)}
    assert upward_edges(edges, order) == ["mptrain.low.a:2 -> mptrain.high.b (low L1 -> high L2)",
                                          "mptrain.low.c:3 -> mptrain.high.b (low L1 -> high L2)"]
    assert module_cycles(edges) == [["mptrain.high.b", "mptrain.low.a", "mptrain.low.c"]]
    peers = read_order("- **L0** `mptrain`: root\n- **L1** `low/`: low\n- **L1** `high/`: peer\n")
    assert len(upward_edges(edges, peers)) == 4  # same level: neither imports the other
