"""The project's modules (skymesh/, controller/) import one another in one direction: no
import cycle, and no import from a lower layer into a higher one.

The import graph is read from the source with ``ast`` (no module is imported): every
``import`` and ``from ... import`` of a project module, at a module's top or inside a
function (a function-level import still runs, only later); ``if TYPE_CHECKING:`` blocks are
skipped (they never run). ``from pkg import name`` depends on ``pkg.name`` when that is a
module, else on ``pkg`` (its ``__init__``). skymesh/proto_gen is generated code: it is a
node (others import it) but its own imports are not read. Imports made by name at run time
(``importlib.import_module`` in skymesh/cli.py and skymesh/bench/main.py, the subcommands'
modules) are not seen; both modules are in the top layer, where any import is allowed.

``LAYERS`` is the order, lowest first, drawn from what the code is: a module may import its
own layer and lower ones. Each violation is named as ``file:line: module imports module``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("skymesh", "controller")
GENERATED = ("skymesh.proto_gen",)  # a node in the graph; its own imports are not read

# lowest first: (layer, module prefixes in it); a module's layer is its longest matching prefix
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # leaf helpers: import no other layer (the word tokenizer, validation messages, hardware
    # profiles, source networks, packaged assets and their builders, cache-hit prediction,
    # the generated gRPC code)
    ("foundations", ("skymesh.word_tokenizer", "skymesh.validation", "skymesh.hardware",
                     "skymesh.source_networks", "skymesh.assets", "skymesh.cache_prediction",
                     "skymesh.proto_gen")),
    # the pure routing core (no I/O, no clock; tests/test_routing_purity.py) and the prompt ->
    # chunk-hash encoder built on its hashing
    ("routing", ("skymesh.routing", "skymesh.prompt_encoder")),
    # the typed config: it validates the policy, queue and option sections against the
    # routing core's registries, so it sits above routing
    ("config", ("skymesh.config",)),
    # what every process shares, built on the config: the HTTP edge (server, bodies, OpenAI
    # errors), mTLS and tokens, process/runtime plumbing, the context-window check, the SLO
    # judge and the config -> routing-settings assembly
    ("shared", ("skymesh.edge", "skymesh.security", "skymesh.runtime", "skymesh.context_window",
                "skymesh.slo_judge", "skymesh.assembly")),
    # the daemons and the test harnesses: the balancer, the vLLM stand-in, the DNS server,
    # the tool environments of the tests (vllm, checkov, prometheus, clients)
    ("components", ("skymesh.balancer", "skymesh.replica_sim", "skymesh.dns", "skymesh.testing")),
    # what drives components: the controller (reads the balancer's identity naming), `skymesh
    # up` / status / resolve (start the DNS server, prometheus from the testing env)
    ("orchestration", ("controller", "skymesh.operations")),
    # benchmarks and the simulator: run the routing core over the replica stand-in's engine,
    # start whole meshes (operations)
    ("bench", ("skymesh.bench",)),
    # the `skymesh` command: dispatches to every subcommand's module
    ("cli", ("skymesh.cli",)),
)

# (importing module, imported module) -> why this import must run against the layer order.
# Empty: add an entry only with a reason a better module boundary cannot remove.
EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    file: str
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.src} imports {self.dst}"


def module_name(rel: str) -> str:
    """``skymesh/bench/des.py`` -> ``skymesh.bench.des``; a package's ``__init__.py`` -> the package."""
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at any depth, outside ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        else:
            visit(node)

    visit(tree)
    return found


