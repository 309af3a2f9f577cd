"""skymesh/balancer/ imports in one direction: no module of it is part of an import cycle
(through any skymesh module, type-checking imports included), and no function imports a
project module unless a comment on that line or the one above says why (an optional
dependency). The mesh services reach the balancer through skymesh/balancer/ports.py, not
by importing the server. Checked on the source with ``ast``, like test_routing_purity."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

SKYMESH_DIR = Path(__file__).resolve().parent.parent / "skymesh"
BALANCER_PACKAGE = "skymesh.balancer"

# function-level project imports left where they are, with the reason: (module, function);
# none today (the region assembly moved out of server.py to skymesh/assembly.py)
ALLOWED_FUNCTION_IMPORTS: Mapping[tuple[str, str], str] = {}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_names(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> Iterator[str]:
    """The module names an import statement may load (``from p import m`` may load p.m)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:  # relative: resolved against the importing module's package
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        module = ".".join([*base, node.module] if node.module else base)
    else:
        module = node.module or ""
    yield module
    yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph(root: Path) -> dict[str, set[str]]:
    """skymesh module -> the skymesh modules it imports anywhere in its source."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = graph.setdefault(name, set())
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for imported in _imported_names(node, name, path.name == "__init__.py"):
                    if imported in paths and imported != name:
                        edges.add(imported)
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def unexplained_function_imports(source: str, module: str) -> list[str]:
    """``module:line: what`` for each project import inside a function with no comment on
    its line or the line above, and not in ALLOWED_FUNCTION_IMPORTS."""
    lines = source.splitlines()
    found: list[str] = []

    def scan(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                scan(child, child.name)
                continue
            if function is not None and isinstance(child, ast.Import | ast.ImportFrom):
                names = list(_imported_names(child, module, False))
                if any(n == "skymesh" or n.startswith("skymesh.") for n in names):
                    here = lines[child.lineno - 1]
                    above = lines[child.lineno - 2] if child.lineno > 1 else ""
                    explained = "#" in here or above.strip().startswith("#")
                    if not explained and (module, function) not in ALLOWED_FUNCTION_IMPORTS:
                        found.append(f"{module}:{child.lineno}: {function}() imports {names[0]}")
            scan(child, function)

    scan(ast.parse(source, module), None)
    return found


def test_no_import_cycle_reaches_the_balancer() -> None:
    graph = import_graph(SKYMESH_DIR)
    assert any(m.startswith(BALANCER_PACKAGE + ".") for m in graph), f"no balancer modules under {SKYMESH_DIR}"
    through_balancer = [c for c in cycles(graph) if any(m.startswith(BALANCER_PACKAGE) for m in c)]
    assert not through_balancer, "import cycles through skymesh/balancer/:\n" + "\n".join(
        " <-> ".join(c) for c in through_balancer)


def test_services_do_not_import_the_server() -> None:
    graph = import_graph(SKYMESH_DIR)
    assert "skymesh.balancer.server" not in graph["skymesh.balancer.services"]
    assert "skymesh.balancer.server" not in graph["skymesh.balancer.ports"]


def test_balancer_has_no_unexplained_function_level_project_imports() -> None:
    files = sorted((SKYMESH_DIR / "balancer").rglob("*.py"))
    found = [v for path in files
             for v in unexplained_function_imports(path.read_text(), module_name(path, SKYMESH_DIR))]
    assert not found, "function-level project imports without a reason:\n" + "\n".join(found)


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


@pytest.mark.parametrize(("snippet", "expected"), [
    ("def f():\n    from skymesh.x import y\n", ["m:2: f() imports skymesh.x"]),
    ("async def g():\n    import skymesh.x\n", ["m:2: g() imports skymesh.x"]),
    ("def f():\n    # optional: needs the tokenizers wheel\n    from skymesh.x import y\n", []),
    ("def f():\n    import json\n", []),
    ("from skymesh.x import y\n", []),
])
def test_function_import_checker(snippet: str, expected: list[str]) -> None:
    """The checker can fail: an unexplained project import in a function is reported."""
    assert unexplained_function_imports(snippet, "m") == expected
