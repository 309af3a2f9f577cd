"""A pinned tool in its own venv, built by ``make <target>``, never by a test.

Tools whose dependency trees conflict with ours (checkov, the benchmark clients) each live
in a gitignored venv at the clone's root. :class:`ToolVenv` is what they share:

* a stamp (``.installed``, its text the pins) makes a second build instant, and a venv whose
  stamp names other pins is rebuilt;
* the build is a few bounded steps (create the venv, ``pip install`` the pins with short
  retries, a version check): the whole of it gives up after ``timeout_s``, so a stalled
  index cannot hang ``make test``;
* a failed build (no package index) leaves only ``build-failed`` (a one-line summary, then
  the log's tail) and ``build.log``; :meth:`ToolVenv.unavailable_reason` turns that (or a
  missing venv) into the reason the tests skip with;
* :func:`build_main` is the ``build`` command the Makefile runs: it says why and exits 0 (1 with
  ``--strict``) when a build fails, so ``make test`` goes on.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP_NAME = ".installed"  # its text is the pins, one a line
FAILED_NAME = "build-failed"
LOG_NAME = "build.log"


@dataclass(frozen=True, slots=True)
class BuildResult:
    ok: bool
    seconds: float
    message: str


@dataclass(frozen=True, slots=True)
class ToolVenv:
    """One tool venv: ``name`` for messages, the ``make`` target that builds it, the pins it
    installs, and the executable (in its ``bin/``) whose ``check_args`` prove it runs."""

    name: str
    venv: Path
    pins: tuple[str, ...]
    make_target: str
    executable: str
    check_args: tuple[str, ...] = ("--version",)
    # None: the interpreter outside any venv; else a path or a name looked up on PATH
    base_python: str | None = None
    timeout_s: float = 900.0
    # what the stamp says besides the pins (a change of it rebuilds the venv)
    extra_stamp: str = ""

    @property
    def stamp_text(self) -> str:
        return "\n".join(self.pins) + (f"\n{self.extra_stamp}" if self.extra_stamp else "")

    def bin(self, name: str | None = None) -> Path:
        return self.venv / "bin" / (name or self.executable)

    def ready(self) -> bool:
        stamp = self.venv / STAMP_NAME
        return stamp.is_file() and stamp.read_text() == self.stamp_text and self.bin().exists()

    def failed_reason(self) -> str | None:
        """Why the last build failed (its one-line summary and log tail), or None."""
        p = self.venv / FAILED_NAME
        return p.read_text() if p.is_file() else None

    def unavailable_reason(self) -> str | None:
        """Why the tests that need this venv cannot run here (they skip with this), or None."""
        if self.ready():
            return None
        failed = self.failed_reason()
        if failed is not None:
            return (f"the {self.name} venv could not be built (no package index?): {failed.splitlines()[0]}; "
                    f"retry with `make {self.make_target}`")
        return f"no {self.name} venv at {self.venv}: build it with `make {self.make_target}` ({' '.join(self.pins)}, once)"

    def build(self, timeout_s: float | None = None) -> BuildResult:
        """Build the venv unless its stamp says it is there; never raises for a failed
        install (the result says why, and so does ``build-failed``)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        pins = " ".join(self.pins)
        if self.ready():
            return BuildResult(True, 0.0, f"{self.venv} is ready ({pins})")
        base = resolve_python(self.base_python)
        if base is None:
            return self._failed(t0, f"no {self.base_python} interpreter to build the venv with", "")
        if self.venv.exists():
            shutil.rmtree(self.venv)  # a half-built one, another pin's, or the record of a failed build
        log_text: list[str] = []
        deadline = t0 + timeout_s
        python = self.venv / "bin" / "python"
        env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        steps: list[tuple[str, list[str]]] = [
            ("create the venv", [base, "-m", "venv", str(self.venv)]),
            # a few retries with a short timeout: without an index this fails in minutes, not hours
            ("pip install " + pins, [str(python), "-m", "pip", "install", "--quiet", "--retries", "2",
                                     "--timeout", "60", "--progress-bar", "off", *self.pins]),
            ("version check", [str(self.bin()), *self.check_args]),
        ]
        for what, cmd in steps:
            log_text.append(f"=== {time.strftime('%H:%M:%S')} {what}: {' '.join(cmd)}\n")
            try:
                out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, timeout=max(1.0, deadline - time.monotonic()))
                rc = out.returncode
                log_text.append(out.stdout.decode(errors="replace"))
            except subprocess.TimeoutExpired:
                rc = -1
                what += f" (timed out: the whole build is bounded by {timeout_s:.0f} s)"
            except OSError as e:  # e.g. no executable after a broken install
                rc = -1
                log_text.append(f"{e}\n")
            if rc != 0:
                return self._failed(t0, f"{what} failed (exit {rc}); log: {self.venv / LOG_NAME}", "".join(log_text))
        (self.venv / LOG_NAME).write_text("".join(log_text))
        (self.venv / STAMP_NAME).write_text(self.stamp_text)
        return BuildResult(True, time.monotonic() - t0, f"built {self.venv} ({pins})")

    def _failed(self, t0: float, summary: str, log_text: str) -> BuildResult:
        # nothing half-installed is kept: only why, for the tests' skip and the next try
        shutil.rmtree(self.venv, ignore_errors=True)
        self.venv.mkdir(parents=True, exist_ok=True)
        (self.venv / LOG_NAME).write_text(log_text)
        (self.venv / FAILED_NAME).write_text(f"{summary}\n{log_text[-2000:]}")
        return BuildResult(False, time.monotonic() - t0, summary)


def resolve_python(spec: str | None) -> str | None:
    """The interpreter to build a venv with: ``None`` is the one outside any venv (keeps a
    tool's venv independent of ours); a path is taken if it runs; a name (``python3.12``)
    is looked up on PATH, then under pyenv's versions (a pyenv shim on PATH fails when that
    version is not the selected one): the first that runs."""
    if spec is None:
        base = getattr(sys, "_base_executable", None) or sys.executable
        return base if os.path.exists(base) else sys.executable
    candidates: list[str] = []
    if os.sep in spec:
        candidates.append(spec)
    else:
        if found := shutil.which(spec):
            candidates.append(found)
        version = spec.removeprefix("python")
        pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
        if version and pyenv.is_dir():
            candidates += [str(d / "bin" / "python") for d in sorted(pyenv.glob(f"{version}.*"), reverse=True)]
    for cand in candidates:
        try:
            if subprocess.run([cand, "-c", "import venv"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, timeout=30).returncode == 0:
                return cand
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


def build_main(prog: str, venvs: Sequence[ToolVenv], what_skips: str, argv: list[str] | None = None,
         description: str | None = None) -> int:
    """``python -m <module> build [--strict]``: build each venv (instant when stamped)."""
    ap = argparse.ArgumentParser(prog=prog, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    names = ", ".join(f"{v.venv.name} ({' '.join(v.pins)})" for v in venvs)
    b = sub.add_parser("build", help=f"build {names} (instant when its stamp is there)")
    b.add_argument("--strict", action="store_true", help="exit 1 when a build fails (default: report, exit 0, "
                   f"so `make test` goes on and {what_skips} skip with the reason)")
    args = ap.parse_args(argv)
    failed = False
    for v in venvs:
        res = v.build()
        print(f"{v.make_target}: {res.message} ({res.seconds:.0f} s)", flush=True)
        if not res.ok:
            failed = True
            print(f"{v.make_target}: {what_skips} that need {v.venv.name} will be skipped", flush=True)
    return 1 if failed and args.strict else 0
