"""A byte-level TCP delay proxy that makes one machine feel like several regions.

It listens on a region's advertised address and forwards to its balancers' real listen
addresses, delaying every chunk in each direction by the one-way latency of the link the connection
comes from: the client's source IP is matched against the regions' ``source_networks``
(a client at 127.2.0.5, or a balancer that bound its egress to 127.2.0.1, is in
eu-west-1), and the delay is ``one_way_ms(source region, this region)``. Unknown sources
get ``local_latency_ms``. Byte-level, so it carries HTTP (incl. SSE streaming) and gRPC.
The mesh's proxies connect to the balancer from the client's own address (client IP
preservation, as an AWS NLB does), so the balancer sees which region a user is in.

A region of several balancers (``balancer.siblings``) has one proxy per advertised address
in front of all of them: like an NLB, it spreads new connections round robin over the
members' listeners, and a member that does not accept (dead, or draining after SIGTERM) is
skipped for that connection and the next one tried, so clients see a member die only on
the connections they had open to it. With ``health`` (a :class:`MemberHealth`) it also checks each member's
HTTP ``/health`` like an NLB target group (every ``HEALTH_INTERVAL_S``, out after
``UNHEALTHY_THRESHOLD`` failures in a row, back after ``HEALTHY_THRESHOLD`` answers) and
sends new connections only to healthy members (to all when none is, failing open as an
NLB does): a draining member fails its health check while it still serves, so no new
connection reaches it in the instant its listener closes. A fleet's entry that `skymesh
up` starts also reads the controller's topology and sends no new connection to a member
it lists dead (a frozen member, taken out by its siblings' reports or the controller's
probes: docs/reliability.md "Members watch each other"), as the controller deregisters
it from the target groups on AWS; every member listed dead, or no answer from the
controller, leaves the entry on its own checks.

Each direction is a queue of (release time, bytes): chunks leave in order at arrival +
delay, so delays never add up along a stream (no sleep-per-chunk serialisation). The
bytes held in a direction are bounded (``max_buffered`` plus one read): a slow receiver
stops the proxy from reading the sender, so TCP backpressure reaches the other end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from skymesh.config import MeshConfig, region_of_address
from skymesh.security.admin_auth import admin_headers

log = logging.getLogger("skymesh.operations.latency_proxy")
_CHUNK = 64 * 1024
# per direction; at 110 ms one way this still carries ~38 MB/s (bandwidth-delay product)
DEFAULT_MAX_BUFFERED = 4 * 1024 * 1024
# the entry's health checks of a fleet's members (an NLB's are 10 s, 2 down, 2 up); a
# draining member answers 503 at once, so it is out after UNHEALTHY_THRESHOLD checks
# (0.75 s here), well within LOCAL_DRAIN_LISTEN_S; a slow answer (a busy machine) is given
# HEALTH_TIMEOUT_S before it counts as a failure, and 3 failures in a row take a member out
HEALTH_INTERVAL_S = 0.25
HEALTH_TIMEOUT_S = 2.0
UNHEALTHY_THRESHOLD = 3
HEALTHY_THRESHOLD = 2
# what `skymesh up` gives a fleet's members: the checks above with room for a slow loop
LOCAL_DRAIN_LISTEN_S = 2.0
# how often the entry reads which members the controller lists dead (as the controller
# deregisters them from an NLB's target groups on AWS: controller/entry_targets.py)
CONTROLLER_POLL_S = 0.5
# how long the controller's last word holds while its reads fail: a read that times out on
# a busy machine must not put a frozen member back in service before the entry's own
# checks (UNHEALTHY_THRESHOLD timeouts of HEALTH_TIMEOUT_S, 6 s) have judged it; a
# controller away for longer leaves the entry on its own checks
CONTROLLER_STALE_S = 10.0


@dataclass(frozen=True, slots=True)
class ControllerFeed:
    """Where the entry of ``region`` reads the controller's topology (its HTTP
    ``/v1/topology``, with the admin token)."""

    topology_url: str
    token: str
    region: str


def listed_dead(topology: object, region: str, health_urls: Sequence[str]) -> frozenset[str]:
    """The health URLs (``<member http_url>/health``) of ``region``'s members the
    controller's topology document lists dead; none when it lists every one of them dead
    (the controller cut off from the region is as likely as the reverse: the entry then
    fails open on its own checks, as an NLB does), or when the document makes no sense."""
    if not isinstance(topology, dict) or not isinstance(topology.get("balancers"), list):
        return frozenset()
    wanted = set(health_urls)
    dead: set[str] = set()
    for assignment in topology["balancers"]:
        if not isinstance(assignment, dict) or assignment.get("region") != region:
            continue
        members = assignment.get("members")
        for m in members if isinstance(members, list) else ():
            if isinstance(m, dict) and m.get("alive") is False and isinstance(m.get("http_url"), str):
                url = m["http_url"] + "/health"
                if url in wanted:
                    dead.add(url)
    return frozenset() if dead >= wanted else frozenset(dead)


def delay_for(cfg: MeshConfig, region: str) -> Callable[[str], float]:
    """Source IP -> one-way delay (seconds) into ``region``; most specific network wins."""
    nets = cfg.source_network_table()

    def delay(ip: str) -> float:
        src = region_of_address(nets, ip)
        return cfg.local_latency_ms / 1000 if src is None else cfg.one_way_ms(src, region) / 1000

    return delay


class _DelayLine:
    """One direction of one connection: read, hold until due, write, in order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                 max_buffered: int) -> None:
        self.reader = reader
        self.writer = writer
        self.delay = delay
        self.max_buffered = max_buffered
        self.buffered = 0
        self.queue: deque[tuple[float, bytes]] = deque()
        self.ready = asyncio.Event()  # something was queued
        self.room = asyncio.Event()  # buffered dropped below the bound
        self.room.set()

    async def run(self) -> None:
        """Both halves; returns once EOF was passed on, raises when a side breaks."""
        sender = asyncio.create_task(self._send())
        receiver = asyncio.create_task(self._receive())
        try:
            # all done (EOF passed on), or the first failure on either side
            await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_EXCEPTION)
            for t in (receiver, sender):
                exc = t.exception() if t.done() and not t.cancelled() else None
                if exc is not None:
                    raise exc
        finally:
            for t in (sender, receiver):
                if not t.done():
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t

    async def _receive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.buffered >= self.max_buffered:
                self.room.clear()
                await self.room.wait()  # backpressure: stop reading until the writer drains
            data = await self.reader.read(_CHUNK)
            self.queue.append((loop.time() + self.delay, data))
            self.buffered += len(data)
            self.ready.set()
            if not data:
                return

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.ready.clear()
                await self.ready.wait()
            due, data = self.queue.popleft()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError, RuntimeError):
                    if self.writer.can_write_eof():
                        self.writer.write_eof()  # half-close: the other direction goes on
                return
            self.writer.write(data)
            await self.writer.drain()
            self.buffered -= len(data)
            if self.buffered < self.max_buffered:
                self.room.set()


