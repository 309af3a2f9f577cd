"""The delay proxy adds each link's one-way latency by source region, keeps bytes intact
and in order, passes backpressure on, half-closes and shuts down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable

import pytest
import yaml
from aiohttp import web

from skymesh.config import parse_config
from skymesh.operations.latency_proxy import (
    HEALTHY_THRESHOLD,
    UNHEALTHY_THRESHOLD,
    ControllerFeed,
    DelayProxy,
    MemberHealth,
    _DelayLine,
    delay_for,
    listed_dead,
    proxies_for,
    start_egress_forwarder,
)
from skymesh.runtime.procs import free_port
from tests.mesh_helpers import ROOT, local_config_free_ports


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield int(srv.sockets[0].getsockname()[1])
    finally:
        srv.close()


@contextlib.asynccontextmanager
async def running(proxy: DelayProxy) -> AsyncIterator[DelayProxy]:
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def until(cond: Callable[[], bool]) -> None:
    """Wait for a condition (the test's own timeout guards against never)."""
    for _ in itertools.count():
        if cond():
            return
        await asyncio.sleep(0.01)


async def round_trip(port: int, source: str, payload: bytes) -> tuple[float, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    t0 = time.perf_counter()

    async def send() -> None:
        w.write(payload)
        await w.drain()

    # read while writing: an echo through a proxy with backpressure would deadlock otherwise
    _, got = await asyncio.gather(send(), r.readexactly(len(payload)))
    elapsed = time.perf_counter() - t0
    w.close()
    return elapsed, got


def test_delay_is_chosen_by_the_source_network() -> None:
    cfg = parse_config(local_config_free_ports())
    into_us = delay_for(cfg, "us-east-1")
    assert into_us("127.2.0.5") == pytest.approx(0.040)  # eu-west-1 -> us-east-1
    assert into_us("127.2.0.1") == pytest.approx(0.040)  # eu balancer's egress source
    assert into_us("127.3.9.9") == pytest.approx(0.080)
    assert into_us("10.3.1.1") == pytest.approx(0.080)
    assert into_us("127.1.0.5") == pytest.approx(cfg.local_latency_ms / 1000)
    assert into_us("127.0.0.1") == pytest.approx(cfg.local_latency_ms / 1000)  # unknown: local
    assert into_us("::1") == pytest.approx(cfg.local_latency_ms / 1000)
    assert into_us("not-an-ip") == pytest.approx(cfg.local_latency_ms / 1000)
    assert delay_for(cfg, "ap-northeast-1")("127.2.0.5") == pytest.approx(0.110)


def test_one_http_one_grpc_and_one_peer_proxy_per_advertised_region() -> None:
    data = local_config_free_ports()
    data["regions"][2]["balancer"].pop("advertise")  # advertised on listen: nothing to proxy
    data["regions"][1]["balancer"].pop("peer_advertise")
    cfg = parse_config(data)
    proxies = proxies_for(cfg)
    assert len(proxies) == 7
    b = cfg.regions[0].balancer
    assert b.peer_listen is not None and b.peer_advertise is not None
    assert {(p.listen, p.target, p.kind) for p in proxies[:3]} == {
        ((b.advertise.host, b.advertise.port), (b.listen.host, b.listen.port), "http"),
        ((b.grpc_advertise.host, b.grpc_advertise.port), (b.grpc_listen.host, b.grpc_listen.port), "grpc"),
        ((b.peer_advertise.host, b.peer_advertise.port), (b.peer_listen.host, b.peer_listen.port), "peer"),
    }


async def test_round_trip_from_a_remote_region_takes_twice_the_one_way_delay(echo: int) -> None:
    cfg = parse_config(local_config_free_ports())
    # the proxy fronts a us-east-1 balancer: eu-west-1 is 40 ms one way, us-east-1 local 1 ms
    async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo), delay_for(cfg, "us-east-1"))) as p:
        from_eu, got = await round_trip(p.port, "127.2.0.5", b"ping")
        from_ap, _ = await round_trip(p.port, "127.3.0.5", b"ping")
        from_us, _ = await round_trip(p.port, "127.1.0.5", b"ping")
        from_unknown, _ = await round_trip(p.port, "127.0.0.1", b"ping")
    assert got == b"ping"
    assert from_eu >= 0.080  # 40 ms each way
    assert from_ap >= 0.160  # 80 ms each way
    assert from_us < from_eu / 2
    assert from_unknown < from_eu / 2


