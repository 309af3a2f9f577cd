"""The balancer's mesh services run their loops supervised: a bug in a heartbeat or
controller-link loop is counted in ``loop_restarts`` and the loop carries on, instead of
the link going quiet forever. Real gRPC on loopback; the balancer is a stand-in behind
the services' ports (tests/balancer_standin.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from skymesh.balancer import services
from skymesh.balancer.services import ControllerLink, PeerMesh, loop_restart_counts
from skymesh.proto_gen import mesh_pb2, mesh_pb2_grpc
from skymesh.routing.base import RoutingRequest
from skymesh.routing.health import ProbeSample
from tests.balancer_standin import StandInBalancer
from tests.mesh_helpers import free_port

pytestmark = pytest.mark.timeout(60)

INTERVAL_S = 0.05


def fake_balancer(region: str, grpc_port: int, peers: dict[str, int]) -> StandInBalancer:
    return StandInBalancer(region, grpc_port, peers, INTERVAL_S, controller_listen=f"127.0.0.1:{grpc_port}")


def fail_first_call(obj: Any, attr: str, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Make ``obj.attr`` raise on its first call; the returned event is set on a later one
    (the loop that calls it was restarted and is doing its work again)."""
    real = getattr(obj, attr)
    calls = 0
    called_again = asyncio.Event()

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError(f"injected failure in {attr}")
        called_again.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, attr, wrapper)
    return called_again


async def test_heartbeat_loops_restart_after_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    port_a, port_b = free_port(), free_port()
    # a dials b; b dials nobody, so only a's dial loop calls a.receive
    balancer_a, balancer_b = fake_balancer("a", port_a, {"b": port_b}), fake_balancer("b", port_b, {})
    a, b = PeerMesh(balancer_a, balancer_a), PeerMesh(balancer_b, balancer_b)
    hooked: list[str] = []
    a.on_loop_restart = lambda name, exc: hooked.append(name)
    received_again = fail_first_call(a, "receive", monkeypatch)
    watched_again = fail_first_call(a, "notify_state", monkeypatch)
    await b.start()
    await a.start()
    try:
        await received_again.wait()
        await watched_again.wait()
        assert a.loop_restarts == {"hb-b": 1, "hb-state": 1}
        assert sorted(hooked) == ["hb-b", "hb-state"]
        assert loop_restart_counts([a, b, object()]) == {"hb-b": 1, "hb-state": 1}
    finally:
        await a.stop()
        await b.stop()
    assert all(t.done() for t in a._tasks)


async def test_a_heartbeat_carries_the_drain_rate_peers_predict_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a peer predicts a forwarded request's wait from travels over real gRPC: a
    applies the placement rate b's region core reported in a heartbeat b sent."""
    port_a, port_b = free_port(), free_port()
    balancer_a = fake_balancer("a", port_a, {"b": port_b})
    a = PeerMesh(balancer_a, balancer_a)
    balancer_b = fake_balancer("b", port_b, {})
    b = PeerMesh(balancer_b, balancer_b)
    core = balancer_b.core
    core.set_replicas(["r0"], 0.0)
    start = asyncio.get_running_loop().time() - 3.0
    for i in range(6):  # six placements over the last three seconds
        t = start + i * 0.5
        core.probe("r0", ProbeSample(), t)
        core.submit(RoutingRequest(f"q{i}", (i,), 64, t), t)
        core.tick(t)
        core.complete(f"q{i}", t)
    sent: list[float] = []
    real_heartbeat = b.heartbeat

    def spy() -> Any:
        hb = real_heartbeat()
        sent.append(hb.placements_per_s)
        return hb

    monkeypatch.setattr(b, "heartbeat", spy)
    await b.start()
    await a.start()
    try:
        for _ in range(200):
            peer = balancer_a.core.offload.peers.get("b")
            if peer is not None and peer.placements_per_s > 0:
                break
            await asyncio.sleep(INTERVAL_S)
        assert peer is not None and peer.placements_per_s > 0
        assert peer.placements_per_s in sent
    finally:
        await a.stop()
        await b.stop()