class MemberHealth:
    """The health of a fleet's members as an NLB target group sees it: each member's HTTP
    ``/health`` checked every HEALTH_INTERVAL_S, each member on its own cadence; out after
    UNHEALTHY_THRESHOLD failures in a row (an error, a timeout or a non-200 answer), back
    after HEALTHY_THRESHOLD passes.
    Members start healthy (a refused connect is skipped anyway). One per region, shared by
    its proxies; it checks while any of them runs. With ``controller`` it also takes out
    the members the controller's topology lists dead (read every CONTROLLER_POLL_S), as
    the controller deregisters them from the target groups on AWS. Its last answer holds
    while reads fail, for ``controller_stale_s`` after it (a deregistration outlives a
    controller's hiccup); after that the entry trusts its own checks alone."""

    def __init__(self, urls: Sequence[str], controller: ControllerFeed | None = None,
                 controller_stale_s: float = CONTROLLER_STALE_S) -> None:
        self.urls = tuple(urls)
        self.controller = controller
        self.controller_stale_s = controller_stale_s
        # members the controller lists dead (their health URLs), as last read
        self.listed_dead: frozenset[str] = frozenset()
        self.healthy: dict[str, bool] = dict.fromkeys(self.urls, True)
        self.checks: dict[str, int] = dict.fromkeys(self.urls, 0)  # checks done, per member
        self._streak: dict[str, int] = dict.fromkeys(self.urls, 0)  # + passes, - failures in a row
        self._users = 0
        self._task: asyncio.Task[None] | None = None
        self._checked = asyncio.Event()  # set after every check

    async def until_passing(self, url: str) -> None:
        """Until a check begun after this call found ``url`` passing and the member is in
        (a member just started: the entry sends it new connections from then on, as an
        NLB target leaves its initial state). Returns at once while nothing checks."""
        start = self.checks[url]
        # + 2: a check already in flight at the call may have begun before the member was up
        while self._task is not None and not (self.checks[url] >= start + 2 and self.healthy[url]):
            self._checked.clear()
            await self._checked.wait()

    def in_service(self, url: str) -> bool:
        """New connections may go to this member: its checks pass and the controller does
        not list it dead."""
        return self.healthy[url] and url not in self.listed_dead

    def note(self, url: str, passed: bool) -> None:
        """One check's outcome."""
        streak = self._streak[url]
        streak = max(streak, 0) + 1 if passed else min(streak, 0) - 1
        self._streak[url] = streak
        if streak >= HEALTHY_THRESHOLD:
            self.healthy[url] = True
        elif -streak >= UNHEALTHY_THRESHOLD:
            self.healthy[url] = False

    def acquire(self) -> None:
        self._users += 1
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def release(self) -> None:
        self._users -= 1
        if self._users == 0 and self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
            # each member on its own cadence: a slow one never delays another's checks
            loops = [self._check_every_interval(s, url) for url in self.urls]
            if self.controller is not None:
                loops.append(self._follow_controller(s, self.controller))
            await asyncio.gather(*loops)

    async def _follow_controller(self, session: aiohttp.ClientSession, feed: ControllerFeed) -> None:
        loop = asyncio.get_running_loop()
        headers = admin_headers(feed.token)
        answered_at = loop.time()
        while True:
            started = loop.time()
            dead: frozenset[str] | None = None
            try:
                async with session.get(feed.topology_url, headers=headers) as r:
                    if r.status == 200:
                        dead = listed_dead(await r.json(content_type=None), feed.region, self.urls)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
                pass
            if dead is not None:
                self.listed_dead, answered_at = dead, loop.time()
            elif loop.time() - answered_at > self.controller_stale_s:
                self.listed_dead = frozenset()  # the controller is away: the entry's own checks alone
            await asyncio.sleep(max(0.0, CONTROLLER_POLL_S - (loop.time() - started)))

    async def _check_every_interval(self, session: aiohttp.ClientSession, url: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                async with session.get(url) as r:
                    passed = r.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError):
                passed = False
            self.note(url, passed)
            self.checks[url] += 1
            self._checked.set()
            await asyncio.sleep(max(0.0, HEALTH_INTERVAL_S - (loop.time() - started)))