def _known(name: str, modules: set[str]) -> str | None:
    """The project module ``name`` runs: itself, or its nearest enclosing known package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(source: str, rel: str, modules: set[str]) -> list[Edge]:
    """The project modules ``source`` (the file ``rel``, relative to the repository root)
    imports, one edge per (statement, imported module)."""
    src = module_name(rel)
    package = src.split(".") if rel.endswith("__init__.py") else src.split(".")[:-1]
    edges: list[Edge] = []
    for node in _import_nodes(ast.parse(source, rel)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level == 0:
                base = node.module or ""
            else:
                up = package[: len(package) - (node.level - 1)]
                base = ".".join([*up, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        for dst in dict.fromkeys(t for name in targets if (t := _known(name, modules)) is not None):
            if dst != src:
                edges.append(Edge(src, dst, rel, node.lineno))
    return edges


def project_graph() -> list[Edge]:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    rels = [p.relative_to(ROOT).as_posix() for p in files]
    modules = {module_name(r) for r in rels}
    return [e for rel in rels if not module_name(rel).startswith(GENERATED)
            for e in imports_of((ROOT / rel).read_text(), rel, modules)]


def find_cycle(edges: Iterable[Edge]) -> list[Edge] | None:
    """One import cycle, as the edges that close it (first module first), or None."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        out.setdefault(e.src, []).append(e)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[Edge] = []

    def dfs(node: str) -> list[Edge] | None:
        state[node] = 1
        for e in out.get(node, []):
            if state.get(e.dst) == 1:
                start = next(i for i, p in enumerate(path) if p.src == e.dst) if e.dst != node else len(path)
                return [*path[start:], e]
            if e.dst not in state:
                path.append(e)
                found = dfs(e.dst)
                if found is not None:
                    return found
                path.pop()
        state[node] = 2
        return None

    for node in sorted(out):
        if node not in state:
            found = dfs(node)
            if found is not None:
                return found
    return None


def describe_cycle(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].src, *(e.dst for e in cycle)]) + "\n" + "\n".join(
        "  " + e.where() for e in cycle)


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index)
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    return None if best is None else best[1]


def layer_violations(edges: Iterable[Edge], layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS,
                     exceptions: Mapping[tuple[str, str], str] = EXCEPTIONS) -> list[str]:
    found: list[str] = []
    for e in edges:
        a, b = layer_of(e.src, layers), layer_of(e.dst, layers)
        if a is None or b is None or b <= a or (e.src, e.dst) in exceptions:
            continue
        found.append(f"{e.where()} (layer {layers[a][0]} imports the higher layer {layers[b][0]})")
    return found


def test_the_graph_is_read() -> None:
    edges = project_graph()
    assert len(edges) > 300, f"only {len(edges)} imports found"
    seen = {(e.src, e.dst) for e in edges}
    # a top-level, a function-level and a package-relative spelling are all read
    assert ("skymesh.bench.sim_main", "skymesh.bench.search_main") in seen
    assert ("skymesh.cli", "skymesh.bench.main") in seen  # function-level
    assert ("controller.service", "skymesh.proto_gen.mesh_pb2") in seen  # from package import module


def test_no_import_cycle() -> None:
    cycle = find_cycle(project_graph())
    assert cycle is None, "import cycle (break it with a module both sides import):\n" + describe_cycle(cycle)


def test_every_module_has_a_layer() -> None:
    edges = project_graph()
    modules = {e.src for e in edges} | {e.dst for e in edges}
    missing = sorted(m for m in modules if layer_of(m) is None and m != "skymesh")
    assert not missing, f"modules in no layer of LAYERS (add their package to one): {missing}"


def test_imports_run_down_the_layers() -> None:
    violations = layer_violations(project_graph())
    assert not violations, (
        "an import from a lower layer into a higher one (move what is shared down, or list it "
        "in EXCEPTIONS with the reason):\n" + "\n".join(violations))


def test_exceptions_are_still_needed() -> None:
    seen = {(e.src, e.dst) for e in project_graph()}
    stale = [k for k in EXCEPTIONS if k not in seen]
    assert not stale, f"EXCEPTIONS names imports that no longer exist: {stale}"