async def test_large_stream_arrives_intact_and_in_order(echo: int) -> None:
    payload = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(60_000))  # 1.9 MB
    async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo), lambda ip: 0.02)) as p:
        elapsed, got = await round_trip(p.port, "127.0.0.1", payload)
    assert got == payload
    assert elapsed >= 0.04


async def test_release_times_are_per_chunk_arrival_so_delays_do_not_add_up() -> None:
    # chunks that arrive together are all due one delay after their arrival (not one
    # delay after the previous chunk left): the queue carries absolute release times
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()

    class NullWriter:
        def write(self, data: bytes) -> None: ...
        async def drain(self) -> None: ...
        def can_write_eof(self) -> bool:
            return False

    line = _DelayLine(reader, NullWriter(), delay=30.0, max_buffered=1 << 30)  # type: ignore[arg-type]
    t0 = loop.time()
    task = asyncio.create_task(line.run())
    for i in range(10):
        reader.feed_data(bytes([i]) * 1000)
        await asyncio.sleep(0)  # one read per chunk
    reader.feed_eof()
    await until(lambda: bool(line.queue) and line.queue[-1][1] == b"")
    t1 = loop.time()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    dues = [due for due, _ in line.queue]
    # the sender took the first chunk and sleeps until it is due; the rest wait queued,
    # every one due a single delay after it arrived
    assert len(dues) >= 2
    assert all(t0 + 30.0 <= d <= t1 + 30.0 for d in dues)
    sent = b"".join(bytes([i]) * 1000 for i in range(10))
    queued = b"".join(data for _, data in line.queue)
    assert queued and sent.endswith(queued)  # in order, nothing reordered


async def test_a_slow_receiver_pushes_back_and_nothing_is_lost() -> None:
    release = asyncio.Event()
    received = bytearray()
    done = asyncio.Event()

    async def slow_sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await release.wait()
        while data := await r.read(1 << 20):
            received.extend(data)
        done.set()
        w.close()

    sink = await asyncio.start_server(slow_sink, "127.0.0.1", 0)
    sink_port = int(sink.sockets[0].getsockname()[1])
    limit = 256 * 1024
    payload = hashlib.sha256(b"bp").digest() * (2 * 1024 * 1024)  # 64 MiB: more than all socket buffers
    try:
        async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", sink_port), lambda ip: 0.001,
                                      max_buffered=limit)) as p:
            _, w = await asyncio.open_connection("127.0.0.1", p.port)

            async def send() -> None:
                w.write(payload)
                await w.drain()
                w.write_eof()

            sender = asyncio.create_task(send())
            # the client -> upstream direction fills up to its bound and stops reading
            await until(lambda: bool(p.lines()) and not p.lines()[0].room.is_set())
            assert not sender.done()  # the client is held back, not buffered without bound
            assert max(p.buffered_bytes()) <= limit + 64 * 1024
            release.set()
            await sender
            await done.wait()
            w.close()
    finally:
        sink.close()
    assert bytes(received) == payload


async def test_half_close_passes_through(echo: int) -> None:
    async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo), lambda ip: 0.005)) as p:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"last words")
        w.write_eof()  # the echo server answers and closes after our EOF
        assert await r.read() == b"last words"  # read() to EOF: the close came through
        w.close()


async def test_upstream_down_closes_the_client_connection() -> None:
    dead = free_port()
    async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", dead), lambda ip: 0.001)) as p:
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        w.write(b"anyone?")
        with contextlib.suppress(ConnectionError):
            assert await r.read() == b""
        w.close()
        assert p.active_connections == 0