class DelayProxy:
    """Listen on ``listen``, forward to ``target`` (and, with ``more_targets``, spread new
    connections round robin over all of them, skipping one that refuses), delay by
    ``delay(client ip)`` seconds; with ``upstream_source`` the upstream connection is bound
    to that source address."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: Callable[[str], float],
                 name: str = "", max_buffered: int = DEFAULT_MAX_BUFFERED,
                 upstream_source: str | None = None, region: str = "", kind: str = "",
                 preserve_client_ip: bool = False, more_targets: Sequence[tuple[str, int]] = (),
                 health: MemberHealth | None = None) -> None:
        self.listen = listen
        # what it stands in front of (e.g. "eu-west-1", "grpc"), for fault injection
        self.region = region
        self.kind = kind
        # a cut link: connections from client IPs this says True for are refused (None: none)
        self.refuse: Callable[[str], bool] | None = None
        # the listeners behind this address (a region's balancers), tried round robin
        self.targets: tuple[tuple[str, int], ...] = (target, *more_targets)
        self._next_target = 0
        # connections carried to each target (a refused connect does not count)
        self.connections_by_target: dict[tuple[str, int], int] = dict.fromkeys(self.targets, 0)
        # NLB-like health checks of the members behind this address (shared by a region's
        # proxies); ``health_of[target]`` names the member a target belongs to
        if health is not None and len(health.urls) != len(self.targets):
            raise ValueError("one health-checked member per target")
        self.health = health
        self.health_of: dict[tuple[str, int], str] = (
            dict(zip(self.targets, health.urls, strict=True)) if health is not None else {})
        # bind the upstream side to this source address (an egress forwarder, below)
        self.upstream_source = upstream_source
        # connect upstream from the client's own address (as an AWS NLB preserves client
        # IPs): the balancer behind it must see where a user is, for residency
        self.preserve_client_ip = preserve_client_ip
        self.delay = delay
        self.name = name or f"{listen[0]}:{listen[1]}"
        self.max_buffered = max_buffered
        self.connections_total = 0
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], list[asyncio.StreamWriter]] = {}
        self._lines: dict[asyncio.Task[None], list[_DelayLine]] = {}
        self._upstream_of: dict[asyncio.Task[None], tuple[str, int]] = {}

    @property
    def target(self) -> tuple[str, int]:
        """The first listener behind this address (the only one unless it spreads)."""
        return self.targets[0]

    def _targets_in_turn(self) -> list[tuple[str, int]]:
        """Every target in service, starting with the one whose turn it is (round robin).
        When none is, it fails open as an NLB does, but the controller's word outranks its
        own checks: the targets the controller does not list dead first (a check that timed
        out on a busy member is weaker evidence than a member its siblings stopped hearing),
        then the rest."""
        first = self._next_target
        self._next_target = (first + 1) % len(self.targets)
        in_turn = [*self.targets[first:], *self.targets[:first]]
        health = self.health
        if health is None:
            return in_turn
        healthy = [t for t in in_turn if health.in_service(self.health_of[t])]
        if healthy:
            return healthy
        return sorted(in_turn, key=lambda t: self.health_of[t] in health.listed_dead)

    async def _connect_upstream(
            self, source: str | None) -> tuple[tuple[str, int], asyncio.StreamReader, asyncio.StreamWriter] | None:
        """(target, connection) to the first target in turn that accepts one; None when none does."""
        for target in self._targets_in_turn():
            try:
                ureader, uwriter = await asyncio.open_connection(
                    *target, local_addr=(source, 0) if source else None)
            except OSError as e:
                # this one is down: the next is tried, the client never sees it
                log.debug("delay proxy upstream unreachable", extra={
                    "proxy": self.name, "target": f"{target[0]}:{target[1]}", "error": str(e)})
                continue
            self.connections_by_target[target] += 1
            return target, ureader, uwriter
        return None

    @property
    def port(self) -> int:
        """The bound port (useful with listen port 0)."""
        if self._server is None or not self._server.sockets:
            return self.listen[1]
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def active_connections(self) -> int:
        return len(self._conns)

    def open_connections_to(self, target: tuple[str, int]) -> int:
        """Connections open right now to one of the targets."""
        return sum(1 for t in self._upstream_of.values() if t == target)

    def open_connections(self) -> list[tuple[tuple[str, int], tuple[str, int]]]:
        """(client address, target) of every connection carried right now."""
        out = []
        for task, target in self._upstream_of.items():
            peer = self._conns[task][0].get_extra_info("peername") if task in self._conns else None
            if peer:
                out.append(((str(peer[0]), int(peer[1])), target))
        return out

    def buffered_bytes(self) -> list[int]:
        """Bytes held right now by each direction of each open connection."""
        return [line.buffered for lines in self._lines.values() for line in lines]

    def lines(self) -> list[_DelayLine]:
        return [line for lines in self._lines.values() for line in lines]

    def cut(self, refuse: Callable[[str], bool]) -> int:
        """Emulate a cut link: from now on, refuse connections from client IPs for which
        ``refuse(ip)`` is True, and reset those open now. Returns how many were reset."""
        self.refuse = refuse
        reset = 0
        for writers in list(self._conns.values()):
            peer = writers[0].get_extra_info("peername")
            if refuse(peer[0] if peer else ""):
                for w in writers:
                    w.transport.abort()  # a reset, not a clean close: the link is gone
                reset += 1
        return reset

    def mend(self) -> None:
        """Undo :meth:`cut`."""
        self.refuse = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1], reuse_address=True)
        if self.health is not None:
            self.health.acquire()
        log.debug("delay proxy listening", extra={
            "proxy": self.name, "targets": ", ".join(f"{h}:{p}" for h, p in self.targets)})

    async def stop(self) -> None:
        if self.health is not None and self._server is not None:
            await self.health.release()
        if self._server is not None:
            self._server.close()
        # closing the sockets ends every pipe on its own (cancelling stream handler
        # tasks makes asyncio log spurious errors)
        for writers in list(self._conns.values()):
            for w in writers:
                w.close()
        tasks = list(self._conns)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2.0)
            for t in pending:
                t.cancel()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2.0)
            self._server = None

    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections_total += 1
        peer = cwriter.get_extra_info("peername")
        client_ip = peer[0] if peer else ""
        if self.refuse is not None and self.refuse(client_ip):
            cwriter.transport.abort()
            return
        writers = self._conns[task] = [cwriter]
        d = self.delay(client_ip)
        try:
            source = client_ip if self.preserve_client_ip and client_ip else self.upstream_source
            upstream = await self._connect_upstream(source)
            if upstream is None:
                # every upstream down: the client sees the connection close, as with a dead host
                return
            target, ureader, uwriter = upstream
            self._upstream_of[task] = target
            writers.append(uwriter)
            dl = self._lines[task] = [
                _DelayLine(creader, uwriter, d, self.max_buffered),
                _DelayLine(ureader, cwriter, d, self.max_buffered),
            ]
            lines = [asyncio.create_task(x.run()) for x in dl]
            try:
                # both directions end on EOF; a reset on either side ends both
                done, pending = await asyncio.wait(lines, return_when=asyncio.FIRST_EXCEPTION)
                if pending:
                    for w in writers:
                        w.close()
                    await asyncio.wait(pending)
                for t in lines:
                    if not t.cancelled():
                        t.exception()  # retrieved: a reset is an ordinary end here
            finally:
                for t in lines:
                    t.cancel()
                uwriter.close()
        finally:
            cwriter.close()
            self._conns.pop(task, None)
            self._lines.pop(task, None)
            self._upstream_of.pop(task, None)


def proxies_for(cfg: MeshConfig, admin_token: str | None = None) -> list[DelayProxy]:
    """One HTTP, one gRPC and one peer-listener delay proxy per region whose advertised
    address differs from its listen address, each in front of every balancer of the region.
    Without ``emulate_latency``: only a fleet's, without delay (they still spread its
    connections). With ``admin_token`` a fleet's entry also follows the controller's
    topology (members it lists dead get no new connection)."""
    out = []
    for r in cfg.regions:
        b = r.balancer
        members = r.balancer_members
        if not cfg.emulate_latency and len(members) == 1:
            continue
        d = delay_for(cfg, r.name) if cfg.emulate_latency else _no_delay
        # like an NLB's target groups, every listener's group checks the members' HTTP /health
        feed = None if admin_token is None else ControllerFeed(
            cfg.controller.http_listen.http_url + "/v1/topology", admin_token, r.name)
        health = (MemberHealth([m.listen.http_url + "/health" for m in members], controller=feed)
                  if len(members) > 1 else None)
        if b.advertise != b.listen:
            http = [(m.listen.host, m.listen.port) for m in members]
            out.append(DelayProxy((b.advertise.host, b.advertise.port), http[0], d, more_targets=http[1:],
                                  health=health,
                                  name=f"{r.name} http {b.advertise}", region=r.name, kind="http",
                                  preserve_client_ip=True))
        if b.grpc_advertise != b.grpc_listen:
            grpc = [(m.grpc_listen.host, m.grpc_listen.port) for m in members]
            out.append(DelayProxy((b.grpc_advertise.host, b.grpc_advertise.port), grpc[0], d, more_targets=grpc[1:],
                                  health=health,
                                  name=f"{r.name} grpc {b.grpc_advertise}", region=r.name, kind="grpc",
                                  preserve_client_ip=True))
        if b.peer_listen is not None and b.peer_advertise is not None and b.peer_advertise != b.peer_listen:
            # byte-level: the forwards' TLS passes through untouched (and unreadable); the
            # config gives every member a peer listener when the first has one
            peer = [(m.peer_listen.host, m.peer_listen.port) for m in members if m.peer_listen is not None]
            out.append(DelayProxy((b.peer_advertise.host, b.peer_advertise.port), peer[0], d, more_targets=peer[1:],
                                  health=health,
                                  name=f"{r.name} peer {b.peer_advertise}", region=r.name, kind="peer",
                                  preserve_client_ip=True))
    return out


def _no_delay(ip: str) -> float:
    return 0.0


def _split_hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def start_egress_forwarder(target: str, source: str, listen_host: str = "127.0.0.1") -> DelayProxy:
    """A started zero-delay forwarder on ``listen_host``:<free port> whose connections to
    ``target`` ("host:port") leave from ``source``.

    For clients that cannot bind their source address themselves: gRPC's Python channels
    have no such option, so a balancer dials ``f"{listen_host}:{fwd.port}"`` instead of the
    peer, and the peer's delay proxy sees the balancer's ``egress_source`` (its region).
    ``await fwd.stop()`` when done.
    """
    fwd = DelayProxy((listen_host, 0), _split_hostport(target), lambda ip: 0.0,
                     name=f"egress {source} -> {target}", upstream_source=source)
    await fwd.start()
    return fwd