def own_names(source: str) -> set[str]:
    """The names a module's top level defines itself (functions, classes, assignments),
    not the ones it imports."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def borrowed_imports(source: str, rel: str, module: str, own: set[str]) -> list[str]:
    """``file:line: name`` for each name ``source`` imports from ``module`` that ``module``
    does not define (it only imports it for its own use)."""
    return [f"{rel}:{node.lineno}: {alias.name}" for node in ast.walk(ast.parse(source, rel))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == module
            for alias in node.names if alias.name not in own]


def test_the_region_core_is_imported_for_its_own_names() -> None:
    """skymesh/routing/region.py defines :class:`RegionCore`; the region core's vocabulary
    (actions, heartbeat, health, settings, request states) has modules of its own and is
    imported from them, not through region.py, which imports it only for its own use."""
    own = own_names((ROOT / "skymesh/routing/region.py").read_text())
    assert "RegionCore" in own
    files = sorted(p for d in (*SCANNED, "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    borrowed = [b for p in files for b in borrowed_imports(
        p.read_text(), p.relative_to(ROOT).as_posix(), "skymesh.routing.region", own)]
    assert not borrowed, ("imported through skymesh/routing/region.py (import it from the module "
                          "that defines it):\n" + "\n".join(borrowed))


# --- the checkers can fail ---

MODULES = {"skymesh", "skymesh.a", "skymesh.b", "skymesh.pkg", "skymesh.pkg.c", "skymesh.pkg.d"}


@pytest.mark.parametrize(("snippet", "rel", "expected"), [
    ("import skymesh.b\n", "skymesh/a.py", ["skymesh.b"]),
    ("from skymesh import b\n", "skymesh/a.py", ["skymesh.b"]),
    ("from skymesh.pkg.c import X\n", "skymesh/a.py", ["skymesh.pkg.c"]),
    ("from skymesh.pkg import X, c\n", "skymesh/a.py", ["skymesh.pkg", "skymesh.pkg.c"]),
    ("from . import d\n", "skymesh/pkg/c.py", ["skymesh.pkg.d"]),
    ("from .. import a\n", "skymesh/pkg/c.py", ["skymesh.a"]),
    ("from . import c\n", "skymesh/pkg/__init__.py", ["skymesh.pkg.c"]),
    ("def f():\n    from skymesh import b\n", "skymesh/a.py", ["skymesh.b"]),
    ("if TYPE_CHECKING:\n    from skymesh import b\n", "skymesh/a.py", []),
    ("if TYPE_CHECKING:\n    pass\nelse:\n    from skymesh import b\n", "skymesh/a.py", ["skymesh.b"]),
    ("import json\nimport skymeshy\n", "skymesh/a.py", []),
])
def test_imports_are_read(snippet: str, rel: str, expected: list[str]) -> None:
    assert [e.dst for e in imports_of(snippet, rel, MODULES)] == expected


def test_a_cycle_is_found_and_named() -> None:
    edges = [Edge("m.a", "m.b", "m/a.py", 3), Edge("m.b", "m.c", "m/b.py", 5),
             Edge("m.c", "m.a", "m/c.py", 7), Edge("m.c", "m.d", "m/c.py", 8)]
    cycle = find_cycle(edges)
    assert cycle is not None
    text = describe_cycle(cycle)
    assert text.splitlines()[0] == "m.a -> m.b -> m.c -> m.a"
    assert "m/c.py:7: m.c imports m.a" in text
    assert find_cycle(edges[:2] + edges[3:]) is None


def test_a_cycle_added_to_the_project_is_found() -> None:
    """What test_no_import_cycle sees if routing/model.py imported routing/base.py again."""
    back = Edge("skymesh.routing.model", "skymesh.routing.base", "skymesh/routing/model.py", 1)
    cycle = find_cycle([*project_graph(), back])
    assert cycle is not None and back in cycle
    assert describe_cycle(cycle).splitlines()[0] in (
        "skymesh.routing.base -> skymesh.routing.model -> skymesh.routing.base",
        "skymesh.routing.model -> skymesh.routing.base -> skymesh.routing.model")


def test_an_upward_import_is_named() -> None:
    layers = (("low", ("m.low",)), ("high", ("m.high",)))
    up = Edge("m.low.x", "m.high.y", "m/low/x.py", 4)
    down = Edge("m.high.y", "m.low.x", "m/high/y.py", 2)
    assert layer_violations([up, down], layers, {}) == [
        "m/low/x.py:4: m.low.x imports m.high.y (layer low imports the higher layer high)"]
    assert layer_violations([up], layers, {("m.low.x", "m.high.y"): "why"}) == []


def test_a_borrowed_import_is_named() -> None:
    own = own_names("from m.actions import Reject\nclass Core: ...\nLIMIT = 3\n")
    assert own == {"Core", "LIMIT"}
    snippet = "from m.region import Core, Reject\nfrom m.actions import Reject\n"
    assert borrowed_imports(snippet, "t.py", "m.region", own) == ["t.py:1: Reject"]
