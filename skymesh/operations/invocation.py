"""How a shell in the working directory runs this `skymesh` and names a file: what the
commands the CLI prints (`skymesh up`'s hints, `skymesh status`'s advice) are built from,
so they run as printed (the venv's script is not on PATH unless the venv is active)."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def shell_path(path: Path) -> str:
    """``path`` for a shell in the working directory: relative when below it
    (``.venv/bin/skymesh``), else absolute; quoted when it needs to be."""
    full = path.absolute()
    try:
        shown = str(full.relative_to(Path.cwd()))
    except ValueError:
        shown = str(full)
    return shlex.quote(shown)


def skymesh_command() -> str:
    """How a shell here runs this `skymesh`: ``skymesh`` when PATH finds this one, else
    the script beside this interpreter, else ``python -m skymesh.cli``."""
    python = Path(sys.executable).absolute()  # not resolved: a venv's python is a symlink
    script = python.parent / "skymesh"
    if script.is_file():
        on_path = shutil.which("skymesh")
        if on_path is not None and Path(on_path).resolve() == script.resolve():
            return "skymesh"
        return shell_path(script)
    return f"{shell_path(python)} -m skymesh.cli"