async def test_stop_closes_open_connections(echo: int) -> None:
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo), lambda ip: 0.001)
    await proxy.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        w.write(b"x")
        assert await r.readexactly(1) == b"x"
        assert proxy.active_connections == 1
    finally:
        await proxy.stop()
    with contextlib.suppress(ConnectionError):
        assert await r.read() == b""
    assert proxy.active_connections == 0
    w.close()


async def test_egress_forwarder_makes_a_client_that_cannot_bind_look_like_its_region(echo: int) -> None:
    # what a balancer's gRPC channel (no source-address option) goes through: the peer's
    # delay proxy sees the egress source (eu-west-1) and applies the eu -> us delay
    cfg = parse_config(local_config_free_ports())
    seen: list[str] = []

    def into_us(ip: str) -> float:
        seen.append(ip)
        return delay_for(cfg, "us-east-1")(ip)

    async with running(DelayProxy(("127.0.0.1", 0), ("127.0.0.1", echo), into_us)) as us_proxy:
        fwd = await start_egress_forwarder(f"127.0.0.1:{us_proxy.port}", "127.2.0.1")
        try:
            elapsed, got = await round_trip(fwd.port, "127.0.0.1", b"heartbeat")
        finally:
            await fwd.stop()
    assert got == b"heartbeat"
    assert seen == ["127.2.0.1"]
    assert elapsed >= 0.080


async def test_client_ip_is_preserved_and_a_cut_link_refuses_and_resets() -> None:
    """The balancer behind a mesh proxy sees the user's own address (its region decides
    residency); a cut refuses matching sources, resets their open connections, and leaves
    the others alone until mended."""
    seen: list[str] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(w.get_extra_info("peername")[0])
        with contextlib.suppress(ConnectionError):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = int(srv.sockets[0].getsockname()[1])
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port), lambda ip: 0.0, preserve_client_ip=True)
    try:
        async with running(proxy):
            _, echoed = await round_trip(proxy.port, "127.2.0.9", b"hi")
            assert echoed == b"hi" and seen == ["127.2.0.9"]
            # an open connection from the source to be cut, and one from another source
            r1, w1 = await asyncio.open_connection("127.0.0.1", proxy.port, local_addr=("127.1.0.9", 0))
            r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port, local_addr=("127.3.0.9", 0))
            await until(lambda: proxy.active_connections == 2)
            assert proxy.cut(lambda ip: ip == "127.1.0.9") == 1
            with contextlib.suppress(ConnectionError):  # reset: the link is gone (EOF or RST)
                assert await r1.read(10) == b""
            w2.write(b"still here")
            assert await r2.readexactly(10) == b"still here"
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await round_trip(proxy.port, "127.1.0.9", b"x")
            proxy.mend()
            _, echoed = await round_trip(proxy.port, "127.1.0.9", b"back")
            assert echoed == b"back"
            for w in (w1, w2):
                w.close()
    finally:
        srv.close()


class NamedUpstream:
    """A loopback server that greets each connection with its name, then echoes; ``kill``
    stops listening and resets the connections it has open (a member SIGKILLed)."""

    def __init__(self, name: bytes) -> None:
        self.name = name
        self.server: asyncio.Server | None = None
        self.open: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.open.append(w)
            w.write(self.name + b"\n")
            with contextlib.suppress(ConnectionError):
                await w.drain()
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def kill(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for w in self.open:
            w.transport.abort()
        self.open = []


@pytest.fixture
async def two_members() -> AsyncIterator[tuple[NamedUpstream, int, NamedUpstream, int]]:
    a, b = NamedUpstream(b"b0"), NamedUpstream(b"b1")
    ports = (await a.start(), await b.start())
    try:
        yield a, ports[0], b, ports[1]
    finally:
        a.kill()
        b.kill()


async def greeting(port: int) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection through the proxy: (the member's name, reader, writer)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    return (await r.readline()).strip(), r, w


async def names_reached(port: int, n: int) -> list[bytes]:
    """The members that ``n`` new connections through the proxy reach, in order."""
    out = []
    for _ in range(n):
        name, _, w = await greeting(port)
        out.append(name)
        w.close()
    return out


async def test_new_connections_alternate_over_the_members(
        two_members: tuple[NamedUpstream, int, NamedUpstream, int]) -> None:
    _, port_a, _, port_b = two_members
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port_a), lambda ip: 0.001,
                       more_targets=[("127.0.0.1", port_b)])
    async with running(proxy) as p:
        seen = []
        for _ in range(6):
            name, r, w = await greeting(p.port)
            w.write(b"ping")
            assert await r.readexactly(4) == b"ping"  # the whole connection goes to that member
            seen.append(name)
            w.close()
        assert seen == [b"b0", b"b1"] * 3
        assert p.connections_by_target == {("127.0.0.1", port_a): 3, ("127.0.0.1", port_b): 3}


