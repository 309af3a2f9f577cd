"""Child-process supervision: own process group, logs to a file, ready waits, stop by PID.

The one process wrapper of the project: ``skymesh up``, the benchmarks and the test suite
all start their children through :class:`Child`.

A child dies with its parent, however the parent dies (SIGKILL included): on Linux each
child asks the kernel for SIGKILL when its parent goes (``prctl(PR_SET_PDEATHSIG)``), set
between fork and exec, and exits at once if the parent was already gone by then. A child
that starts children of its own through :class:`Child` passes this on, so a whole tree
goes when its root does. (The kernel sends it when the *thread* that forked the child
exits: start children from a thread that lives as long as they should, e.g. the event
loop's.) :func:`port_holders` names the process holding a port (from /proc).

Ready protocol: every skymesh daemon (balancer, replica-sim, controller, dns) prints one
line ``SKYMESH_READY {"http": 43121, "grpc": 40211}`` on stdout once it listens, naming
the ports it actually bound (so a child started on port 0 tells which one it got).
:meth:`Child.wait_ready` reads that line from the child's log instead of polling a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import aiohttp

READY_PREFIX = "SKYMESH_READY "
# for the daemons' --help (argparse epilog): the ready protocol in one sentence
READY_HELP = ("Once listening, prints one line on stdout: SKYMESH_READY {json}, the ports "
              "actually bound by name (e.g. {\"http\": 43121}); with port 0 that is how a "
              "parent learns which port it got.")


def report_ready(ports: dict[str, int]) -> None:
    """Tell the parent (a :class:`Child`) which ports this daemon bound: one line on stdout."""
    print(READY_PREFIX + json.dumps(ports, sort_keys=True), flush=True)


def parse_ready(text: str) -> dict[str, int] | None:
    """The ports of the first ready line in ``text`` (a child's output), or None."""
    for line in text.splitlines():
        if line.startswith(READY_PREFIX):
            data = json.loads(line[len(READY_PREFIX):])
            return {str(k): int(v) for k, v in data.items()}
    return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


# resolved once, in the parent: the function run between fork and exec only calls it
_PRCTL = _load_prctl()


def _exit_on_interrupt(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def quiet_pool_worker() -> None:
    """A process pool's worker initializer: Ctrl-C (SIGINT, sent to the whole foreground
    process group) ends a worker at once and silently. The parent owns the interrupt: it
    stops the pool and says what was found; the workers hold no state to save (each
    simulates one layout or rate), and without this each printed its traceback."""
    signal.signal(signal.SIGINT, _exit_on_interrupt)


def die_with_parent_preexec(parent_pid: int, sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when its parent dies; None where
    the platform has no ``PR_SET_PDEATHSIG``. If the parent died before the ``prctl``
    took effect (the child was reparented), the child exits at once instead."""
    prctl = _PRCTL
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class Child:
    """A child process in its own process group, output appended to ``log_dir/NAME.log``;
    stopped by its PID's group, never by name; killed by the kernel if this process dies
    first (see the module's docstring)."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.args = args
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        # where this run's output starts in the (appended-to) log
        self._log_offset = 0
        # what the child reported on its ready line (empty until wait_ready returned)
        self.ports: dict[str, int] = {}

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed below
        # restarts append to the same log: mark where each run begins
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.name}: {' '.join(self.args)}\n".encode())
        log.flush()
        self._log_offset = log.tell()
        self.ports = {}
        try:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **(self.env or {})}, cwd=self.cwd,
                preexec_fn=die_with_parent_preexec(os.getpid()),
            )
        finally:
            log.close()

    async def wait_ready(self, within_s: float = 60.0) -> dict[str, int]:
        """The ports the child reports on its ``SKYMESH_READY`` line; fails with the log's
        tail when the child exits first or says nothing within ``within_s``."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        deadline = time.monotonic() + within_s
        while True:
            # the exit check comes before the read: a child that reported and then died
            # still counts as ready here (its death is the caller's next problem)
            exited = self.proc.poll() is not None
            ports = parse_ready(self._this_run_output())
            if ports is not None:
                self.ports = ports
                return ports
            if exited:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                                   f"{self.tail()}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} not ready after {within_s}s:\n{self.tail()}")
            await asyncio.sleep(0.05)

    def _this_run_output(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def port(self, kind: str = "http") -> int:
        """A port from the ready line (after :meth:`wait_ready`)."""
        if kind not in self.ports:
            raise KeyError(f"{self.name} reported no {kind!r} port (got {self.ports})")
        return self.ports[kind]

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


async def wait_all_ready(children: list[Child], within_s: float = 60.0) -> None:
    """``wait_ready`` for every child at once; the first failure cancels the rest and is
    raised (naming the child, with its log tail)."""
    await all_or_first_failure([asyncio.create_task(c.wait_ready(within_s)) for c in children])


async def all_or_first_failure(tasks: list[asyncio.Task[Any]]) -> None:
    """Wait for every task; the first one that raises cancels the rest, and its exception
    is raised."""
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


# Picking a port for a child is a race (free now, taken before the child binds). Children
# that nobody must find through a config bind port 0 and report the port instead (see the
# ready protocol above). The pick below remains for configs that must name every address
# before any part starts: a mesh's balancers, controller and DNS server find each other
# through the config file. To make the race unlikely rather than routine, the pick avoids
# the kernel's ephemeral range (where every port-0 bind and every outgoing connection of
# every process on the machine lands), is random (several suites run at once here), and
# never hands out a number twice in one process.
_EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default, when /proc says nothing
_LOWEST_PICK = 10000  # below: well-known and registered services
_issued_ports: set[int] = set()
_port_rng = random.Random()  # own instance: a test seeding `random` must not sync suites


def ephemeral_port_range() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return lo, hi


def port_pick_ranges() -> list[range]:
    """The port ranges :func:`free_port` picks from: 10000-65535 less the ephemeral range."""
    lo, hi = ephemeral_port_range()
    ranges = [range(_LOWEST_PICK, min(lo, 65536)), range(max(hi + 1, _LOWEST_PICK), 65536)]
    return [r for r in ranges if len(r) > 0]


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port (the first of ``span`` consecutive ones) that TCP and UDP can bind on
    ``host`` right now, outside the ephemeral range and not handed out before by this
    process. Prefer port 0 + the ready line for any child that can report its port."""
    ranges = port_pick_ranges()
    candidates = sum(len(r) for r in ranges)
    for _ in range(1000):
        k = _port_rng.randrange(candidates)
        for r in ranges:
            if k < len(r):
                port = r[k]
                break
            k -= len(r)
        block = range(port, port + span)
        if block[-1] > 65535 or any(p in _issued_ports for p in block):
            continue
        if all(bind_problem(host, p) is None and bind_problem(host, p, udp=True) is None for p in block):
            _issued_ports.update(block)
            return port
    raise RuntimeError(f"no free port block of {span} on {host} in {ranges}")


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


def _proc_net_addr(hex_addr: str) -> tuple[str, int]:
    """(address, port) of a /proc/net/{tcp,udp}{,6} ``local_address`` field."""
    addr, port = hex_addr.split(":")
    if len(addr) == 8:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(addr, 16)))
    else:
        raw = b"".join(struct.pack("<I", int(addr[i:i + 8], 16)) for i in range(0, 32, 8))
        ip = socket.inet_ntop(socket.AF_INET6, raw)
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


