"""checkov for the terraform test: its own venv, built by ``make checkov-env``, never by a test.

checkov's dependency tree conflicts with ours, so it lives in ``.venv-checkov/``
(gitignored, removed by ``make clean``) with ``checkov`` pinned. A stamp naming the pin
makes a second build instant. A build that fails (no package index) leaves only
``.venv-checkov/build-failed`` (its one-line summary and the log's tail) and
``build.log``: ``python -m skymesh.testing.checkov_env build`` says why and exits 0 (1
with ``--strict``), and ``tests/test_terraform.py`` skips with that reason. The stamp,
the bounded build and the failure record are :mod:`skymesh.testing.tool_venv`'s.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from skymesh.testing.tool_venv import ROOT, STAMP_NAME, BuildResult, ToolVenv, build_main

__all__ = ["CHECKOV_PIN", "STAMP_NAME", "VENV", "BuildResult", "build_venv", "checkov_bin", "unavailable_reason"]

VENV = Path(os.environ.get("SKYMESH_CHECKOV_VENV", ROOT / ".venv-checkov"))
CHECKOV_PIN = "checkov==3.3.30"
# the whole build (venv + pip) gives up after this; a stalled index must not hang `make test`
BUILD_TIMEOUT_S = 900.0


def tool(venv: Path = VENV) -> ToolVenv:
    return ToolVenv(name="checkov", venv=venv, pins=(CHECKOV_PIN,), make_target="checkov-env",
                    executable="checkov", timeout_s=BUILD_TIMEOUT_S)


def checkov_bin(venv: Path = VENV) -> Path:
    return tool(venv).bin()


def venv_ready(venv: Path = VENV) -> bool:
    return tool(venv).ready()


def failed_reason(venv: Path = VENV) -> str | None:
    """Why the last build failed (its one-line summary and log tail), or None."""
    return tool(venv).failed_reason()


def unavailable_reason(venv: Path = VENV) -> str | None:
    """Why the checkov test cannot run here (it skips with this), or None when it can."""
    return tool(venv).unavailable_reason()


def build_venv(venv: Path = VENV, timeout_s: float = BUILD_TIMEOUT_S) -> BuildResult:
    """Build the checkov venv unless its stamp says it is there; never raises for a failed
    install (the result says why, and so does ``venv/build-failed``)."""
    return dataclasses.replace(tool(venv), timeout_s=timeout_s).build()


def main(argv: list[str] | None = None) -> int:
    return build_main("python -m skymesh.testing.checkov_env", [tool()], "tests/test_terraform.py's checkov test",
                     argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
