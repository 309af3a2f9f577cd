"""checkov for the terraform test: its own venv, built by ``make checkov-env``, never by a test.

checkov's dependency tree conflicts with ours, so it lives in ``.venv-checkov/``
(gitignored, removed by ``make clean``) with ``checkov`` pinned. A stamp naming the pin
makes a second build instant. A build that fails (no package index) leaves only
``.venv-checkov/build-failed`` (its one-line summary and the log's tail) and
``build.log``: ``python -m skymesh.testing.checkov_env build`` says why and exits 0 (1
with ``--strict``), and ``tests/test_terraform.py`` skips with that reason.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("SKYMESH_CHECKOV_VENV", ROOT / ".venv-checkov"))

CHECKOV_PIN = "checkov==3.3.30"
STAMP_NAME = ".installed"  # its text is the pin
# the whole build (venv + pip) gives up after this; a stalled index must not hang `make test`
BUILD_TIMEOUT_S = 900.0


def checkov_bin(venv: Path = VENV) -> Path:
    return venv / "bin" / "checkov"


def venv_ready(venv: Path = VENV) -> bool:
    stamp = venv / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == CHECKOV_PIN and checkov_bin(venv).exists()


def failed_reason(venv: Path = VENV) -> str | None:
    """Why the last build failed (its one-line summary and log tail), or None."""
    p = venv / "build-failed"
    return p.read_text() if p.is_file() else None


def unavailable_reason(venv: Path = VENV) -> str | None:
    """Why the checkov test cannot run here (it skips with this), or None when it can."""
    if venv_ready(venv):
        return None
    failed = failed_reason(venv)
    if failed is not None:
        return (f"the checkov venv could not be built (no package index?): {failed.splitlines()[0]}; "
                "retry with `make checkov-env`")
    return f"no checkov venv at {venv}: build it with `make checkov-env` ({CHECKOV_PIN}, once)"


@dataclass(frozen=True, slots=True)
class BuildResult:
    ok: bool
    seconds: float
    message: str


def build_venv(venv: Path = VENV, timeout_s: float = BUILD_TIMEOUT_S) -> BuildResult:
    """Build the checkov venv unless its stamp says it is there; never raises for a failed
    install (the result says why, and so does ``venv/build-failed``)."""
    t0 = time.monotonic()
    if venv_ready(venv):
        return BuildResult(True, 0.0, f"{venv} is ready ({CHECKOV_PIN})")
    if venv.exists():
        shutil.rmtree(venv)  # a half-built one, or the record of a failed build
    log_text: list[str] = []
    deadline = t0 + timeout_s
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    steps: list[tuple[str, list[str]]] = [
        ("create the venv", [_base_python(), "-m", "venv", str(venv)]),
        # a few retries with a short timeout: without an index this fails in minutes, not hours
        ("pip install " + CHECKOV_PIN, [str(python), "-m", "pip", "install", "--quiet", "--retries", "2",
                                        "--timeout", "60", "--progress-bar", "off", CHECKOV_PIN]),
        ("version check", [str(checkov_bin(venv)), "--version"]),
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
        except OSError as e:  # e.g. no checkov executable after a broken install
            rc = -1
            log_text.append(f"{e}\n")
        if rc != 0:
            return _failed(venv, t0, f"{what} failed (exit {rc}); log: {venv / 'build.log'}", "".join(log_text))
    (venv / "build.log").write_text("".join(log_text))
    (venv / STAMP_NAME).write_text(CHECKOV_PIN)
    return BuildResult(True, time.monotonic() - t0, f"built {venv} ({CHECKOV_PIN})")


def _failed(venv: Path, t0: float, summary: str, log_text: str) -> BuildResult:
    # nothing half-installed is kept: only why, for the test's skip and the next try
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True, exist_ok=True)
    (venv / "build.log").write_text(log_text)
    (venv / "build-failed").write_text(f"{summary}\n{log_text[-2000:]}")
    return BuildResult(False, time.monotonic() - t0, summary)


def _base_python() -> str:
    """The interpreter outside any venv (keeps the checkov venv independent of ours)."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return base if os.path.exists(base) else sys.executable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.testing.checkov_env", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help=f"build .venv-checkov with {CHECKOV_PIN} (instant when its stamp is there)")
    b.add_argument("--strict", action="store_true", help="exit 1 when the build fails (default: report, exit 0, "
                   "so `make test` goes on and the checkov test skips with the reason)")
    args = ap.parse_args(argv)
    res = build_venv()
    print(f"checkov-env: {res.message} ({res.seconds:.0f} s)", flush=True)
    if not res.ok:
        print("checkov-env: tests/test_terraform.py's checkov test will be skipped", flush=True)
        return 1 if args.strict else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