async def test_a_peer_said_to_be_back_is_dialled_at_once_not_after_the_backoff(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While b is unreachable a's re-dials back off; when the controller says b is back
    (``redial``), a dials it at once. Here every backoff lasts ten minutes: only that
    wake-up can bring b's heartbeat within this test's time."""
    port_a, port_b = free_port(), free_port()
    balancer_a = fake_balancer("a", port_a, {"b": port_b})
    a = PeerMesh(balancer_a, balancer_a)
    balancer_b = fake_balancer("b", port_b, {})
    b = PeerMesh(balancer_b, balancer_b)
    backing_off = asyncio.Event()
    real_wait = services.wait_event

    async def long_backoff(event: asyncio.Event, timeout_s: float) -> bool:
        if event is a._redial.get("b"):  # the dial loop's backoff, not the heartbeat pace
            backing_off.set()
            timeout_s = 600.0
        return await real_wait(event, timeout_s)

    monkeypatch.setattr(services, "wait_event", long_backoff)
    await a.start()
    try:
        await backing_off.wait()  # b is down: a's first dial failed, and it backs off
        await b.start()
        a.redial("b")
        for _ in range(400):
            if balancer_a.core.offload.is_fresh("b", asyncio.get_running_loop().time()):
                break
            await asyncio.sleep(INTERVAL_S)
        assert balancer_a.core.offload.is_fresh("b", asyncio.get_running_loop().time())
    finally:
        await a.stop()
        await b.stop()


class FakeController(mesh_pb2_grpc.ControllerServicer):
    def __init__(self) -> None:
        self.registered = 0
        self.reported = asyncio.Event()

    async def Register(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.registered += 1
        return mesh_pb2.RegisterReply(accepted=True)

    async def Report(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.reported.set()
        return mesh_pb2.ReportReply(topology_version=1)

    async def WatchTopology(self, request: Any, context: Any) -> Any:  # noqa: N802
        yield mesh_pb2.Topology(version=1)
        await asyncio.Event().wait()  # the stream stays open, as the real controller's


async def start_fake_controller(port: int) -> tuple[grpc.aio.Server, FakeController]:
    server = grpc.aio.server()
    ctl = FakeController()
    mesh_pb2_grpc.add_ControllerServicer_to_server(ctl, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, ctl


async def test_controller_link_and_report_loops_restart_after_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    server, ctl = await start_fake_controller(port)
    link = ControllerLink(fake_balancer("a", port, {}), report_interval_s=INTERVAL_S)
    followed_again = fail_first_call(link, "apply_topology", monkeypatch)
    monkeypatch.setattr(link, "report", lambda: mesh_pb2.BalancerReport(region="a", epoch=1))
    reported_again = fail_first_call(link, "report", monkeypatch)
    await link.start()
    try:
        # the first topology raised: the link was restarted, registered again and now
        # follows the topology; the first report raised, the report loop carried on
        await followed_again.wait()
        await reported_again.wait()
        await ctl.reported.wait()
        assert ctl.registered == 2
        assert link.loop_restarts == {"controller-link": 1, "controller-report": 1}
    finally:
        await link.stop()
        await server.stop(grace=0)
    assert link._task is not None and link._task.done()


async def test_a_dispatch_round_that_moves_availability_wakes_the_heartbeat_senders() -> None:
    """The heartbeat goes out in the dispatch round that moved the region's availability
    (PeerMesh listens to dispatch rounds), not at the next poll of its state: the poll is
    only a safety net, once a heartbeat interval."""
    balancer = fake_balancer("a", free_port(), {})
    mesh = PeerMesh(balancer, balancer)
    sender = asyncio.Event()
    mesh._subscribers.add(sender)  # what each outgoing stream waits on
    core = balancer.core
    core.set_replicas(["r0"], 0.0)
    for listener in balancer.dispatch_listeners:  # a round that moved nothing yet
        listener()
    sender.clear()
    for listener in balancer.dispatch_listeners:  # nothing moved: nobody woken
        listener()
    assert not sender.is_set()
    now = asyncio.get_running_loop().time()
    core.probe("r0", ProbeSample(), now)  # r0 available: the region's availability moved
    core.tick(now)
    for listener in balancer.dispatch_listeners:  # the round's end, as the daemon calls them
        listener()
    assert sender.is_set()
