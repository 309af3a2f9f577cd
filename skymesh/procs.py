"""Child-process supervision: own process group, logs to a file, health waits, stop by PID."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
        # restarts append to the same log: mark where each run begins
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}: {' '.join(self.args)}\n".encode())
        log.flush()
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

    @property
    def returncode(self) -> int | None:
        """None while running (or never started)."""
        return self.proc.poll() if self.proc is not None else None

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
        """The end of this run's log (not a previous run's, for a restarted child)."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        start = data.rfind(b"=== ")
        if start > 0 and data[start - 1 : start] == b"\n":
            data = data[start:]
        return data[-n_bytes:].decode(errors="replace")


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


async def wait_all_healthy(checks: list[tuple[str, Child | None]], within_s: float = 60.0) -> None:
    """``wait_healthy`` for every (url, child) at once; the first failure cancels the rest
    and is raised (naming the part, with its log tail)."""
    tasks = [asyncio.create_task(wait_healthy(url, child, within_s)) for url, child in checks]
    if not tasks:
        return
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            exc = t.exception() if t in done else None
            if exc is not None:
                raise exc
    finally:
        await cancel_tasks(tasks)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_problem(host: str, port: int, udp: bool = False) -> str | None:
    """Why a server could not listen on host:port right now, or None when it could
    (connections in TIME_WAIT don't count: servers set SO_REUSEADDR too)."""
    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "already in use"
            return e.strerror or str(e)
    return None


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


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait for ``event`` at most ``timeout_s``; True when it was set.

    Not ``asyncio.wait_for(event.wait(), ...)``: on Python 3.11 that can swallow a
    cancellation arriving as the event fires, leaving a loop that never stops (seen as a
    hung ``Balancer.stop``). ``asyncio.timeout`` propagates it.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def cancel_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel background tasks and wait for them to finish, swallowing their endings."""
    tasks = list(tasks)
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