_WILDCARDS = ("0.0.0.0", "::")
_TCP_LISTEN = "0A"


def _socket_inodes(host: str, port: int, udp: bool) -> set[str]:
    """Inodes of the sockets bound to host:port (TCP: listening), a wildcard address
    counting as every host, from /proc/net."""
    inodes: set[str] = set()
    for table in (("udp", "udp6") if udp else ("tcp", "tcp6")):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or (not udp and fields[3] != _TCP_LISTEN):
                continue
            try:
                ip, p = _proc_net_addr(fields[1])
            except (ValueError, OSError):
                continue
            if p == port and (ip == host or ip in _WILDCARDS or host in _WILDCARDS):
                inodes.add(fields[9])
    inodes.discard("0")
    return inodes


def port_holders(host: str, port: int, udp: bool = False) -> list[tuple[int, str]]:
    """(pid, command line) of each process holding a socket bound to host:port (TCP: a
    listening one), found through /proc/net and /proc/*/fd (Linux; processes of other
    users may not be visible: then the list is shorter or empty)."""
    wanted = {f"socket:[{inode}]" for inode in _socket_inodes(host, port, udp)}
    if not wanted:
        return []
    out: list[tuple[int, str]] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target in wanted:
                try:
                    cmd = " ".join((proc / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
                except OSError:
                    cmd = ""
                out.append((int(proc.name), cmd or "?"))
                break
    return sorted(out)


def describe_port_holders(host: str, port: int, udp: bool = False) -> str:
    """``"pid 123 (cmd ...)"`` for each process holding host:port, or a note that none
    could be found (another user's process, or one that just let go)."""
    holders = port_holders(host, port, udp)
    if not holders:
        return "by a process not visible here (another user's?)"
    return "by " + ", ".join(f"pid {pid} ({cmd[:200]})" for pid, cmd in holders)


async def start_sim_replicas(n: int, profile: str, time_scale: float, log_dir: Path,
                             name: str = "replica", extra: list[str] | None = None,
                             within_s: float = 60.0) -> tuple[list[Child], list[str]]:
    """n stand-in replica processes on loopback (each binds port 0 and reports it), ready
    on return, with their base URLs."""
    children = [
        Child(f"{name}{i}", skymesh_cmd("replica-sim", "--host", "127.0.0.1", "--port", "0",
                                        "--profile", profile, "--time-scale", str(time_scale),
                                        "--log-level", "ERROR", *(extra or [])), log_dir)
        for i in range(n)
    ]
    try:
        for c in children:
            c.start()
        await wait_all_ready(children, within_s)
    except BaseException:
        await asyncio.gather(*(c.stop() for c in children))
        raise
    return children, [f"http://127.0.0.1:{c.port('http')}" for c in children]


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


def run_daemon(name: str, main: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(main)`` for a daemon's CLI, on uvloop where it loads
    (skymesh/runtime/event_loop.py): a missing secret (a component that would listen
    beyond loopback without one) or a file the config names that cannot be read is one
    line on stderr and exit code 2."""
    # lazy: procs stays below skymesh.config (test helpers import it alone); only daemons need these
    from skymesh.config import ConfigError
    from skymesh.runtime.event_loop import run_loop
    from skymesh.security.admin_auth import MissingSecretError

    try:
        return run_loop(main)
    except MissingSecretError as e:
        print(f"skymesh {name}: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"skymesh {name}: config error: {e}", file=sys.stderr)
        return 2


async def serve_until_signal(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    reload: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Run a service: await ``start()``, wait for SIGINT/SIGTERM, then await ``stop()``.
    With ``reload``, each SIGHUP runs ``reload()`` once the service has started, one at a
    time (a SIGHUP during a reload queues another); it must log and swallow its own errors.
    Without it, SIGHUP keeps its default action."""
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    started = asyncio.Event()
    reloads: set[asyncio.Task[None]] = set()
    if reload is not None:
        one_at_a_time = asyncio.Lock()

        async def reload_when_started() -> None:
            await started.wait()
            async with one_at_a_time:
                await reload()

        def on_hup() -> None:
            task = loop.create_task(reload_when_started())
            reloads.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(reloads.discard)

        # installed before start(): a SIGHUP while starting must not kill the process
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    await start()
    started.set()
    try:
        await ev.wait()
    finally:
        await cancel_tasks(reloads)
        await stop()
    return 0
