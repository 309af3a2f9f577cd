"""skymesh/routing/ stays pure: no sockets, no clock reads, no files, no processes, no
threads. The daemon, the discrete-event simulator and the benchmarks share its policy
objects; a clock read or an I/O call inside them would make the simulator's virtual time
lie and a decision's cost depend on the machine. Checked on the source with ``ast`` (no
import of the package needed), each violation named as file:line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTING_DIR = Path(__file__).resolve().parent.parent / "skymesh" / "routing"

# top-level modules whose import means I/O, a clock, processes or threads
FORBIDDEN_MODULES = frozenset({
    "asyncio", "aiohttp", "grpc", "socket", "time", "datetime", "os", "subprocess", "threading",
})
# submodules forbidden although their parent package is allowed (logging itself is fine:
# a log call is not I/O the policy depends on; its handlers write files and sockets)
FORBIDDEN_SUBMODULES = frozenset({"logging.handlers"})
FORBIDDEN_CALLS = frozenset({"open"})


def _forbidden_module(name: str) -> str | None:
    """The forbidden module that importing ``name`` pulls in, or None."""
    if name.split(".", 1)[0] in FORBIDDEN_MODULES:
        return name.split(".", 1)[0]
    for sub in FORBIDDEN_SUBMODULES:
        if name == sub or name.startswith(sub + "."):
            return sub
    return None


def purity_violations(source: str, filename: str) -> list[str]:
    """``file:line: what`` for every forbidden import or call in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from logging import handlers` imports logging.handlers
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in FORBIDDEN_CALLS):
            found.append(f"{filename}:{node.lineno}: calls {node.func.id}()")
        for name in names:
            bad = _forbidden_module(name)
            if bad is not None:
                found.append(f"{filename}:{node.lineno}: imports {bad} ({name})")
                break
    return found


def test_routing_package_is_pure() -> None:
    files = sorted(ROUTING_DIR.rglob("*.py"))
    assert len(files) > 5, f"found only {files} under {ROUTING_DIR}"
    violations = [
        v for path in files
        for v in purity_violations(path.read_text(), str(path.relative_to(ROUTING_DIR.parent.parent)))
    ]
    assert not violations, "skymesh/routing/ must stay pure:\n" + "\n".join(violations)


@pytest.mark.parametrize(("snippet", "expected"), [
    ("import time\n", "snippet.py:1: imports time (time)"),
    ("x = 1\nimport os.path\n", "snippet.py:2: imports os (os.path)"),
    ("from datetime import datetime\n", "snippet.py:1: imports datetime (datetime)"),
    ("from logging import handlers\n", "snippet.py:1: imports logging.handlers (logging.handlers)"),
    ("import logging.handlers\n", "snippet.py:1: imports logging.handlers (logging.handlers)"),
    ("def f():\n    import asyncio\n", "snippet.py:2: imports asyncio (asyncio)"),
    ("from grpc.aio import server\n", "snippet.py:1: imports grpc (grpc.aio)"),
    ("data = open('x').read()\n", "snippet.py:1: calls open()"),
])
def test_checker_flags_each_kind_of_violation(snippet: str, expected: str) -> None:
    """The checker can fail: each forbidden pattern fed to it is reported."""
    assert purity_violations(snippet, "snippet.py") == [expected]


@pytest.mark.parametrize("snippet", [
    "import logging\nlog = logging.getLogger(__name__)\n",
    "from logging import getLogger\n",
    "import random\nimport xxhash\nfrom collections import deque\n",
    "from .base import Policy\n",  # relative imports stay inside the package
    "f.open()\n",  # a method named open is not the builtin
])
def test_checker_allows_pure_code(snippet: str) -> None:
    assert purity_violations(snippet, "snippet.py") == []
