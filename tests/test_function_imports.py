"""Project modules (skymesh.*, controller.*) are imported at a module's top, not inside a
function, unless there is a reason: an optional dependency, an import cycle no better module
boundary breaks, or keeping a CLI subcommand's start-up light. Such an import carries a
comment saying why, on the line directly above it or on its own line; a run of consecutive
function-level imports shares the comment above its first. ``if TYPE_CHECKING:`` blocks are
not imports at run time and are skipped. Checked on the source with ``ast``, each violation
named as file:line."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("skymesh", "controller")
SKIPPED = ("skymesh/proto_gen/",)  # generated code
PROJECT = ("skymesh", "controller")


def _package_of(filename: str) -> list[str]:
    parts = filename.removesuffix(".py").split("/")
    return parts[:-1]  # a module's package; __init__.py's package is its own directory


def _imported_modules(node: ast.Import | ast.ImportFrom, filename: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        return [node.module or ""]
    package = _package_of(filename)
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return [".".join([*base, *([node.module] if node.module else [])])]


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PROJECT


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


# tool directives, not reasons: a line with only one of these has no comment saying why
DIRECTIVES = ("noqa", "type:", "pragma", "pyright:", "mypy:", "fmt:", "ruff:")


def _comment_lines(source: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT and not tok.string.lstrip("#").strip().startswith(DIRECTIVES)}


def _function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements inside a function body (at any depth), outside ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_stmt(stmt, in_function)
                continue
            visit_stmt(child, in_function)

    def visit_stmt(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if in_function:
                found.append(node)
            return
        visit(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def uncommented_function_imports(source: str, filename: str) -> list[str]:
    """``file:line: imports NAME`` for every function-level import of a project module in
    ``source`` with no comment on its line or the line above (``filename`` relative to the
    repository root: relative imports are resolved by it)."""
    comments = _comment_lines(source)
    imports = _function_imports(ast.parse(source, filename))
    ends = {node.end_lineno: node for node in imports}  # for a run of consecutive imports
    excused: set[int] = set()  # first lines of imports that carry (or share) a reason
    found: list[str] = []
    for node in sorted(imports, key=lambda n: n.lineno):
        above = node.lineno - 1
        if (node.lineno in comments or above in comments
                or (above in ends and ends[above].lineno in excused)):
            excused.add(node.lineno)
            continue
        project = [name for name in _imported_modules(node, filename) if _is_project(name)]
        if project:
            found.append(f"{filename}:{node.lineno}: imports {project[0]}")
    return found


def test_function_level_project_imports_say_why() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 30, f"found only {len(files)} files under {SCANNED}"
    violations = [
        v for path in files
        if not (rel := path.relative_to(ROOT).as_posix()).startswith(SKIPPED)
        for v in uncommented_function_imports(path.read_text(), rel)
    ]
    assert not violations, (
        "a function-level import of a project module needs a one-line comment above it saying why "
        "(optional dependency, import cycle, light CLI start-up); otherwise import it at the top:\n"
        + "\n".join(violations))


@pytest.mark.parametrize(("snippet", "expected"), [
    ("def f():\n    from skymesh.hardware import PROFILES\n", "skymesh/config/x.py:2: imports skymesh.hardware"),
    ("async def f():\n    import skymesh.dns.embedded\n", "skymesh/config/x.py:2: imports skymesh.dns.embedded"),
    ("class C:\n    def m(self):\n        if True:\n            from controller.service import S\n",
     "skymesh/config/x.py:4: imports controller.service"),
    ("def f():\n    from . import base\n", "skymesh/config/x.py:2: imports skymesh.config"),
    ("def f():\n    from ..dns import factory\n", "skymesh/config/x.py:2: imports skymesh.dns"),
    # a comment two lines up, or one with a blank line between, does not count
    ("def f():\n    # lazy: why\n\n    from skymesh.hardware import PROFILES\n",
     "skymesh/config/x.py:4: imports skymesh.hardware"),
    # a run of imports shares the comment above its first, not one after a gap of code
    ("def f():\n    # lazy: why\n    from skymesh import a\n    x = 1\n    from skymesh import b\n",
     "skymesh/config/x.py:5: imports skymesh"),
    # a tool directive is not a reason
    ("def f():\n    from skymesh.hardware import PROFILES  # noqa: PLC0415\n",
     "skymesh/config/x.py:2: imports skymesh.hardware"),
    # TYPE_CHECKING's else branch runs
    ("def f():\n    if TYPE_CHECKING:\n        pass\n    else:\n        from skymesh import a\n",
     "skymesh/config/x.py:5: imports skymesh"),
])
def test_checker_flags_uncommented_function_imports(snippet: str, expected: str) -> None:
    """The checker can fail: each kind of uncommented function-level import is reported."""
    assert uncommented_function_imports(snippet, "skymesh/config/x.py") == [expected]


@pytest.mark.parametrize("snippet", [
    "from skymesh.hardware import PROFILES\n",  # module level
    "if TYPE_CHECKING:\n    from skymesh.config import MeshConfig\n",
    "def f():\n    if TYPE_CHECKING:\n        from skymesh.config import MeshConfig\n",
    "def f():\n    # cycle: skymesh.config imports this module\n    from skymesh.config import ConfigError\n",
    "def f():\n    from skymesh.config import ConfigError  # cycle: skymesh.config imports this module\n",
    "def f():\n    # lazy: light start-up\n    from skymesh import a\n    from skymesh import (\n        b,\n    )\n"
    "    from controller import c\n",
    "def f():\n    import json\n    from aiohttp import web\n",  # not a project module
    "def f():\n    import skymeshy\n",  # a name that only starts alike
    "class C:\n    from skymesh import a\n",  # class level is not function level
])
def test_checker_allows_other_imports(snippet: str) -> None:
    assert uncommented_function_imports(snippet, "skymesh/config/x.py") == []