async def test_a_dead_member_gets_no_new_connections_and_no_client_sees_a_refusal(
        two_members: tuple[NamedUpstream, int, NamedUpstream, int]) -> None:
    a, port_a, b, port_b = two_members
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port_a), lambda ip: 0.001,
                       more_targets=[("127.0.0.1", port_b)])
    async with running(proxy) as p:
        first = [await greeting(p.port) for _ in range(2)]
        assert [name for name, _, _ in first] == [b"b0", b"b1"]
        assert p.open_connections_to(("127.0.0.1", port_b)) == 1
        b.kill()
        # the connection it had open ends: the only thing a client sees of its death
        _, r_b, w_b = first[1]
        with contextlib.suppress(ConnectionError):
            assert await r_b.read() == b""
        w_b.close()
        for _ in range(6):
            name, r, w = await greeting(p.port)
            assert name == b"b0"
            w.write(b"still here")
            assert await r.readexactly(10) == b"still here"
            w.close()
        assert p.connections_by_target[("127.0.0.1", port_b)] == 1
        await until(lambda: p.open_connections_to(("127.0.0.1", port_b)) == 0)
        # the connection open to the live member was never disturbed
        _, r_a, w_a = first[0]
        w_a.write(b"ok")
        assert await r_a.readexactly(2) == b"ok"
        w_a.close()
        a.kill()
        # no member left: the client sees the connection close
        r, w = await asyncio.open_connection("127.0.0.1", p.port)
        with contextlib.suppress(ConnectionError):
            assert await r.read() == b""
        w.close()


class HealthAnswers:
    """A /health endpoint per member name, answering 200 or 503 as told; and a controller's
    /v1/topology listing the members of ``dead`` dead (status ``topology_status``, the
    admin token ``TOKEN`` required), counting its reads."""

    TOKEN = "entry-test-token"

    def __init__(self) -> None:
        self.passing = {"b0": True, "b1": True}
        self.dead: set[str] = set()
        self.topology_status = 200
        self.topology_reads = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if self.passing[request.match_info["name"]] else 503)

        async def topology(request: web.Request) -> web.Response:
            self.topology_reads += 1
            if request.headers.get("Authorization") != f"Bearer {self.TOKEN}":
                return web.Response(status=401)
            members = [{"balancer_id": name, "alive": name not in self.dead,
                        "http_url": f"http://127.0.0.1:{self.port}/{name}"} for name in self.passing]
            return web.json_response({"balancers": [{"region": "us-east-1", "members": members}]},
                                     status=self.topology_status)

        app = web.Application()
        app.router.add_get("/{name}/health", health)
        app.router.add_get("/v1/topology", topology)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}/health"


