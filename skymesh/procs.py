"""Child-process supervision: own process group, logs to a file, health waits, stop by PID."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp


class Child:
    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed below
        try:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(self.env or {})},
            )
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the child's own process group, SIGKILL after the grace period."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        proc = self.proc
        try:
            await asyncio.to_thread(proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            await asyncio.to_thread(proc.wait)

    async def kill(self) -> None:
        """Abrupt death (fault tests): SIGKILL, no cleanup."""
        if self.proc is not None:
            self.signal_group(signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait)

    def tail(self, n_bytes: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return ""


def skymesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "skymesh.cli", *args]


async def wait_healthy(url: str, child: Child | None = None, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if child is not None and child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}:\n{child.tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    what = child.name if child else url
    raise TimeoutError(f"{what} not healthy at {url} after {within_s}s" + (f":\n{child.tail()}" if child else ""))


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def start_sim_replicas(n: int, profile: str, time_scale: float, log_dir: Path,
                             name: str = "replica") -> tuple[list[Child], list[str]]:
    """n stand-in replica processes on free loopback ports, healthy on return."""
    children, urls = [], []
    for i in range(n):
        port = free_port()
        c = Child(f"{name}{i}", skymesh_cmd("replica-sim", "--port", str(port), "--profile", profile,
                                            "--time-scale", str(time_scale), "--log-level", "ERROR"), log_dir)
        c.start()
        children.append(c)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        await asyncio.gather(*(wait_healthy(u + "/health", c) for u, c in zip(urls, children, strict=True)))
    except BaseException:
        for c in children:
            await c.stop()
        raise
    return children, urls


async def cancel_tasks(tasks: list[asyncio.Task[object]]) -> None:
    """Cancel background tasks and wait for them to finish, swallowing their endings."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


async def serve_until_signal(start: object, stop: object) -> int:
    """Run a service: await ``start()``, wait for SIGINT/SIGTERM, then await ``stop()``."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    await start()  # type: ignore[operator]
    try:
        await ev.wait()
    finally:
        await stop()  # type: ignore[operator]
    return 0
