"""Production code never imports the vLLM stand-in (skymesh/replica_sim). The balancer,
the controller, DNS, the edge, the config and the routing core run against real vLLM
replicas; what they need of a replica's hardware (a named profile's cost model) lives in
skymesh/hardware.py, which the stand-in imports, not the other way round. Only what starts
or drives stand-ins may import them: the stand-in itself, the benchmarks and simulator
(skymesh/bench) and the test helpers (skymesh/testing); the CLI and ``skymesh up`` start
stand-ins as processes (``skymesh replica-sim``), importing nothing of them. Checked on the
source with ``ast``, each violation named as file:line, and by importing every production
module in a fresh interpreter (a transitive import, e.g. through skymesh/bench, shows
there)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STANDIN = "skymesh.replica_sim"
# paths (relative to the repository root) allowed to import the stand-in
ALLOWED = ("skymesh/replica_sim/", "skymesh/bench/", "skymesh/testing/")
SCANNED = ("skymesh", "controller")


def _package_of(filename: str) -> list[str]:
    parts = filename.removesuffix(".py").split("/")
    return parts[:-1]  # a module's package; __init__.py's package is its own directory


def _absolute(node: ast.ImportFrom, filename: str) -> str:
    if node.level == 0:
        return node.module or ""
    package = _package_of(filename)
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, *([node.module] if node.module else [])])


def _is_standin(name: str) -> bool:
    return name == STANDIN or name.startswith(STANDIN + ".")


def standin_imports(source: str, filename: str) -> list[str]:
    """``file:line: imports NAME`` for every import of the stand-in in ``source``
    (``filename`` relative to the repository root: relative imports are resolved by it)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, filename)
            # `from skymesh import replica_sim` imports skymesh.replica_sim
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            names = [node.args[0].value]
        for name in names:
            if _is_standin(name):
                found.append(f"{filename}:{node.lineno}: imports {name}")
                break
    return found


def test_production_code_never_imports_the_standin() -> None:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 30, f"found only {len(files)} files under {SCANNED}"
    violations = [
        v for path in files
        if not (rel := path.relative_to(ROOT).as_posix()).startswith(ALLOWED)
        for v in standin_imports(path.read_text(), rel)
    ]
    assert not violations, "production code must not import skymesh.replica_sim:\n" + "\n".join(violations)


def _production_modules() -> list[str]:
    out = []
    for path in sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(ALLOWED):
            out.append(rel.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    return out


def test_importing_all_production_code_loads_no_standin() -> None:
    modules = _production_modules()
    assert "skymesh.balancer.server" in modules and "skymesh.config" in modules
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[:2] in "
            "(['skymesh', 'replica_sim'], ['skymesh', 'bench'], ['skymesh', 'testing']))))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


@pytest.mark.parametrize(("snippet", "filename", "expected"), [
    ("import skymesh.replica_sim.engine\n", "skymesh/config.py",
     "skymesh/config.py:1: imports skymesh.replica_sim.engine"),
    ("def f():\n    from skymesh.replica_sim.scheduler import Scheduler\n", "skymesh/balancer/server.py",
     "skymesh/balancer/server.py:2: imports skymesh.replica_sim.scheduler"),
    ("from skymesh import replica_sim\n", "skymesh/operations/up.py", "skymesh/operations/up.py:1: imports skymesh.replica_sim"),
    ("from ..replica_sim import engine\n", "skymesh/balancer/server.py",
     "skymesh/balancer/server.py:1: imports skymesh.replica_sim"),
    ("from . import replica_sim\n", "skymesh/config.py", "skymesh/config.py:1: imports skymesh.replica_sim"),
    ("import importlib\nm = importlib.import_module('skymesh.replica_sim.server')\n", "skymesh/operations/up.py",
     "skymesh/operations/up.py:2: imports skymesh.replica_sim.server"),
])
def test_checker_flags_each_kind_of_import(snippet: str, filename: str, expected: str) -> None:
    """The checker can fail: each way of importing the stand-in fed to it is reported."""
    assert standin_imports(snippet, filename) == [expected]


@pytest.mark.parametrize("snippet", [
    "from skymesh.hardware import PROFILES\n",
    "import skymesh.replica_simulator_notes\n",  # a name that only starts alike
    "from .routing import region\n",
    "cmd = ['skymesh', 'replica-sim', '--port', '0']\n",  # starting a stand-in process is fine
])
def test_checker_allows_other_imports(snippet: str) -> None:
    assert standin_imports(snippet, "skymesh/config.py") == []