async def test_a_member_failing_its_health_check_gets_no_new_connections_until_it_passes_again(
        two_members: tuple[NamedUpstream, int, NamedUpstream, int]) -> None:
    """A draining member fails /health while it still listens: the entry stops sending it
    new connections (so none reaches it as its listener closes), and fails open when no
    member passes."""
    _, port_a, _, port_b = two_members
    answers = HealthAnswers()
    await answers.start()
    assert answers.runner is not None
    health = MemberHealth([answers.url("b0"), answers.url("b1")])
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port_a), lambda ip: 0.0,
                       more_targets=[("127.0.0.1", port_b)], health=health)

    def checks_of_b1_from_now(k: int) -> Callable[[], bool]:
        start = health.checks[answers.url("b1")]
        return lambda: health.checks[answers.url("b1")] >= start + k

    try:
        async with running(proxy):
            assert await names_reached(proxy.port, 4) == [b"b0", b"b1"] * 2
            answers.passing["b1"] = False
            await until(lambda: not health.healthy[answers.url("b1")])
            assert await names_reached(proxy.port, 4) == [b"b0"] * 4  # b1 still listens, yet gets nothing new
            answers.passing["b0"] = False  # none passes: fail open, spread over all
            await until(lambda: not health.healthy[answers.url("b0")])
            assert sorted(await names_reached(proxy.port, 4)) == [b"b0", b"b0", b"b1", b"b1"]
            answers.passing.update(b0=True, b1=True)
            await until(lambda: all(health.healthy.values()))
            assert sorted(await names_reached(proxy.port, 4)) == [b"b0", b"b0", b"b1", b"b1"]
            # fewer failed checks in a row than the threshold do not take a member out
            answers.passing["b1"] = False
            await until(checks_of_b1_from_now(UNHEALTHY_THRESHOLD - 1))
            answers.passing["b1"] = True
            await until(checks_of_b1_from_now(3))
            assert health.healthy[answers.url("b1")]
    finally:
        await answers.runner.cleanup()
    assert health._task is None  # the checks stop with the last proxy using them


async def test_the_entry_takes_out_the_members_its_controller_lists_dead(
        two_members: tuple[NamedUpstream, int, NamedUpstream, int]) -> None:
    """A frozen member may still pass nothing and fail nothing for seconds (its checks time
    out one by one); the controller's word takes it out at once. Every member listed
    dead, or a controller that has not answered for ``controller_stale_s``, leaves the
    entry on its own checks; until then a failed read keeps the last word."""
    _, port_a, _, port_b = two_members
    answers = HealthAnswers()
    await answers.start()
    assert answers.runner is not None
    feed = ControllerFeed(f"http://127.0.0.1:{answers.port}/v1/topology", HealthAnswers.TOKEN, "us-east-1")
    # the last word kept however long reads fail, until the test lowers the bound
    health = MemberHealth([answers.url("b0"), answers.url("b1")], controller=feed, controller_stale_s=3600.0)
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port_a), lambda ip: 0.0,
                       more_targets=[("127.0.0.1", port_b)], health=health)

    async def two_more_reads() -> None:
        start = answers.topology_reads
        await until(lambda: answers.topology_reads >= start + 2)

    try:
        async with running(proxy):
            answers.dead = {"b1"}
            await until(lambda: health.listed_dead == {answers.url("b1")})
            assert health.healthy[answers.url("b1")]  # its own checks still pass
            assert await names_reached(proxy.port, 4) == [b"b0"] * 4
            # b0's checks fail too (a busy machine's timeouts): none is in service, and
            # failing open the entry tries the member the controller does not list dead first
            answers.passing["b0"] = False
            await until(lambda: not health.healthy[answers.url("b0")])
            assert await names_reached(proxy.port, 4) == [b"b0"] * 4
            answers.passing["b0"] = True
            await until(lambda: health.healthy[answers.url("b0")])
            answers.dead = {"b0", "b1"}  # the controller lost the whole region: fail open
            await two_more_reads()
            assert health.listed_dead == frozenset()
            assert sorted(await names_reached(proxy.port, 4)) == [b"b0", b"b0", b"b1", b"b1"]
            answers.dead = {"b1"}
            await until(lambda: health.listed_dead == {answers.url("b1")})
            # reads fail (a busy controller's timeouts): its last word holds, as a
            # deregistration does, and the member its own checks still pass stays out
            answers.topology_status = 500
            await two_more_reads()
            assert health.listed_dead == {answers.url("b1")}
            assert await names_reached(proxy.port, 4) == [b"b0"] * 4
            # failing past the stale bound (here: now): the entry's own checks alone
            health.controller_stale_s = 0.0
            await until(lambda: health.listed_dead == frozenset())
            assert sorted(await names_reached(proxy.port, 4)) == [b"b0", b"b0", b"b1", b"b1"]
    finally:
        await answers.runner.cleanup()


