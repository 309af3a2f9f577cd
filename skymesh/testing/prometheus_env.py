"""Prometheus and promtool for the observability tests, fetched by ``make prometheus-env``,
never by a test.

Debian's ``prometheus`` package has both binaries. It is downloaded with ``apt-get
download`` (no root, nothing installed system-wide, no service started) and unpacked with
``dpkg-deb -x`` into ``.prometheus/`` (gitignored, removed by ``make clean``); a stamp
naming the package version makes a second run instant. When it cannot be fetched (no
package index, not a Debian system) ``.prometheus/fetch-failed`` says why:
``python -m skymesh.testing.prometheus_env fetch`` reports it and exits 0 (1 with
``--strict``), and the tests that need the binaries skip with that reason.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOME = Path(os.environ.get("SKYMESH_PROMETHEUS_HOME", ROOT / ".prometheus"))
PACKAGE = "prometheus"
STAMP_NAME = ".installed"  # its text is the package file fetched
FETCH_TIMEOUT_S = 300.0


def binary(name: str, home: Path = HOME) -> Path:
    """``prometheus`` or ``promtool`` as unpacked."""
    return home / "usr" / "bin" / name


def ready(home: Path = HOME) -> bool:
    return (home / STAMP_NAME).is_file() and binary("prometheus", home).exists() and binary("promtool", home).exists()


def unavailable_reason(home: Path = HOME) -> str | None:
    """Why the Prometheus tests cannot run here (they skip with this), or None."""
    if ready(home):
        return None
    failed = home / "fetch-failed"
    if failed.is_file():
        return f"prometheus could not be fetched: {failed.read_text().splitlines()[0]}; retry with `make prometheus-env`"
    return f"no prometheus at {home}: fetch it with `make prometheus-env` (Debian's {PACKAGE} package, once)"


def fetch(home: Path = HOME, timeout_s: float = FETCH_TIMEOUT_S) -> tuple[bool, str]:
    """Download and unpack the package unless the stamp says it is there; never raises for
    a failed fetch (the result and ``home/fetch-failed`` say why)."""
    if ready(home):
        return True, f"{home} is ready ({(home / STAMP_NAME).read_text().strip()})"
    if home.exists():
        shutil.rmtree(home)
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryDirectory() as tmp:
        ok, out = _run(["apt-get", "download", PACKAGE], Path(tmp), deadline)
        if not ok:
            return _failed(home, f"apt-get download {PACKAGE} failed: {out}")
        debs = sorted(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if not debs:
            return _failed(home, f"apt-get download left no {PACKAGE}_*.deb")
        ok, out = _run(["dpkg-deb", "-x", str(debs[0]), str(home)], Path(tmp), deadline)
        if not ok:
            return _failed(home, f"dpkg-deb -x failed: {out}")
        ok, out = _run([str(binary("promtool", home)), "--version"], Path(tmp), deadline)
        if not ok:
            return _failed(home, f"promtool --version failed: {out}")
        (home / STAMP_NAME).write_text(debs[0].name + "\n")
        return True, f"unpacked {debs[0].name} into {home}"


def _run(cmd: list[str], cwd: Path, deadline: float) -> tuple[bool, str]:
    try:
        out = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, timeout=max(1.0, deadline - time.monotonic()))
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    text = out.stdout.decode(errors="replace").strip()
    return out.returncode == 0, (text.splitlines()[-1] if text else f"exit {out.returncode}")


def _failed(home: Path, why: str) -> tuple[bool, str]:
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    (home / "fetch-failed").write_text(why + "\n")
    return False, why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.testing.prometheus_env", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"unpack Debian's {PACKAGE} into .prometheus (instant when there)")
    f.add_argument("--strict", action="store_true", help="exit 1 when the fetch fails (default: report, exit 0)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    ok, message = fetch()
    print(f"prometheus-env: {message} ({time.monotonic() - t0:.0f} s)", flush=True)
    if not ok:
        print("prometheus-env: the tests that run prometheus or promtool will be skipped", flush=True)
        return 1 if args.strict else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