def test_what_a_topology_lists_dead_is_read_defensively() -> None:
    urls = ["http://m0/health", "http://m1/health"]

    def doc(*members: object, region: str = "r") -> dict[str, object]:
        return {"balancers": [{"region": region, "members": list(members)}]}

    assert listed_dead(doc({"alive": False, "http_url": "http://m1"}, {"alive": True, "http_url": "http://m0"}),
                       "r", urls) == {"http://m1/health"}
    assert listed_dead(doc({"alive": False, "http_url": "http://m1"}, region="other"), "r", urls) == frozenset()
    assert listed_dead(doc({"alive": False, "http_url": "http://elsewhere"}), "r", urls) == frozenset()
    for junk in (None, [], {"balancers": 3}, {"balancers": [7, {"region": "r", "members": [5, {"alive": "no"}]}]},
                 {"balancers": [{"region": "r", "members": 5}]},
                 doc({"alive": 0, "http_url": "http://m1"}), doc({"alive": False, "http_url": 9})):
        assert listed_dead(junk, "r", urls) == frozenset()


def test_member_health_needs_consecutive_failures_to_go_out_and_passes_to_come_back() -> None:
    h = MemberHealth(["u"])
    for _ in range(UNHEALTHY_THRESHOLD - 1):
        h.note("u", False)
    assert h.healthy["u"]
    h.note("u", True)
    for _ in range(UNHEALTHY_THRESHOLD - 1):
        h.note("u", False)
    assert h.healthy["u"]  # not enough in a row
    h.note("u", False)
    assert not h.healthy["u"]
    for _ in range(HEALTHY_THRESHOLD - 1):
        h.note("u", True)
    assert not h.healthy["u"]
    h.note("u", True)
    assert h.healthy["u"]


async def test_spreading_keeps_the_links_delay(two_members: tuple[NamedUpstream, int, NamedUpstream, int]) -> None:
    _, port_a, _, port_b = two_members
    proxy = DelayProxy(("127.0.0.1", 0), ("127.0.0.1", port_a), lambda ip: 0.04,
                       more_targets=[("127.0.0.1", port_b)])
    async with running(proxy) as p:
        for expected in (b"b0", b"b1"):
            t0 = time.monotonic()
            name, r, w = await greeting(p.port)
            w.write(b"x")
            assert await r.readexactly(1) == b"x"
            # the greeting came back one way, the echo went there and back: at least 3 x 40 ms
            assert name == expected and time.monotonic() - t0 >= 0.12
            w.close()


def test_a_fleet_regions_proxies_stand_in_front_of_every_member() -> None:
    cfg = parse_config(yaml.safe_load((ROOT / "configs" / "local-fleet.yaml").read_text()))
    proxies = proxies_for(cfg)
    assert len(proxies) == 9
    for p in proxies:
        members = cfg.region(p.region).balancer_members
        listener = {"http": "listen", "grpc": "grpc_listen", "peer": "peer_listen"}[p.kind]
        assert p.targets == tuple((getattr(m, listener).host, getattr(m, listener).port) for m in members)
        assert len(p.targets) == 2


def test_without_emulated_latency_only_a_fleets_entry_is_proxied_and_without_delay() -> None:
    data = local_config_free_ports(siblings=1)
    data["emulate_latency"] = False
    del data["regions"][1]["balancer"]["siblings"]
    proxies = proxies_for(parse_config(data))
    assert {p.region for p in proxies} == {"us-east-1", "ap-northeast-1"}  # eu-west-1: one balancer
    assert all(len(p.targets) == 2 and p.delay("127.2.0.5") == 0.0 for p in proxies)
    data["emulate_latency"] = True
    assert {p.region for p in proxies_for(parse_config(data))} == {"us-east-1", "eu-west-1", "ap-northeast-1"}
